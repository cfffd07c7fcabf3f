"""The reference implementation (the `qwen-tts` package: HF transformers generate, static batch) on
the same random checkpoint and GPU as Cadence's benchmark, for the side-by-side ratio.

    python bench/reference_bench.py --model checkpoints/qwen3-1.7b-random --batches 1,8 --frames 50 -o ref.json

Each batch of B corpus prompts (CustomVoice, speaker "ryan") is generated with EOS made unreachable
and max_new_tokens = frames + 1, so every request yields exactly `frames` frames, as Cadence's
forced lengths do. The reference has no streaming output: its time to first audio is the whole call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.qwen_reference import import_qwen_tts  # noqa: E402

FRAME_S = 1920 / 24000


def run(args: argparse.Namespace) -> dict:
    qwen_tts = import_qwen_tts()
    dtype = getattr(torch, args.dtype)
    tts = qwen_tts.Qwen3TTSModel.from_pretrained(
        str(args.model), dtype=dtype, attn_implementation="sdpa", device_map=args.device
    )
    tts.model.config.talker_config.codec_eos_token_id = 100_000  # never sampled: forced length
    rows = [json.loads(line) for line in args.corpus.read_text(encoding="utf-8").splitlines() if line]
    points = []
    for b in [int(x) for x in args.batches.split(",")]:
        texts = [r["text"] for r in rows[:b]]
        kw = dict(text=texts, speaker=["ryan"] * b, language=["English"] * b, max_new_tokens=args.frames + 1)
        tts.generate_custom_voice(**{**kw, "max_new_tokens": 4})  # warm-up
        walls = []
        for _ in range(args.repeats):
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            t = time.perf_counter()
            wavs, _ = tts.generate_custom_voice(**kw)
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            walls.append(time.perf_counter() - t)
            assert all(len(w) == args.frames * 1920 for w in wavs), [len(w) for w in wavs]
        wall = statistics.median(walls)
        audio_s = b * args.frames * FRAME_S
        point = dict(
            concurrency=b,
            requests=b * args.repeats,
            ttfa_p50_ms=1000 * wall,
            ttfa_p90_ms=1000 * max(walls),
            rtf_p50=wall / (args.frames * FRAME_S),
            rtf_p90=max(walls) / (args.frames * FRAME_S),
            chars_per_s=sum(len(t) for t in texts) / wall,
            audio_s_per_s=audio_s / wall,
            gpu_mem_gb=(torch.cuda.max_memory_allocated() / 1e9) if args.device.startswith("cuda") else None,
        )
        points.append(point)
        print(json.dumps(point), flush=True)
    return {
        "name": f"qwen-tts {getattr(qwen_tts, '__version__', '0.1.1')}",
        "frames": args.frames,
        "dtype": args.dtype,
        "points": points,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--corpus", type=Path, default=ROOT / "deploy" / "bench" / "corpus.jsonl")
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args()
    result = run(args)
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
