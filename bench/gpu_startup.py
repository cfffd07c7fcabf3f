"""Where the Qwen3 engine's start-up goes on a GPU: the checkpoint's load, the layers' fusing, and
every CUDA graph's capture, timed one by one and summed by kind; then each graph's replay, so a
bucket's capture cost can be set against what it saves at run time.

    python3 bench/gpu_startup.py --model .cache/cadence-random-1.7B -o startup.json
    python3 bench/gpu_startup.py --model ... --kinds codec,codec_first --no-cudnn-benchmark -o b.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cadence.engines import EngineOptions, build_engine  # noqa: E402


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def load_profile(profiler: cProfile.Profile, top: int = 30) -> list[dict[str, object]]:
    """The functions the load spent the most time in, cumulatively (callees included)."""
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)  # type: ignore[attr-defined]
    out: list[dict[str, object]] = []
    for (path, line, name), (_cc, calls, _tt, cum, _callers) in rows[:top]:
        out.append({"function": f"{Path(path).name}:{line} {name}", "calls": calls, "cum_s": round(cum, 3)})
        print(f"load {cum:8.3f} s {calls:7d} {Path(path).name}:{line} {name}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Qwen3-TTS checkpoint directory")
    ap.add_argument(
        "--max-streams", type=int, default=None, help="as `cadence serve --max-streams` (default: auto)"
    )
    ap.add_argument("--kinds", default="", help="capture only these kinds (comma-separated); all by default")
    ap.add_argument(
        "--no-cudnn-benchmark", action="store_true", help="cuDNN's default algorithms, not autotuned"
    )
    ap.add_argument(
        "--benchmark-limit", type=int, default=None, help="cuDNN algorithms tried per convolution (0: all)"
    )
    ap.add_argument("--repeats", type=int, default=10, help="replays timed per graph")
    ap.add_argument(
        "--profile-load", action="store_true", help="profile the engine's build: where the load's time goes"
    )
    ap.add_argument("-o", "--out", required=True, help="JSON report")
    args = ap.parse_args()

    options = EngineOptions(
        name="qwen3", model=args.model, device="cuda", gpus="0", max_streams=args.max_streams
    )
    profiler = cProfile.Profile() if args.profile_load else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    engine = build_engine(options)
    torch.cuda.synchronize()
    if profiler is not None:
        profiler.disable()
    load_s = time.perf_counter() - t0
    runner = engine.runner  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    runner.fuse_layers()
    torch.cuda.synchronize()
    fuse_s = time.perf_counter() - t1
    if args.no_cudnn_benchmark:
        torch.backends.cudnn.benchmark = False
    if args.benchmark_limit is not None:
        torch.backends.cudnn.benchmark_limit = args.benchmark_limit
    kinds = set(filter(None, args.kinds.split(",")))
    keys = [k for k in runner.graph_keys() if not kinds or k[0] in kinds]
    if kinds:  # only the chosen kinds: capture them through the runner's own loop on a filtered list
        runner.graph_keys = lambda: keys
    marks: list[tuple[object, float]] = []
    t2 = time.perf_counter()

    def progress(done: int, total: int, key: object) -> None:
        torch.cuda.synchronize()
        now = time.perf_counter()
        print(f"{done}/{total} {key} {now - (marks[-1][1] if marks else t2):.2f} s", flush=True)
        marks.append((key, now))

    runner.capture(progress)
    capture_s = time.perf_counter() - t2
    rows, by_kind = [], defaultdict(lambda: {"count": 0, "capture_s": 0.0})
    last = t2
    for key, at in marks:
        kind = key[0]  # type: ignore[index]
        bank = runner.codec_graphs if kind == "codec" else runner.graphs
        graph = bank.graphs.get(key)
        ms = replay_ms(graph, args.repeats) if graph is not None else None
        print(f"replay {key} {ms:.3f} ms" if ms is not None else f"replay {key}: no graph", flush=True)
        rows.append({"key": list(key), "capture_s": round(at - last, 4), "replay_ms": ms})  # type: ignore[call-overload]
        by_kind[kind]["count"] += 1
        by_kind[kind]["capture_s"] = round(by_kind[kind]["capture_s"] + at - last, 3)
        last = at
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "max_streams": args.max_streams,
        "cudnn_benchmark": not args.no_cudnn_benchmark,
        "cudnn_benchmark_limit": torch.backends.cudnn.benchmark_limit,
        "load_s": round(load_s, 2),
        "fuse_s": round(fuse_s, 2),
        "capture_s": round(capture_s, 2),
        "graphs": len(rows),
        "by_kind": by_kind,
        "keys": rows,
    }
    if profiler is not None:
        report["load_profile"] = load_profile(profiler)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "keys"}, indent=1))


if __name__ == "__main__":
    main()
