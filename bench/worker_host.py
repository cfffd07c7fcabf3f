"""The engine's host path at scale, without a GPU: what a step costs around the GPU's work.

A stand-in engine runs the real step loop (engine.qwen3.core.EngineCore with the real Scheduler) whose
runner only waits `--gpu-ms` per step with the GIL released, as the step thread does while CUDA
works, and returns fake codes and Code2Wav audio of the real sizes. Its outputs leave through
ChunkChannels as the Qwen3 engine's do. It is served from a worker process (engine.workers, as
`cadence serve` runs the Qwen3 engine on a GPU) to this process, which keeps `--streams` requests
of `--frames` frames open (closed loop) and consumes their chunks.

Reported per level: steps per second against the ideal 1000 / gpu_ms, the step thread's host time
per step (schedule + update + outputs) and its CPU time in it (the rest waits for the GIL or the
OS), both averaged from the worker's start, audio seconds delivered per second, and CPU of the worker
process and of this one. A step interval far above gpu_ms at many streams is host overhead that a
GPU run pays too. Also the hand-off latency: from the step thread's `put` of a chunk to this
process's consumer receiving it (p50/p90/p99, ms), for every chunk and for each request's first
chunk alone, and the step interval's p50/p90. The hand-off time rides in the chunk's first four
samples, 15 bits each, in a form the int16 PCM of the wire keeps (the bench's audio is silence;
both processes read the same monotonic clock). `--beside-ms HOST,WAIT` adds a thread to the worker
that holds the GIL HOST ms then waits WAIT ms, over and over, as the aligner's calls do beside the
step thread; `--switch-interval-ms` sets the worker's GIL switch interval. `--aligned MODE` serves
the engine behind the real aligner stage (engine.alignment: tracker, worker thread, admission, forced
times) with a stand-in aligner whose call holds the GIL `--aligner-host-ms`, then waits with it
released as the aligner's GPU work takes (`--aligner-gpu-ms BASE,PER_JOB`), and times the text's
real units; each request then asks for that alignment mode.

    .venv/bin/python -m bench.worker_host --streams 64,256,512 --gpu-ms 30 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.api import (  # noqa: E402
    PCM16_FULL_SCALE,
    AudioChunk,
    ChunkListener,
    EngineInfo,
    EngineLoad,
    Overloaded,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    pcm16,
)
from engine.bridge import ChunkBatch, ChunkChannel  # noqa: E402
from engine.qwen3.core import EngineCore  # noqa: E402
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager  # noqa: E402
from engine.qwen3.plan import RequestOutput, StepOutput, StepPlan  # noqa: E402
from engine.qwen3.request import SAMPLES_PER_FRAME, Request, RequestStatus, Segment  # noqa: E402
from engine.qwen3.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from engine.workers import WorkerPoolEngine, WorkerSpec  # noqa: E402

PROMPT_LEN = 40
TEXT = "Hello there, and thank you for calling. Your order shipped this morning and should arrive on Friday."


_STAMP_SAMPLES = 4  # 15 bits each: microseconds of the monotonic clock


def stamp(samples: np.ndarray) -> None:
    """Write the hand-off time into the chunk's first samples, as values that int16 PCM keeps
    (int16 samples take the integers themselves)."""
    if samples.size >= _STAMP_SAMPLES:
        us = int(time.perf_counter() * 1e6)
        scale = 1 if samples.dtype == np.int16 else PCM16_FULL_SCALE
        for k in range(_STAMP_SAMPLES):
            samples[k] = ((us >> (15 * k)) & 0x7FFF) / scale


def stamp_of(samples: np.ndarray) -> float | None:
    if samples.size < _STAMP_SAMPLES:
        return None
    pcm = samples[:_STAMP_SAMPLES] if samples.dtype == np.int16 else pcm16(samples[:_STAMP_SAMPLES])
    return sum(int(v) << (15 * k) for k, v in enumerate(pcm)) / 1e6


def percentiles_ms(values: list[float], prefix: str) -> dict[str, float]:
    """p50/p90/p99 (nearest rank) in ms; plain sorting, cheap enough for the worker's load report."""
    ranked = sorted(values)
    return {
        f"{prefix}_p{q}_ms": round(1000 * ranked[(len(ranked) * q - 1) // 100], 2)
        for q in (50, 90, 99)
        if ranked
    }


class SleepRunner:
    """Waits out the GPU's share of a step (GIL released), then answers like the runner."""

    def __init__(self, gpu_s: float) -> None:
        self.gpu_s = gpu_s
        self.host_s = 0.0  # host time of the step thread outside the waits, summed
        self.host_cpu_s = 0.0  # the step thread's CPU time in it (the rest: waits for the GIL)
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time()
        self.starts: deque[float] = deque(maxlen=100_000)  # each step's start (perf_counter)

    def intervals_since(self, t: float) -> list[float]:
        starts = [
            s for s in list(self.starts) if s >= t
        ]  # list(): one C call, the step thread appends meanwhile
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    def execute(self, plan: StepPlan, while_waiting: Callable[[], None] | None = None) -> StepOutput:
        start = time.perf_counter()
        self.starts.append(start)
        self.host_s += start - self._last
        self.host_cpu_s += time.thread_time() - self._last_cpu
        if while_waiting is not None:  # as the runner does once the sampling is queued
            while_waiting()
        time.sleep(max(0.0, start + self.gpu_s - time.perf_counter()))
        codes = [[7] * 16 for _ in plan.sampling_rows]
        audio = {c.request_id: np.zeros(c.num_frames * SAMPLES_PER_FRAME, np.int16) for c in plan.codec}
        audio |= {f.request_id: np.zeros(SAMPLES_PER_FRAME, np.int16) for f in plan.first_audio_now}
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time()
        return StepOutput(codes=codes, audio=audio)


class _Stream(SynthesisStream):
    def __init__(self, engine: HostOnlyEngine, request: SynthesisRequest) -> None:
        self.request_id = request.request_id
        self.engine = engine
        self.frames = request.forced_frames or 50
        self.channel = ChunkChannel()

    def push(self, segment: TextSegment) -> None:
        self.segment = segment

    def close_text(self) -> None:
        core = self.engine.core
        core.add_segment(self.request_id, Segment(text=self.segment, prompt_len=0, max_frames=self.frames))
        core.close_text(self.request_id)

    def cancel(self) -> None:
        self.engine.core.abort(self.request_id)
        self.channel.close()

    def listen(self, listener: ChunkListener) -> bool:
        self.channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self.channel.__aiter__()


class HostOnlyEngine:
    def __init__(self, streams: int, gpu_ms: float, window_s: float = 0.0) -> None:
        self.window_s = window_s  # the step-interval figures cover the last window_s seconds
        self.info = EngineInfo(
            name="host-only",
            model="none",
            sample_rate=24_000,
            voices=("default",),
            languages=("English",),
            default_voice="default",
        )
        layout = KVCacheLayout(num_slots=streams, max_len=512, bytes_per_token=1024)
        config = SchedulerConfig(
            max_batch=streams,
            codec_slots=streams,
            max_codec_rows=streams,
            queue_limit=4 * streams,
            max_tokens_per_step=streams + 512,
        )  # as cadence serve
        self.scheduler = Scheduler(config, KVCacheManager(layout))
        self.runner = SleepRunner(gpu_ms / 1000)
        self.core = EngineCore(self.scheduler, self.runner, self._on_outputs, self._prepare)
        self.streams: dict[str, _Stream] = {}

    async def start(self) -> None:
        self.core.start()

    async def stop(self) -> None:
        self.core.stop()

    def load(self) -> EngineLoad:
        steps = max(1, self.core.steps)
        extra = {
            "steps": float(self.core.steps),
            "host_ms_per_step": 1000 * self.runner.host_s / steps,
            "host_cpu_ms_per_step": 1000 * self.runner.host_cpu_s / steps,
        }
        extra |= percentiles_ms(
            self.runner.intervals_since(time.perf_counter() - self.window_s), "step_interval"
        )
        return EngineLoad(
            active=self.scheduler.num_active,
            queued=self.scheduler.num_queued,
            capacity=self.scheduler.config.codec_slots,
            queue_limit=self.scheduler.config.queue_limit,
            extra=extra,
        )

    def open(self, request: SynthesisRequest) -> _Stream:
        stream = _Stream(self, request)
        self.streams[request.request_id] = stream
        self.core.add_request(Request(request_id=request.request_id, arrival_time=self.scheduler.clock()))
        return stream

    async def register_voice(self, *args: Any) -> None:
        raise NotImplementedError

    @staticmethod
    def _prepare(segment: Segment) -> None:
        segment.prompt_len = PROMPT_LEN

    def _on_outputs(self, outs: list[RequestOutput]) -> None:
        batch = ChunkBatch()  # as the Qwen3 engine: the step's chunks reach the event loop together
        try:
            for o in outs:
                stream = self.streams.get(o.request_id)
                if stream is None:
                    continue
                if o.audio is not None:
                    samples = o.audio  # int16 PCM, as the Qwen3 runner hands it
                    stamp(samples)
                    batch.put(stream.channel, AudioChunk(o.request_id, samples, o.sample_offset))
                if o.finished:
                    del self.streams[o.request_id]
                    if o.status == RequestStatus.FINISHED_STOPPED:
                        batch.put(
                            stream.channel, AudioChunk(o.request_id, np.zeros(0, np.int16), 0, final=True)
                        )
                    else:
                        batch.finish(stream.channel)
        finally:
            batch.post()


def _hold_gil(seconds: float) -> None:
    """Python work for `seconds`: the GIL held but for the interpreter's forced switches."""
    until = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < until:
        n += sum(range(64))


def _beside(host_s: float, wait_s: float) -> None:
    """Another thread of the worker's interpreter, as the aligner's beside the engine: Python work
    holding the GIL for host_s (a call's inputs readied), then wait_s with it released (the call's
    wait on the GPU), over and over."""
    while True:
        _hold_gil(host_s)
        time.sleep(wait_s)


class StandInAligner:
    """An aligner's costs without a model: a call holds the GIL `host_s` (its inputs readied), then
    waits with it released `gpu_s + gpu_per_job_s` per job (its GPU work), and gives the text's
    real units (their times come from engine.alignment.forced_times)."""

    max_audio_s = 300.0

    def __init__(self, host_s: float, gpu_s: float, gpu_per_job_s: float) -> None:
        from aligner.text import UnitSplitter

        self.host_s, self.gpu_s, self.gpu_per_job_s = host_s, gpu_s, gpu_per_job_s
        self.splitter = UnitSplitter()

    def align(self, batch: Any) -> list[list[Any]]:
        from aligner.text import display_spans, locate_units
        from engine.alignment.api import AlignedWord

        _hold_gil(self.host_s)
        time.sleep(self.gpu_s + self.gpu_per_job_s * len(batch))
        out = []
        for _, _, text, language in batch:
            units = self.splitter.words(text, language)
            spans = display_spans(text, locate_units(text, units))
            out.append([AlignedWord(text[a:b], 0.0, 0.0, a, b) for a, b in spans])
        return out


def build(
    streams: int,
    gpu_ms: float,
    switch_interval_ms: float | None,
    window_s: float = 0.0,
    beside_ms: tuple[float, float] | None = None,
    aligner_ms: tuple[float, float, float] | None = None,
) -> Any:
    if switch_interval_ms:
        sys.setswitchinterval(switch_interval_ms / 1000)
    if beside_ms is not None:
        host_ms, wait_ms = beside_ms
        threading.Thread(target=_beside, args=(host_ms / 1000, wait_ms / 1000), daemon=True).start()
    engine = HostOnlyEngine(streams, gpu_ms, window_s)
    if aligner_ms is None:
        return engine
    from engine.alignment.engine import AlignedEngine
    from engine.alignment.forced_times import ForcedTimesAligner

    host, base, per_job = (ms / 1000 for ms in aligner_ms)
    return AlignedEngine(engine, ForcedTimesAligner(StandInAligner(host, base, per_job)))  # type: ignore[arg-type]


async def level(streams: int, args: argparse.Namespace) -> dict[str, Any]:
    beside = tuple(float(v) for v in args.beside_ms.split(",")) if args.beside_ms else None
    aligner_ms = None
    if args.aligned:
        base, per_job = (float(v) for v in args.aligner_gpu_ms.split(","))
        aligner_ms = (args.aligner_host_ms, base, per_job)
    build_engine = functools.partial(
        build, streams, args.gpu_ms, args.switch_interval_ms, args.seconds, beside, aligner_ms
    )
    pool = WorkerPoolEngine([WorkerSpec(build_engine, dict(os.environ))])
    await pool.start()
    samples = 0
    ids = iter(range(1 << 30))
    stop = asyncio.Event()
    measuring = False
    latencies: list[float] = []  # hand-off -> received, every stamped chunk in the window
    first_latencies: list[float] = []  # the same, each request's first chunk

    async def one_client() -> None:
        nonlocal samples
        while not stop.is_set():
            request = SynthesisRequest(
                request_id=f"r{next(ids)}", forced_frames=args.frames, word_alignment=args.aligned or None
            )
            stream = pool.open(request)
            stream.push(TextSegment(TEXT, char_start=0))
            stream.close_text()
            first = True
            try:
                async for chunk in stream:
                    samples += chunk.samples.size
                    handed = stamp_of(chunk.samples)
                    if measuring and handed is not None:
                        latencies.append(time.perf_counter() - handed)
                        if first:
                            first_latencies.append(latencies[-1])
                    first = first and handed is None
            except Overloaded as e:  # as a gateway client does: the same request after the wait
                await asyncio.sleep(e.retry_after_s)

    # the pool admits one stream until the worker's first load report gives its capacity
    for _ in range(100):
        if pool.load().capacity >= streams:
            break
        await asyncio.sleep(0.1)
    clients = [asyncio.create_task(one_client()) for _ in range(streams)]
    await asyncio.sleep(args.warmup)
    before = pool.load().extra, samples, time.perf_counter(), os.times()
    measuring = True
    await asyncio.sleep(args.seconds)
    measuring = False
    end_load = pool.load()
    after = end_load.extra, samples, time.perf_counter(), os.times()
    stop.set()
    await pool.stop()
    for task in clients:
        task.cancel()
    wall = after[2] - before[2]
    steps = after[0]["steps"] - before[0]["steps"]
    return {
        "streams": streams,
        "gpu_ms": args.gpu_ms,
        "switch_interval_ms": args.switch_interval_ms or 5.0,
        "beside_ms": args.beside_ms or None,
        "aligned": args.aligned or None,
        "steps_per_s": round(steps / wall, 1),
        "ideal_steps_per_s": round(1000 / args.gpu_ms, 1),
        "step_interval_ms": round(1000 * wall / max(1.0, steps), 2),
        "host_ms_per_step": round(after[0]["host_ms_per_step"], 2),
        "host_cpu_ms_per_step": round(after[0]["host_cpu_ms_per_step"], 2),
        "audio_s_per_s": round((after[1] - before[1]) / 24_000 / wall, 1),
        "worker_cpu_pct": round(
            100 * (after[0]["worker_cpu_seconds"] - before[0]["worker_cpu_seconds"]) / wall, 1
        ),
        "this_process_cpu_pct": round(100 * (sum(after[3][:2]) - sum(before[3][:2])) / wall, 1),
        **{k: v for k, v in after[0].items() if k.startswith("step_interval_")},
        **percentiles_ms(latencies, "handoff"),
        **percentiles_ms(first_latencies, "first_handoff"),
        "first_chunks": len(first_latencies),
        "active_at_end": end_load.active,
        **{
            k: round(v, 1)
            for k, v in after[0].items()
            if k in ("aligner_capacity", "aligner_streams", "aligner_jobs")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="64,256,512")
    ap.add_argument("--gpu-ms", type=float, default=30.0, help="the GPU's share of one step")
    ap.add_argument("--frames", type=int, default=60, help="frames per request (closed loop)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--switch-interval-ms", type=float, default=None, help="the worker's GIL switch interval")
    ap.add_argument(
        "--beside-ms",
        default="",
        help="HOST,WAIT: a thread beside the step thread holds the GIL HOST ms, then waits WAIT ms, "
        "over and over (the aligner's calls)",
    )
    ap.add_argument("--aligned", choices=("async", "sync"), default=None, help="behind the aligner stage")
    ap.add_argument("--aligner-host-ms", type=float, default=3.0, help="a call's host work, GIL held")
    ap.add_argument("--aligner-gpu-ms", default="10,0.8", help="BASE,PER_JOB: a call's wait on the GPU")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args()
    rows = [asyncio.run(level(int(n), args)) for n in args.streams.split(",")]
    for row in rows:
        print(json.dumps(row))
    print(
        "median step interval over ideal:",
        round(statistics.median(r["step_interval_ms"] / r["gpu_ms"] for r in rows), 2),
    )
    for row in rows:
        print(
            f"{row['streams']} streams: hand-off p50/p90/p99 {row.get('handoff_p50_ms')}/{row.get('handoff_p90_ms')}/"
            f"{row.get('handoff_p99_ms')} ms, first chunk {row.get('first_handoff_p50_ms')}/"
            f"{row.get('first_handoff_p90_ms')}/{row.get('first_handoff_p99_ms')} ms, step interval p50/p90 "
            f"{row.get('step_interval_p50_ms')}/{row.get('step_interval_p90_ms')} ms"
        )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
