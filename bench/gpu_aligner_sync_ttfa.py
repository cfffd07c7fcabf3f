"""Time to first audio that `alignment: "sync"` adds, at the real Qwen3-ForcedAligner-0.6B shapes.

The stage (engine.alignment.engine.AlignedEngine) wraps a paced stand-in for the TTS engine: each utterance's
first segment is `--first-s` seconds of audio produced `--speed` times faster than real time in
80 ms frames (as the Qwen3 engine streams them), its words estimated when the segment ends. In sync
mode the first audio leaves the stage only once the first segment is generated *and* aligned, so

    added TTFA = time to generate the first segment + wait in the aligner queue + the align call.

For `--concurrency` utterances started together it prints, per level, the added TTFA (p50/p95,
as the stage reports it in load().extra), the part of it after the segment was complete (queue +
align: what the aligner itself costs), and the aligner's batch sizes. Random bf16 weights. The stage
warms the aligner up when it starts (`Qwen3ForcedAligner.warm_up`), as a serving process does.

    python bench/gpu_aligner_sync_ttfa.py [--concurrency 1,8,32] [--first-s 2] [--speed 10]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import torch

from bench.gpu_aligner_bench import WORDS, build_aligner
from engine.alignment.api import Aligner
from engine.alignment.engine import AlignedEngine
from engine.api import (
    AudioChunk,
    EngineInfo,
    EngineLoad,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    WordTiming,
)

RATE = 24_000
FRAME = 1_920  # 80 ms


class PacedStream(SynthesisStream):
    def __init__(self, request: SynthesisRequest, seconds: float, speed: float) -> None:
        self.request_id = request.request_id
        self.seconds, self.speed = seconds, speed
        self.segments: asyncio.Queue[TextSegment | None] = asyncio.Queue()
        self.completed_at: float | None = None  # when the first segment's last frame was made
        self.cancelled = False

    def push(self, segment: TextSegment) -> None:
        self.segments.put_nowait(segment)

    def close_text(self) -> None:
        self.segments.put_nowait(None)

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._run()

    async def _run(self) -> AsyncIterator[AudioChunk]:
        rng = np.random.default_rng(abs(hash(self.request_id)) % 2**32)
        offset = 0
        while (segment := await self.segments.get()) is not None and not self.cancelled:
            frames = max(1, round(self.seconds * RATE / FRAME))
            start = offset
            for i in range(frames):
                await asyncio.sleep(FRAME / RATE / self.speed)
                audio = (0.1 * rng.standard_normal(FRAME)).astype(np.float32)
                words: tuple[WordTiming, ...] = ()
                if i == frames - 1:  # estimates when the segment ends, spread by characters
                    self.completed_at = self.completed_at or time.perf_counter()
                    words = spread(segment, start, offset + FRAME)
                yield AudioChunk(self.request_id, audio, offset, words)
                offset += FRAME
        yield AudioChunk(self.request_id, np.zeros(0, np.float32), offset, final=True)


def spread(segment: TextSegment, start: int, end: int) -> tuple[WordTiming, ...]:
    spans, at = [], 0
    for word in segment.text.split():
        at = segment.text.index(word, at)
        spans.append((at, at + len(word)))
        at += len(word)
    step = (end - start) // max(1, len(spans))
    return tuple(
        WordTiming(
            segment.text[a:b],
            start + i * step,
            start + (i + 1) * step,
            segment.source_offset(a),
            segment.source_offset(b),
            "estimate",
        )
        for i, (a, b) in enumerate(spans)
    )


class PacedEngine:
    def __init__(self, seconds: float, speed: float) -> None:
        self.info = EngineInfo(name="paced", model="noise", sample_rate=RATE)
        self.seconds, self.speed = seconds, speed
        self.streams: list[PacedStream] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def load(self) -> EngineLoad:
        return EngineLoad(active=len(self.streams), queued=0, capacity=1024, queue_limit=0)

    def open(self, request: SynthesisRequest) -> PacedStream:
        stream = PacedStream(request, self.seconds, self.speed)
        self.streams.append(stream)
        return stream

    async def register_voice(self, *args: object) -> None: ...


async def one_level(aligner: Aligner, concurrency: int, args: argparse.Namespace) -> None:
    inner = PacedEngine(args.first_s, args.speed)
    engine = AlignedEngine(inner, aligner, default_mode="sync", max_batch=args.max_batch)
    await engine.start()
    rng = np.random.default_rng(concurrency)
    words = max(1, int(args.first_s * 2.6))

    async def utterance(i: int) -> float:
        stream = engine.open(SynthesisRequest(request_id=f"u{i}", language="English"))
        text = " ".join(rng.choice(WORDS, size=words)) + ". "
        stream.push(TextSegment(text, 0))
        stream.push(TextSegment("And a second sentence follows.", len(text)))
        stream.close_text()
        first_out = None
        async for chunk in stream:
            if first_out is None and len(chunk.samples):
                first_out = time.perf_counter()
        inner_stream = inner.streams[i]
        assert first_out is not None and inner_stream.completed_at is not None
        return first_out - inner_stream.completed_at

    try:
        after_segment = await asyncio.gather(*(utterance(i) for i in range(concurrency)))
    finally:
        await engine.stop()
    added = sorted(engine.sync_delays_ms())
    stats = engine.worker.stats
    tail = sorted(1000 * s for s in after_segment)
    print(
        f"{concurrency:>11} {added[len(added) // 2]:>9.1f} {added[int(0.95 * (len(added) - 1))]:>9.1f}"
        f" {tail[len(tail) // 2]:>13.1f} {tail[-1]:>13.1f} {stats.jobs / max(1, stats.batches):>10.1f}"
        f" {stats.largest_batch:>8}"
    )


async def main_async(args: argparse.Namespace) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    aligner = build_aligner(
        torch.device("cuda"), dtype
    )  # the stage warms it up in start(), as a server's does
    print(
        f"{torch.cuda.get_device_name()} | first segment {args.first_s:g} s of audio made at "
        f"{args.speed:g}x real time ({1000 * args.first_s / args.speed:.0f} ms) | {args.dtype}"
    )
    print(
        f"{'concurrency':>11} {'add p50':>9} {'add p95':>9} {'align p50 ms':>13} {'align max ms':>13}"
        f" {'mean batch':>10} {'largest':>8}"
    )
    for level in (int(c) for c in args.concurrency.split(",")):
        await one_level(aligner, level, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--first-s", type=float, default=2.0, help="audio seconds in the first segment")
    parser.add_argument("--speed", type=float, default=10.0, help="TTS generation speed, x real time")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
