"""Time to first audio saved by prompt-prefix KV reuse, engine level, random Qwen3-TTS-1.7B weights.

    python bench/gpu_prefix_cache.py                                   # H200, writes a random checkpoint
    python bench/gpu_prefix_cache.py --checkpoint checkpoints/qwen3-1.7b-random
    python bench/gpu_prefix_cache.py --size tiny --device cpu --streams 1 4   # smoke test of the script

The voice is an in-context clone with a 10 s reference (125 reference frames, a transcript of about
ten seconds of speech) and a random x-vector. For each concurrency N, N requests of that voice open
together (each a different sentence, a forced length of --frames frames) three times: with both of
the voice's caches off ("off"), with the talker's prompt-prefix KV cache on ("kv"), then with the
Code2Wav state cache (the decoder state after the reference clip) on as well ("both"); the caches
are warm (one request of the voice served before). TTFA is measured per request from open() to its
first audio chunk. Reported: prefix positions, TTFA p50/p90 per run and what the caches save.
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
from engine.qwen3.codec_state_cache import CodecStateCache  # noqa: E402
from engine.qwen3.engine import Qwen3Engine, Qwen3EngineConfig, _Voice  # noqa: E402
from engine.qwen3.prefix_cache import PrefixKVCache  # noqa: E402
from engine.qwen3.runner import RunnerConfig  # noqa: E402
from engine.qwen3.scheduler import SchedulerConfig  # noqa: E402

REFERENCE_TEXT = (
    "Thanks for calling back. I looked at the order this morning, and the replacement part "
    "should arrive on Thursday, so we can book the technician for Friday afternoon."
)
SENTENCES = [
    "Your appointment is confirmed for tomorrow at nine.",
    "I can help you with that right away.",
    "The package left our warehouse an hour ago.",
    "Could you spell your last name for me, please?",
    "We have two rooms left for that weekend.",
    "Let me check the balance on your account.",
    "The next train to the airport leaves in twelve minutes.",
    "That model comes in three colours.",
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


MODES = ("off", "kv", "both")


def set_caches(engine: Qwen3Engine, mode: str, kv: PrefixKVCache, codec: CodecStateCache) -> None:
    on = mode != "off"
    engine.prefix_cache = engine.runner.prefix_cache = kv if on else None
    engine.scheduler.prefix_lookup = kv.lookup if on else None
    engine.runner.codec_states = codec if mode == "both" else None


async def one(engine: Qwen3Engine, rid: str, text: str, frames: int) -> float:
    t0 = time.perf_counter()
    stream = engine.open(
        SynthesisRequest(request_id=rid, voice="clone", language="English", forced_frames=frames)
    )
    stream.push(TextSegment(text, char_start=0))
    stream.close_text()
    ttfa = None
    async for chunk in stream:
        if ttfa is None and chunk.samples.size:
            ttfa = time.perf_counter() - t0
    assert ttfa is not None, f"{rid}: no audio"
    return ttfa


async def wave(engine: Qwen3Engine, tag: str, n: int, frames: int) -> list[float]:
    return list(
        await asyncio.gather(
            *(one(engine, f"{tag}-{i}", SENTENCES[i % len(SENTENCES)], frames) for i in range(n))
        )
    )


def summary(ttfas: list[float]) -> dict[str, float]:
    s = sorted(ttfas)
    return {
        "p50_ms": 1000 * statistics.median(s),
        "p90_ms": 1000 * s[min(len(s) - 1, int(0.9 * len(s)))],
        "mean_ms": 1000 * statistics.fmean(s),
    }


async def run(args: argparse.Namespace) -> list[dict]:
    path = args.checkpoint
    if path is None:
        from bench.random_checkpoint import write_checkpoint

        path = Path(tempfile.mkdtemp(prefix="qwen3-random-"))
        write_checkpoint(path, args.size, args.device, ROOT / "deploy" / "bench" / "corpus.jsonl")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    top = max(args.streams)
    engine = Qwen3Engine.from_pretrained(
        path,
        args.device,
        dtype,
        Qwen3EngineConfig(
            scheduler=SchedulerConfig(
                codec_slots=top,
                max_batch=args.max_batch,
                max_codec_rows=args.max_batch,
                max_tokens_per_step=args.max_tokens_per_step,
                queue_limit=top,
                codec_frame_buckets=tuple(args.codec_frame_buckets),
            ),
            runner=RunnerConfig(max_len=args.max_len, enforce_eager=args.device == "cpu"),
            kv_slots=top,
            progress_bar=False,
            prefix_cache_bytes=args.cache_bytes,
        ),
    )
    cache, codec_states = engine.prefix_cache, engine.runner.codec_states
    assert cache is not None and codec_states is not None
    engine._voices["clone"] = clone_voice(engine)
    await engine.start()
    try:
        await wave(engine, "warm", min(4, top), args.frames)  # allocator and code paths, cache filled
        rows = []
        for n in args.streams:
            ttfa: dict[str, list[float]] = {m: [] for m in MODES}
            for rep in range(max(1, args.requests // n)):  # a few waves when n is small: steadier medians
                for mode in MODES:
                    set_caches(engine, mode, cache, codec_states)
                    hits = cache.hits
                    ttfa[mode] += await wave(engine, f"{mode}{n}-{rep}", n, args.frames)
                    assert mode == "off" or cache.hits - hits == n, (
                        "every request of the warm voice should hit"
                    )
            row = {"streams": n, **{m: summary(ttfa[m]) for m in MODES}}
            for m in MODES[1:]:
                row[f"saved_p50_ms_{m}"] = row["off"]["p50_ms"] - row[m]["p50_ms"]
                row[f"saved_mean_ms_{m}"] = row["off"]["mean_ms"] - row[m]["mean_ms"]
            rows.append(row)
        load = engine.load().extra
        prefix = cache.positions_reused / max(1, cache.hits)
        print(
            json.dumps(
                {
                    "prefix_positions": prefix,
                    "cache_bytes": load["prefix_cache_bytes"],
                    "hits": cache.hits,
                    "misses": cache.misses,
                    "codec_state_bytes": codec_states.bytes,
                    "codec_state_hits": codec_states.hits,
                }
            )
        )
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
    ap.add_argument(
        "--max-batch", type=int, default=256, help="rows per step (all streams of a wave at once)"
    )
    ap.add_argument(
        "--requests", type=int, default=8, help="requests per concurrency level at least (waves of N)"
    )
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument(
        "--codec-frame-buckets",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 25],
        help="Code2Wav chunk sizes captured (fewer: a shorter start-up; TTFA needs 1 and 2)",
    )
    ap.add_argument("--cache-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    rows = asyncio.run(run(args))
    print(
        f"{'streams':>8} "
        + " ".join(f"{m + ' p50':>10} {m + ' p90':>10}" for m in MODES)
        + f" {'saved kv':>9} {'saved both':>10}   (ms, TTFA from open() to the first audio chunk; saved: p50)"
    )
    for r in rows:
        print(
            f"{r['streams']:>8} "
            + " ".join(f"{r[m]['p50_ms']:>10.1f} {r[m]['p90_ms']:>10.1f}" for m in MODES)
            + f" {r['saved_p50_ms_kv']:>9.1f} {r['saved_p50_ms_both']:>10.1f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
