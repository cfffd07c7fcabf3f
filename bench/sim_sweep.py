"""Run bench.sim_engine configurations over several seeds at once and print their medians.

One configuration (sim_engine's arguments, without --seed) per line on stdin; lines starting with
`#` are skipped. Each configuration runs once per seed, `--jobs` at a time; per concurrency level
the median of every figure over the seeds is printed, with each seed's underrun share beside it.

    printf '%s\\n' "--streams 512 --seconds 120" "--streams 512 --seconds 120 --set safety_margin_s=0.4" \\
      | .venv/bin/python bench/sim_sweep.py --seeds 0,1,2,3
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEYS = (
    "ttfa_p50_ms",
    "ttfa_p90_ms",
    "ttfa_p99_ms",
    "rtf_p50",
    "rtf_p90",
    "underrun_streams_pct",
    "underrun_in_first_s_pct",
    "underrun_first_s_p50",
    "step_ms",
    "codec_rows_per_step",
    "codec_launches_per_step",
    "now_frame_rows_per_step",
    "gpu_ms_codec_now",
    "gpu_ms_codec_later",
    "lead_chunk_p1_ms",
    "lead_chunk_p50_ms",
    "lead_stream_min_p10_ms",
    "audio_s_per_s",
)


def run(args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.sim_engine", *shlex.split(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def medians(lines: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in KEYS:
        values = [d[key] for d in lines if d.get(key) is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds")
    ap.add_argument("--jobs", type=int, default=2, help="simulations at once")
    args = ap.parse_args()
    configs = [line.strip() for line in sys.stdin if line.strip() and not line.startswith("#")]
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(config, seed) for config in configs for seed in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run(f"{job[0]} --seed {job[1]}"), jobs))
    for config in configs:
        runs = [r for (c, _), r in zip(jobs, results, strict=True) if c == config]
        print(f"# {config}  (seeds {args.seeds}, medians)")
        lines = [d for r in runs for d in r if "requests" in d]
        for n in sorted({d["streams"] for d in lines}):
            level = [d for d in lines if d["streams"] == n]
            figures = " ".join(f"{k}={v}" for k, v in medians(level).items())
            print(f"  C={n}: {figures} | underrun per seed {[d['underrun_streams_pct'] for d in level]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
