"""Each of Code2Wav's fused convolutions under other tilings, beside the one `fused_conv.tiling`
picks and cuDNN autotuned, at the engine's buckets, on one CUDA GPU: which layers lose to cuDNN, and
what a choice of tiles per layer would gain.

    python bench/gpu_conv_tiles.py --buckets 64x4,64x25,8x1 --json conv-tiles.json

One decode step of the real-shaped codec at each bucket (rows x frames) records every fused
convolution it launches (the same shape launched again counts again). Each distinct call is then
replayed in a CUDA graph of `--replays` launches per tiling, so the figures are GPU time, not
launch overhead. cuDNN runs the same plain convolution (bias only: the SnakeBeta and residual that
the fused kernel does in its epilogue are extra passes for it), autotuned; transposed convolutions
have no cuDNN figure here (bench/gpu_codec_bench.py --conv cudnn times the whole codec).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import run_record, write_json  # noqa: E402
from bench.gpu_codec_bench import build, random_codes  # noqa: E402
from engine.qwen3.models import fused_conv  # noqa: E402
from engine.qwen3.models.fused_conv import Tiles  # noqa: E402


@dataclass
class Call:
    """One distinct fused convolution of a decode step, and how often the step launches it."""

    x: Tensor
    weight: Tensor
    taps: int
    dilation: int
    bias: Tensor | None
    snake: tuple[Tensor, Tensor] | None
    residual: Tensor | None
    context: int
    past: tuple[Tensor, Tensor] | None
    transposed: bool
    count: int = 1
    times: dict[Tiles, float] = field(default_factory=dict)  # ms per launch
    cudnn_ms: float | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        flags = (
            self.bias is not None,
            self.snake is not None,
            self.residual is not None,
            self.past is not None,
        )
        return (tuple(self.x.shape), tuple(self.weight.shape), self.taps, self.dilation, self.context, flags)

    @property
    def rows(self) -> int:
        return self.x.shape[0] * (self.context + self.x.shape[1] - (self.taps - 1) * self.dilation)

    @property
    def chosen(self) -> Tiles:
        return fused_conv.tiling(self.rows, self.x.shape[-1], self.weight.shape[1], self.taps)

    def launch(self) -> Tensor:
        return fused_conv.conv(
            self.x,
            self.weight,
            self.taps,
            self.dilation,
            self.bias,
            self.snake,
            self.residual,
            context=self.context,
            past=self.past,
        )


def _transposed_weights(model: Any) -> set[int]:
    """Data pointers of the packed weights of the codec's transposed convolutions (packed once a
    step has run)."""
    found = set()
    for module in model.modules():
        packed = getattr(module, "_packed", None)
        if packed is not None and isinstance(getattr(module, "stride", None), int):
            if packed._value is not None:
                found.add(packed._value[0].data_ptr())
    return found


def record(model: Any, rows: int, frames: int) -> list[Call]:
    """The fused convolutions one decode step of `rows` x `frames` launches, each once with a count."""
    slots = torch.arange(rows, device="cuda")
    with torch.no_grad():
        model.decode_step(slots, random_codes(rows, frames, seed=2))  # packs the weights, compiles
    transposed = _transposed_weights(model)
    calls: dict[tuple[Any, ...], Call] = {}
    real = fused_conv.conv

    def recorder(x, weight, taps, dilation=1, bias=None, snake=None, residual=None, context=0, past=None):  # type: ignore[no-untyped-def]
        kept = None if residual is None else residual.detach().clone()
        history = None if past is None else (past[0].detach().clone(), past[1].clone())
        call = Call(
            x.detach().clone(),
            weight,
            taps,
            dilation,
            bias,
            snake,
            kept,
            context,
            history,
            weight.data_ptr() in transposed,
        )
        if call.key in calls:
            calls[call.key].count += 1
        else:
            calls[call.key] = call
        return real(x, weight, taps, dilation, bias, snake, residual, context, past)

    fused_conv.conv = recorder  # type: ignore[assignment]
    try:
        with torch.no_grad():
            model.decode_step(slots, random_codes(rows, frames, seed=3))
        torch.cuda.synchronize()
    finally:
        fused_conv.conv = real  # type: ignore[assignment]
    return list(calls.values())


def candidates(call: Call, quick: bool) -> list[Tiles]:
    c_in, c_out = call.x.shape[-1], call.weight.shape[1]
    widest = max(16, fused_conv._next_pow2(c_out))
    block_ns = [n for n in (32, 64, 128) if n <= max(32, widest)]
    block_ks = [k for k in (32, 64) if k <= max(32, fused_conv._next_pow2(c_in))]
    stages = (3,) if quick else (2, 3, 4)
    out = {call.chosen}
    for m, n, k, w, s in itertools.product((64, 128), block_ns, block_ks, (4, 8), stages):
        out.add(Tiles(m, n, k, w, s))
    return sorted(out)


def graph_ms(fn: Callable[[], Any], replays: int) -> float:
    """GPU milliseconds per call: `replays` calls captured in one CUDA graph, replayed."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * replays)


def time_tilings(call: Call, quick: bool, replays: int) -> None:
    chosen = fused_conv.tiling
    expected = call.launch().float()
    for tiles in candidates(call, quick):
        fused_conv.tiling = lambda *_shape, t=tiles: t  # type: ignore[assignment]
        try:
            got = call.launch().float()
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2):
                raise ValueError("differs from the chosen tiling's output")
            call.times[tiles] = graph_ms(call.launch, replays)
        except Exception as exc:  # a tiling that does not compile or fit the shared memory
            print(f"  skipped {tuple(tiles)}: {type(exc).__name__}: {str(exc)[:80]}")
        finally:
            fused_conv.tiling = chosen  # type: ignore[assignment]


def time_cudnn(call: Call, replays: int) -> None:
    """The same plain convolution (bias only) through cuDNN, autotuned, channels-last, over the
    input with its left context already in front (cuDNN cannot read it in place)."""
    if call.transposed:
        return
    c_in, c_out = call.x.shape[-1], call.weight.shape[1]
    w4 = call.weight.reshape(call.taps, c_in, c_out).permute(2, 1, 0).contiguous().unsqueeze(2)
    if call.past is not None:
        pool, slots = call.past
        joined = torch.cat([pool.index_select(0, slots), call.x], dim=1)
    else:
        joined = F.pad(call.x, (0, 0, call.context, 0))
    x4 = joined.transpose(1, 2).unsqueeze(2)
    torch.backends.cudnn.benchmark = True
    call.cudnn_ms = graph_ms(lambda: F.conv2d(x4, w4, call.bias, dilation=(1, call.dilation)), replays)


def report(bucket: str, calls: list[Call]) -> dict[str, Any]:
    layers = []
    totals = {"chosen_ms": 0.0, "best_ms": 0.0, "cudnn_ms": 0.0, "cudnn_layers_fused_ms": 0.0}
    print(f"\n== bucket {bucket}: {sum(c.count for c in calls)} fused convolutions a step")
    print(
        f"{'rows':>7} {'c_in':>5} {'c_out':>5} {'taps':>4} {'dil':>3} {'n':>2} epilogue    "
        f"{'chosen':>8} {'best':>8} {'cuDNN':>8}  best tiles (m, n, k, warps, stages)"
    )
    for call in sorted(calls, key=lambda c: -c.count * min(c.times.values(), default=0.0)):
        chosen = call.chosen
        if chosen not in call.times:
            continue
        best = min(call.times, key=call.times.__getitem__)
        epilogue = "+".join(
            n
            for n, on in (
                ("bias", call.bias is not None),
                ("snake", call.snake is not None),
                ("res", call.residual is not None),
                ("T", call.transposed),
            )
            if on
        )
        rows = call.rows
        cudnn = f"{call.cudnn_ms:8.4f}" if call.cudnn_ms is not None else f"{'-':>8}"
        print(
            f"{rows:7d} {call.x.shape[-1]:5d} {call.weight.shape[1]:5d} {call.taps:4d} {call.dilation:3d} "
            f"{call.count:2d} {epilogue:11s} {call.times[chosen]:8.4f} {call.times[best]:8.4f} {cudnn}  "
            f"{tuple(best)}"
        )
        totals["chosen_ms"] += call.count * call.times[chosen]
        totals["best_ms"] += call.count * call.times[best]
        if call.cudnn_ms is not None:
            totals["cudnn_ms"] += call.count * call.cudnn_ms
            totals["cudnn_layers_fused_ms"] += call.count * call.times[chosen]
        layers.append(
            {
                "rows": rows,
                "c_in": call.x.shape[-1],
                "c_out": call.weight.shape[1],
                "taps": call.taps,
                "dilation": call.dilation,
                "count": call.count,
                "epilogue": epilogue,
                "chosen": list(chosen),
                "chosen_ms": call.times[chosen],
                "best": list(best),
                "best_ms": call.times[best],
                "cudnn_ms": call.cudnn_ms,
                "every_ms": {"x".join(map(str, t)): round(ms, 5) for t, ms in sorted(call.times.items())},
            }
        )
    print(
        f"step: chosen tiles {totals['chosen_ms']:.3f} ms, best per layer {totals['best_ms']:.3f} ms; "
        f"the layers cuDNN also ran: fused {totals['cudnn_layers_fused_ms']:.3f} ms, "
        f"cuDNN {totals['cudnn_ms']:.3f} ms (without the fused epilogues)"
    )
    return {"bucket": bucket, "layers": layers, **{k: round(v, 4) for k, v in totals.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="64x4,64x25,8x1", help="rows x frames, comma-separated")
    parser.add_argument("--replays", type=int, default=20, help="launches per CUDA graph")
    parser.add_argument("--quick", action="store_true", help="pipelining depth 3 only")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop timing new layers after this")
    parser.add_argument("--no-cudnn", action="store_true", help="time no layer through cuDNN")
    parser.add_argument("--inputs", default="", help="only the layers of these input channel counts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not fused_conv.check(torch.device("cuda")):
        print("the fused convolution is off on this device (its check failed)")
        return 1
    buckets = [tuple(int(v) for v in b.split("x")) for b in args.buckets.split(",")]
    model = build(torch.bfloat16, max(r for r, _ in buckets))
    started, results = time.monotonic(), []
    for rows, frames in buckets:
        calls = record(model, rows, frames)
        if args.inputs:
            wanted = {int(c) for c in args.inputs.split(",")}
            calls = [c for c in calls if c.x.shape[-1] in wanted]
        for call in sorted(calls, key=lambda c: -c.rows * c.taps * c.x.shape[-1] * c.weight.shape[1]):
            if time.monotonic() - started > args.budget_s:
                print("  time budget spent: the remaining layers are not timed")
                break
            time_tilings(call, args.quick, args.replays)
            if not args.no_cudnn:
                time_cudnn(call, args.replays)
        results.append(report(f"{rows}x{frames}", calls))
    if args.json is not None:
        write_json(args.json, {**run_record(argv), "buckets": results})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
