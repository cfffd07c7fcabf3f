"""Code2Wav batched streaming throughput at the real decoder shapes, on one CUDA GPU.

For each dtype x batch x frames-per-step bucket: capture `decode_step` in a CUDA graph with static
input buffers, check that graph replays equal eager steps, then time eager and graph steps.
Also checks, once per dtype, that streamed decoding equals the offline decode at the real shapes.

    python bench/gpu_codec_bench.py                       # full grid
    python bench/gpu_codec_bench.py --batches 1,16 --frames 1,25 --dtypes bf16 --json out.json
    python bench/gpu_codec_bench.py --batches 64 --frames 1,4 --dtypes bf16 --cudnn-benchmark off --profile

Random weights (codebooks redrawn so the audio is not silence): timing does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.qwen3.models import fused_conv  # noqa: E402
from engine.qwen3.models.codec import Code2Wav  # noqa: E402

# speech_tokenizer decoder_config of the released 12 Hz tokenizer (research/baseline.md)
REAL_DECODER = dict(
    codebook_size=2048,
    codebook_dim=512,
    hidden_size=512,
    intermediate_size=1024,
    latent_dim=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    sliding_window=72,
    rope_theta=10000,
    layer_scale_initial_scale=0.01,
    num_quantizers=16,
    decoder_dim=1536,
    upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2],
)
FRAME_S = 0.08
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(dtype: torch.dtype, slots: int) -> Code2Wav:
    torch.manual_seed(0)
    model = Code2Wav(REAL_DECODER)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embedding_sum"):
                p.normal_()
    model.quantizer.refresh()
    model = model.to("cuda", dtype).eval()
    model.init_streams(slots)
    return model


def random_codes(b: int, f: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 2048, (b, f, 16), device="cuda", generator=g)


def timed(fn: Any, steps: int) -> float:
    """Milliseconds per call (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def print_kernels(fn: Any, label: str, replays: int = 5) -> None:
    """The kernels of `replays` calls of fn, by GPU time: where one replay spends its time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events) / replays
    total = sum(e.self_device_time_total for e in events) / replays / 1000
    print(f"profile {label}: {kernels:.0f} kernels per replay, {total:.2f} ms of kernel time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))


@torch.no_grad()
def print_kernel_ops(model: Code2Wav, b: int, f: int, top: int = 40) -> None:
    """Which operators (and input shapes) launch the kernels that take the most time, eagerly."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    slots, codes = torch.arange(b, device="cuda"), random_codes(b, f, seed=5)
    model.decode_step(slots, codes)
    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True
    ) as prof:
        model.decode_step(slots, codes)
        torch.cuda.synchronize()
    by_op: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in prof.events():
        where = next((fr.split("/")[-1] for fr in (e.stack or []) if "engine/qwen3/models" in fr), "")
        for k in e.kernels:
            key = f"{e.name} {where} {e.input_shapes} -> {k.name[:50]}"
            by_op[key] += k.duration
            calls[key] += 1
    print(f"kernels by launching operator, eager {b} x {f} (us, calls):")
    for key, us in by_op.most_common(top):
        print(f"{us:9.0f} {calls[key]:4d}  {key[:220]}")


@torch.no_grad()
def streamed_equals_offline(model: Code2Wav) -> float:
    """Max |streamed - offline| over 2 rows x 200 frames with a growing chunk schedule."""
    codes = random_codes(2, 200, seed=1)
    offline = model.decode(codes)
    slots = torch.tensor([0, 1], device="cuda")
    model.reset(slots)
    pieces, at, i = [], 0, 0
    sizes = [1, 2, 4, 8, 25]
    while at < 200:
        n = min(sizes[min(i, len(sizes) - 1)], 200 - at)
        pieces.append(model.decode_step(slots, codes[:, at : at + n]))
        at, i = at + n, i + 1
    return float((torch.cat(pieces, dim=1).float() - offline.float()).abs().max())


@torch.no_grad()
def bench_bucket(
    model: Code2Wav,
    b: int,
    f: int,
    steps: int,
    check_steps: int = 3,
    profile: bool = False,
    compiled: Any = None,
) -> dict[str, Any]:
    """compiled: a torch.compile'd decode_step to capture instead (the eager figures stay plain)."""
    step = compiled or model.decode_step
    slots = torch.arange(b, device="cuda")
    codes = torch.zeros(b, f, 16, dtype=torch.long, device="cuda")
    inputs = [random_codes(b, f, seed=10 + i) for i in range(check_steps)]

    # eager reference outputs and eager timing
    model.reset(slots)
    eager_out = []
    for x in inputs:
        codes.copy_(x)
        eager_out.append(model.decode_step(slots, codes).clone())
    eager_ms = timed(lambda: model.decode_step(slots, codes), max(2, steps // 4))

    # capture (warm up on a side stream first, as torch.cuda.graphs requires)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(slots, codes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(slots, codes)

    model.reset(slots)
    diff = 0.0
    for x, ref in zip(inputs, eager_out, strict=True):
        codes.copy_(x)
        graph.replay()
        diff = max(diff, float((out.float() - ref.float()).abs().max()))
    graph_ms = timed(graph.replay, steps)
    if profile:
        print_kernels(graph.replay, f"{b} x {f}")
    del graph, out
    audio_s = b * f * FRAME_S
    return {
        "batch": b,
        "frames": f,
        "eager_ms": round(eager_ms, 3),
        "graph_ms": round(graph_ms, 3),
        "graph_audio_s_per_s": round(audio_s / (graph_ms / 1000), 1),
        "eager_audio_s_per_s": round(audio_s / (eager_ms / 1000), 1),
        "graph_vs_eager_max_abs": diff,
    }


def bench_compiled(model: Code2Wav, b: int, f: int, args: argparse.Namespace, row: dict[str, Any]) -> None:
    """The same bucket with decode_step compiled by inductor (fused elementwise ops, its own layouts)."""
    t0 = time.perf_counter()
    try:
        c = bench_bucket(
            model,
            b,
            f,
            args.steps,
            profile=args.profile,
            compiled=torch.compile(model.decode_step, dynamic=False),
        )
    except Exception as e:  # noqa: BLE001 - a failed compile is a result too
        row["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"      compiled: {row['compile_error']}", flush=True)
        return
    row.update(
        compiled_graph_ms=c["graph_ms"],
        compiled_vs_eager_max_abs=c["graph_vs_eager_max_abs"],
        compile_s=round(time.perf_counter() - t0, 1),
    )
    print(
        f"      compiled: graph {c['graph_ms']:.2f} ms, vs plain eager {c['graph_vs_eager_max_abs']:.1e}, "
        f"compile + bench {row['compile_s']} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--frames", default="1,2,4,8,25")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=20, help="timed graph replays per bucket")
    ap.add_argument(
        "--cudnn-benchmark",
        default="on",
        choices=("on", "off"),
        help="cuDNN autotuning (one setting per process: PyTorch keeps the first choice "
        "of algorithm per shape, so a second setting in the same process would reuse it)",
    )
    ap.add_argument(
        "--conv",
        default="fused",
        choices=("fused", "cudnn"),
        help="the convolutions' kernels: the fused Triton kernel (engine.qwen3.models.fused_conv) or cuDNN",
    )
    ap.add_argument("--kernel-ops", default="", help="BxF: list the operators behind the slowest kernels")
    ap.add_argument("--profile", action="store_true", help="print each bucket's kernels by GPU time")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time decode_step compiled by torch.compile (inductor) under the same graphs",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if args.conv == "cudnn":
        fused_conv.guard.enabled = False
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    torch.backends.cudnn.allow_tf32 = False
    batches = [int(x) for x in args.batches.split(",")]
    frames = [int(x) for x in args.frames.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    results: list[dict[str, Any]] = []
    variants = [(d, c) for d in args.dtypes.split(",") for c in args.cudnn_benchmark.split(",")]
    for name, autotune in variants:
        torch.backends.cudnn.benchmark = autotune == "on"
        dtype = DTYPES[name]
        model = build(dtype, max(batches) + 1)
        params = sum(p.numel() for p in model.parameters())
        print(
            f"\n== {name}, cuDNN autotuning {autotune}: {params / 1e6:.1f} M params, stream state {model.state_bytes_per_slot() / 2**20:.2f} MiB/slot"
        )
        if args.kernel_ops:
            print_kernel_ops(model, *(int(v) for v in args.kernel_ops.split("x")))
        print(
            f"streamed vs offline (2 x 200 frames, chunks 1,2,4,8,25): max abs diff {streamed_equals_offline(model):.2e}"
        )
        print(
            f"{'batch':>5} {'frames':>6} {'eager ms':>9} {'graph ms':>9} {'audio-s/s':>10} {'graph==eager':>13} {'wall s':>7}"
        )
        for b in sorted(batches, reverse=True):
            for f in frames:
                t0 = time.perf_counter()
                try:
                    row = bench_bucket(model, b, f, args.steps, profile=args.profile)
                    if args.compile:
                        bench_compiled(model, b, f, args, row)
                except torch.cuda.OutOfMemoryError:
                    row = {"batch": b, "frames": f, "error": "out of memory"}
                    torch.cuda.empty_cache()
                row.update(
                    conv=args.conv,
                    dtype=name,
                    cudnn_benchmark=autotune,
                    wall_s=round(time.perf_counter() - t0, 1),
                    peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                )
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.empty_cache()
                results.append(row)
                if "error" in row:
                    print(f"{b:>5} {f:>6} {row['error']}")
                else:
                    print(
                        f"{b:>5} {f:>6} {row['eager_ms']:>9.2f} {row['graph_ms']:>9.2f} "
                        f"{row['graph_audio_s_per_s']:>10.0f} {row['graph_vs_eager_max_abs']:>13.1e} {row['wall_s']:>7.1f}",
                        flush=True,
                    )
        del model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
