"""Aligner throughput on a GPU: audio seconds aligned per wall second, Qwen3-ForcedAligner-0.6B shapes.

Random weights at the real sizes (24-layer AuT encoder, 28-layer Qwen3 decoder, 5000-class head),
bf16, batches of 1, 8 and 32 clips of 24 kHz noise with ~2.6 words per second of text. Times cover
the whole ``align`` call: resampling, log-mel, splitting, both model passes and post-processing. The
aligner is warmed up as a server warms it (its CUDA graphs captured), and each batch size once more
before it is timed. ``--eager`` times every batch without the graphs too, beside it. ``--overlap``
times ``--iters`` calls back to back instead, one after the other (``align``) and overlapped as the
aligner's worker runs them under load (each batch submitted before the one ahead of it is
collected), alternating, and gives each way's audio seconds per second.

    python bench/gpu_aligner_bench.py [--seconds 10] [--batches 1,8,32] [--iters 5] [--eager | --overlap]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from aligner.model import AlignerConfig, AudioEncoderConfig, ForcedAlignerModel, TextDecoderConfig
from aligner.qwen3 import Qwen3ForcedAligner

WORDS = "the quick brown fox jumps over a lazy dog while seven bright voices sing along together".split()


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class SyntheticTokenizer:
    """One or two ids per word, as a BPE gives for common English words."""

    def encode_batch(self, words: list[str], add_special_tokens: bool = False) -> list[_Encoding]:
        return [_Encoding([1000 + len(word), 2000 + ord(word[0])][: 1 + len(word) // 6]) for word in words]


def build_aligner(device: torch.device, dtype: torch.dtype) -> Qwen3ForcedAligner:
    cfg = AlignerConfig(audio=AudioEncoderConfig(), text=TextDecoderConfig())
    torch.manual_seed(0)
    with torch.device(device):
        model = ForcedAlignerModel(cfg)
    model = model.to(dtype).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.02)
    return Qwen3ForcedAligner(model, SyntheticTokenizer())


def make_batch(size: int, seconds: float, rate: int = 24000) -> list[tuple[np.ndarray, int, str, str]]:
    rng = np.random.default_rng(size)
    batch = []
    for _ in range(size):
        audio = (0.1 * rng.standard_normal(int(seconds * rate))).astype(np.float32)
        text = " ".join(rng.choice(WORDS, size=max(1, int(seconds * 2.6))))
        batch.append((audio, rate, text + ".", "English"))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of every clip")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--eager", action="store_true", help="also time every batch without CUDA graphs")
    parser.add_argument(
        "--overlap", action="store_true", help="calls back to back: in turn against overlapped"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    aligner = build_aligner(device, dtype)
    aligner.warm_up()
    params = sum(p.numel() for p in aligner.model.parameters()) / 1e6
    print(
        f"{torch.cuda.get_device_name()} | {params:.0f} M params | {args.dtype} | clips of {args.seconds:g} s"
    )
    print(
        f"{'batch':>5} {'graphs':>6} {'words':>6} {'p50 ms':>8} {'min ms':>8} {'audio s/s':>10} {'RTF':>9}"
        f" {'peak GiB':>9}"
    )
    if args.overlap:
        overlap(aligner, [int(b) for b in args.batches.split(",")], args.seconds, args.iters)
        return
    graphs = aligner.graphs
    for size in (int(b) for b in args.batches.split(",")):
        batch = make_batch(size, args.seconds)
        for aligner.graphs in [graphs, None] if args.eager else [graphs]:
            aligner.align(batch)  # warm-up: kernels, allocator
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            laps = []
            for _ in range(args.iters):
                start = time.perf_counter()
                words = aligner.align(batch)
                torch.cuda.synchronize()
                laps.append(time.perf_counter() - start)
            median = statistics.median(laps)
            audio_s = size * args.seconds
            count = sum(len(w) for w in words)
            print(
                f"{size:>5} {'on' if aligner.graphs else 'off':>6} {count:>6} {median * 1e3:>8.1f}"
                f" {min(laps) * 1e3:>8.1f} {audio_s / median:>10.0f} {median / audio_s:>9.5f}"
                f" {torch.cuda.max_memory_allocated() / 2**30:>9.2f}"
            )
        aligner.graphs = graphs


def overlap(
    aligner: Qwen3ForcedAligner, sizes: list[int], seconds: float, calls: int, rounds: int = 3
) -> None:
    """`calls` batches back to back, in turn and overlapped, alternating for `rounds` rounds."""
    print(f"{'batch':>5} {'calls':>5} {'in turn a-s/s':>14} {'overlapped a-s/s':>17} {'ratio':>6}")
    for size in sizes:
        batch = make_batch(size, seconds)
        aligner.align(batch)
        laps: dict[str, list[float]] = {"turn": [], "overlap": []}
        for _ in range(rounds):
            for way in laps:
                torch.cuda.synchronize()
                start = time.perf_counter()
                if way == "turn":
                    for _ in range(calls):
                        aligner.align(batch)
                else:
                    flight = aligner.submit(batch)
                    for _ in range(calls - 1):
                        following = aligner.submit(batch)
                        aligner.collect(flight)
                        flight = following
                    aligner.collect(flight)
                laps[way].append(time.perf_counter() - start)
        audio_s = size * seconds * calls
        turn, over = (audio_s / statistics.median(laps[way]) for way in ("turn", "overlap"))
        print(f"{size:>5} {calls:>5} {turn:>14.0f} {over:>17.0f} {over / turn:>6.2f}")


if __name__ == "__main__":
    main()
