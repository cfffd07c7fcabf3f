"""Runs of two builds side by side (bench/gpu_ab.sh): `NAME=FILE` per run, NAME `base-N` or `new-N`,
FILE a `cadence bench` JSON. Per concurrency and build, the median of each figure over the build's
runs, and new's ratio to base for audio-seconds per second and the step; a point with errors (a
server cut short by its time limit) is left out and named. Writes every run and the medians as JSON.

    python bench/ab_summary.py base-1=bench-base-1.json new-2=bench-new-2.json -o ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

POINT = ("audio_s_per_s", "chars_per_s", "ttfa_p50_ms", "ttfa_p90_ms", "rtf_p90", "underrun_streams_pct")
ENGINE = ("step_time_ms", "step_ms_decode", "step_ms_sample", "step_ms_codec", "step_ms_gpu_gaps")


def figures(point: dict[str, Any]) -> dict[str, float]:
    engine = point.get("engine_figures") or {}
    out = {k: float(point[k]) for k in POINT if point.get(k) is not None}
    out |= {k: float(engine[k]) for k in ENGINE if engine.get(k) is not None}
    return out


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    per: dict[int, dict[str, list[dict[str, float]]]] = {}
    left_out: list[str] = []
    for name, data in runs.items():
        build = name.split("-")[0]
        for point in data["points"]:
            c = int(point["concurrency"])
            if point.get("errors"):
                left_out.append(f"{name} at {c}: {point['errors']} errors")
                continue
            per.setdefault(c, {}).setdefault(build, []).append(figures(point))
    medians: dict[str, dict[str, dict[str, float]]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for c, builds in sorted(per.items()):
        medians[str(c)] = {
            build: {
                key: round(statistics.median(f[key] for f in points if key in f), 3)
                for key in POINT + ENGINE
                if any(key in f for f in points)
            }
            | {"runs": len(points)}
            for build, points in sorted(builds.items())
        }
        base, new = medians[str(c)].get("base"), medians[str(c)].get("new")
        if base and new:
            ratios[str(c)] = {
                key: round(new[key] / base[key], 3)
                for key in ("audio_s_per_s", "step_time_ms")
                if base.get(key) and key in new
            }
    return {"medians": medians, "new_over_base": ratios, "left_out": left_out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="NAME=FILE")
    ap.add_argument("-o", "--out", type=Path, default=None)
    args = ap.parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    for item in args.runs:
        name, _, path = item.partition("=")
        if not name.startswith(("base-", "new-")) or not path:
            ap.error(f"{item!r}: expected base-N=FILE or new-N=FILE")
        if not Path(path).is_file():
            print(f"ab_summary: {name}: no {path} (the run failed)", file=sys.stderr)
            continue
        runs[name] = json.loads(Path(path).read_text())
    summary = summarise(runs)
    for c, builds in summary["medians"].items():
        for build, m in builds.items():
            cells = " ".join(f"{k}={v}" for k, v in m.items())
            print(f"C={c} {build}: {cells}")
        if c in summary["new_over_base"]:
            print(f"C={c} new/base: {summary['new_over_base'][c]}")
    for note in summary["left_out"]:
        print(f"left out: {note}")
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": runs} | summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
