"""The gateway as `cadence serve` runs it for the Qwen3 engine on a GPU, on a CPU machine: the
host-only stand-in engine of `bench.worker_host` (the real scheduler and step loop, the
GPU's share of each step slept, fake codes and silent audio of the real sizes) in a worker
process behind the real gateway. For the gateway's own behaviour at GPU-like load (its collector
pauses, its CPU), driven by `cadence bench`:

    .venv/bin/python -m bench.serve_host_only --streams 300 --port 8830 &
    .venv/bin/python -m clients.loadtest --url ws://127.0.0.1:8830/v1/stream --concurrency 250 \\
        --min-seconds 20 --max-seconds 25 --warmup-seconds 3 --metrics-url http://127.0.0.1:8830/metrics
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.worker_host import build  # noqa: E402
from engine.workers import WorkerPoolEngine, WorkerSpec  # noqa: E402
from gateway.server import serve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=300, help="the engine's slots")
    ap.add_argument("--gpu-ms", type=float, default=30.0, help="the GPU's share of one step")
    ap.add_argument("--port", type=int, default=8830)
    args = ap.parse_args()
    spec = WorkerSpec(functools.partial(build, args.streams, args.gpu_ms, None, 5.0), dict(os.environ))
    serve(WorkerPoolEngine([spec]), "127.0.0.1", args.port, log_level="warning")


if __name__ == "__main__":
    main()
