"""The talker decode and the sampling + code-predictor graphs, eager layers against fused ones
(engine.qwen3.models.fused_layer), at the real 1.7B shapes with random weights; no Code2Wav graphs, so it
takes about a minute.

    python bench/gpu_layer_bench.py --batches 1 64 256 512 --json out.json

Per batch size: each graph's replay time (median of --iters replays after one warm-up; decode rows at
--position in their slots), then the same after the runner fuses its stacks, and the kernels per
replay counted by torch.profiler (one replay each).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_engine_bench import build, time_replay  # noqa: E402
from engine.qwen3.cuda_graphs import GraphBank  # noqa: E402


def kernels_per_replay(runner: object, key: tuple) -> int:
    graph = runner.graphs.graphs[key]  # type: ignore[attr-defined]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@torch.no_grad()
def measure(
    runner: object, batches: list[int], iters: int, position: int, count_kernels: bool
) -> dict[int, dict]:
    out: dict[int, dict] = {}
    k = runner.kv_buckets[-1]  # type: ignore[attr-defined]
    runner.graphs = GraphBank(runner.device)  # type: ignore[attr-defined]
    for b in sorted(batches, reverse=True):  # largest first: the smaller graphs reuse its memory pool
        keys = {"decode": ("decode", b, k), "sample": ("sample", b, True)}
        runner.graphs.capture(keys["decode"], runner._decode_fn(b, k))  # type: ignore[attr-defined]
        runner.graphs.capture(keys["sample"], runner._sample_fn(b, True))  # type: ignore[attr-defined]
        row: dict = {}
        for name, key in keys.items():
            row[f"{name}_ms"] = round(
                time_replay(runner, key, iters, position if name == "decode" else None), 3
            )
            if count_kernels:
                row[f"{name}_kernels"] = kernels_per_replay(runner, key)
        out[b] = row
        print(b, row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--position", type=int, default=255, help="decode rows' position in their slots")
    ap.add_argument("--no-kernel-count", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    bench_args = argparse.Namespace(
        tiny=False,
        device="cuda",
        dtype="bfloat16",
        codec_dtype="bfloat16",
        max_len=512,
        kv_buckets=[],
        max_codec_batch=1,
        eager=False,
    )
    runner, _ = build(bench_args, max(args.batches))
    runner.config.fused_layers = False
    results = {
        "eager_layers": measure(runner, args.batches, args.iters, args.position, not args.no_kernel_count)
    }
    runner.config.fused_layers = True
    runner.fuse_layers()
    assert runner.talker.model.fused and runner.talker.code_predictor.model.fused
    results["fused_layers"] = measure(
        runner, args.batches, args.iters, args.position, not args.no_kernel_count
    )
    print(
        "| B | talker decode ms: eager -> fused | kernels | predictor + sampling ms: eager -> fused | kernels |"
    )
    print("|---|---|---|---|---|")
    for b in args.batches:
        e, f = results["eager_layers"][b], results["fused_layers"][b]
        print(
            f"| {b} | {e['decode_ms']} -> {f['decode_ms']} | {e.get('decode_kernels')} -> {f.get('decode_kernels')} "
            f"| {e['sample_ms']} -> {f['sample_ms']} | {e.get('sample_kernels')} -> {f.get('sample_kernels')} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    **results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
