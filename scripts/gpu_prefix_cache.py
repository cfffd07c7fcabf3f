"""Time to first audio saved by prompt-prefix KV reuse, engine level, random Qwen3-TTS-1.7B weights.

    python scripts/gpu_prefix_cache.py                                   # H200, writes a random checkpoint
    python scripts/gpu_prefix_cache.py --checkpoint checkpoints/qwen3-1.7b-random
    python scripts/gpu_prefix_cache.py --size tiny --device cpu --streams 1 4   # smoke test of the script

The voice is an in-context clone with a 10 s reference (125 reference frames, a transcript of about
ten seconds of speech) and a random x-vector. For each concurrency N, N requests of that voice open
together (each a different sentence, a forced length of --frames frames) twice: with the prefix
cache off, then with it on and warm (one request of the voice served before). TTFA is measured per
request from open() to its first audio chunk. Reported: prompt and prefix positions, TTFA p50/p90
for both runs and what the cache saves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.api import SynthesisRequest, TextSegment  # noqa: E402
from engine.prefix_cache import PrefixKVCache  # noqa: E402
from engine.qwen3_engine import Qwen3Engine, Qwen3EngineConfig, _Voice  # noqa: E402

REFERENCE_TEXT = ("Thanks for calling back. I looked at the order this morning, and the replacement part "
                  "should arrive on Thursday, so we can book the technician for Friday afternoon.")
SENTENCES = [
    "Your appointment is confirmed for tomorrow at nine.", "I can help you with that right away.",
    "The package left our warehouse an hour ago.", "Could you spell your last name for me, please?",
    "We have two rooms left for that weekend.", "Let me check the balance on your account.",
    "The next train to the airport leaves in twelve minutes.", "That model comes in three colours.",
]
REFERENCE_FRAMES = 125  # 10 s at 12.5 frames per second


def clone_voice(engine: Qwen3Engine, seed: int = 0) -> _Voice:
    g = torch.Generator().manual_seed(seed)
    hidden = engine.cfg.talker.hidden_size
    device, dtype = engine.runner.device, engine.runner.dtype
    return _Voice(
        speaker_embedding=(0.02 * torch.randn(hidden, generator=g)).to(device, dtype),
        ref_codes=torch.randint(0, 2048, (REFERENCE_FRAMES, 16), generator=g).to(device),
        ref_text=REFERENCE_TEXT,
    )


def set_cache(engine: Qwen3Engine, cache: PrefixKVCache | None) -> None:
    engine.prefix_cache = engine.runner.prefix_cache = cache
    engine.scheduler.prefix_lookup = cache.lookup if cache is not None else None


async def one(engine: Qwen3Engine, rid: str, text: str, frames: int) -> float:
    t0 = time.perf_counter()
    stream = engine.open(SynthesisRequest(request_id=rid, voice="clone", language="English", forced_frames=frames))
    stream.push(TextSegment(text, char_start=0))
    stream.close_text()
    ttfa = None
    async for chunk in stream:
        if ttfa is None and chunk.samples.size:
            ttfa = time.perf_counter() - t0
    assert ttfa is not None, f"{rid}: no audio"
    return ttfa


async def wave(engine: Qwen3Engine, tag: str, n: int, frames: int) -> list[float]:
    return list(await asyncio.gather(*(one(engine, f"{tag}-{i}", SENTENCES[i % len(SENTENCES)], frames)
                                       for i in range(n))))


def summary(ttfas: list[float]) -> dict[str, float]:
    s = sorted(ttfas)
    return {"p50_ms": 1000 * statistics.median(s), "p90_ms": 1000 * s[min(len(s) - 1, int(0.9 * len(s)))],
            "mean_ms": 1000 * statistics.fmean(s)}


async def run(args: argparse.Namespace) -> list[dict]:
    path = args.checkpoint
    if path is None:
        from scripts.random_checkpoint import write_checkpoint

        path = Path(tempfile.mkdtemp(prefix="qwen3-random-"))
        write_checkpoint(path, args.size, args.device, ROOT / "deploy" / "bench" / "corpus.jsonl")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    top = max(args.streams)
    engine = Qwen3Engine.from_pretrained(path, args.device, dtype, Qwen3EngineConfig(
        max_streams=top, kv_slots=top, max_len=args.max_len, max_batch=args.max_batch,
        max_tokens_per_step=args.max_tokens_per_step, queue_limit=top, enforce_eager=args.device == "cpu",
        progress_bar=False, prefix_cache_bytes=args.cache_bytes, codec_frame_buckets=tuple(args.codec_frame_buckets)))
    cache = engine.prefix_cache
    assert cache is not None
    engine._voices["clone"] = clone_voice(engine)
    await engine.start()
    try:
        await wave(engine, "warm", min(4, top), args.frames)  # allocator and code paths, cache filled
        rows = []
        for n in args.streams:
            off: list[float] = []
            on: list[float] = []
            for rep in range(max(1, args.requests // n)):  # a few waves when n is small: steadier medians
                set_cache(engine, None)
                off += await wave(engine, f"off{n}-{rep}", n, args.frames)
                set_cache(engine, cache)
                hits = cache.hits
                on += await wave(engine, f"on{n}-{rep}", n, args.frames)
                assert cache.hits - hits == n, "every request of the warm voice should hit"
            a, b = summary(off), summary(on)
            rows.append({"streams": n, "off": a, "on": b, "saved_p50_ms": a["p50_ms"] - b["p50_ms"],
                         "saved_mean_ms": a["mean_ms"] - b["mean_ms"]})
        load = engine.load().extra
        prefix = cache.positions_reused / max(1, cache.hits)
        print(json.dumps({"prefix_positions": prefix, "cache_bytes": load["prefix_cache_bytes"],
                          "hits": cache.hits, "misses": cache.misses}))
    finally:
        await engine.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None, help="a random checkpoint (written when absent)")
    ap.add_argument("--size", default="1.7B", choices=["1.7B", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--frames", type=int, default=25)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--max-batch", type=int, default=256, help="rows per step (all streams of a wave at once)")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level at least (waves of N)")
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--codec-frame-buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 25],
                    help="Code2Wav chunk sizes captured (fewer: a shorter start-up; TTFA needs 1 and 2)")
    ap.add_argument("--cache-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    rows = asyncio.run(run(args))
    print(f"{'streams':>8} {'off p50':>9} {'on p50':>9} {'saved p50':>10} {'off p90':>9} {'on p90':>9} "
          f"{'saved mean':>11}   (ms, TTFA from open() to the first audio chunk)")
    for r in rows:
        print(f"{r['streams']:>8} {r['off']['p50_ms']:>9.1f} {r['on']['p50_ms']:>9.1f} {r['saved_p50_ms']:>10.1f} "
              f"{r['off']['p90_ms']:>9.1f} {r['on']['p90_ms']:>9.1f} {r['saved_mean_ms']:>11.1f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
