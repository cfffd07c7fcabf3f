"""One record of the sweep with word timestamps from the aligner: three `cadence bench` runs of the
same build (without the aligner, with it in `alignment: "async"` sessions, with it in `"sync"` ones)
merged point by point, with the figures the aligner's targets are read from.

    python bench/aligner_sweep.py --plain bench-1.7b-plain.json --async bench-1.7b-async.json \
        --sync bench-1.7b-sync.json -o bench-1.7b-aligner.json

Per concurrency: each run's TTFA, RTF, underruns and words' lag behind their first audio
(`words_lag_ms_p90`: negative when the words came first); the TTFA p50 that each aligner mode adds
over the run without it, and sync over async (what waiting for the words costs beside the aligner's
own GPU share). Targets: the async run's headline streams as a share of the plain run's; sync's
added TTFA p50 at `--streams`; per point, whether sync words came before their audio and async
words within `--async-lag-ms` of it (p90).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.loadtest_report import headline  # noqa: E402

MODES = ("plain", "async", "sync")
FIGURES = (
    "requests",
    "errors",
    "ttfa_p50_ms",
    "ttfa_p90_ms",
    "rtf_p50",
    "rtf_p90",
    "underrun_streams_pct",
    "audio_s_per_s",
    "words_timed",
    "words_lag_ms_p50",
    "words_lag_ms_p90",
    "words_before_audio_pct",
)
# the aligner stage's counters, as the server reports them (totals since it started)
ENGINE_FIGURES = (
    "aligner_jobs",
    "aligner_probes",
    "aligner_probe_words",
    "aligner_failures",
    "aligner_largest_batch",
)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


def merge(
    runs: dict[str, dict[str, Any]], target_streams: int = 256, async_lag_ms: float = 300.0
) -> dict[str, Any]:
    by_c = {mode: {p["concurrency"]: p for p in runs[mode]["points"]} for mode in MODES}
    points = []
    for concurrency in sorted(set(by_c["plain"]) | set(by_c["async"]) | set(by_c["sync"])):
        row: dict[str, Any] = {"concurrency": concurrency}
        for mode in MODES:
            point = by_c[mode].get(concurrency)
            if point is None:
                row[mode] = None
                continue
            row[mode] = {key: point.get(key) for key in FIGURES}
            engine = point.get("engine_figures", {})
            row[mode].update({key: engine[key] for key in ENGINE_FIGURES if key in engine})

        def ttfa(mode: str, row: dict[str, Any] = row) -> float | None:
            return row[mode]["ttfa_p50_ms"] if row[mode] else None

        def lag(mode: str, row: dict[str, Any] = row) -> float | None:
            return row[mode]["words_lag_ms_p90"] if row[mode] else None

        row["async_added_ttfa_p50_ms"] = _minus(ttfa("async"), ttfa("plain"))
        row["sync_added_ttfa_p50_ms"] = _minus(ttfa("sync"), ttfa("plain"))
        row["sync_over_async_ttfa_p50_ms"] = _minus(ttfa("sync"), ttfa("async"))
        sync_lag, async_lag = lag("sync"), lag("async")
        row["sync_words_before_audio_p90"] = None if sync_lag is None else sync_lag <= 0
        row["async_words_within_lag_p90"] = None if async_lag is None else async_lag <= async_lag_ms
        points.append(row)
    # the streams each run keeps within the criteria; where the run without the aligner swept
    # further (past the capacity), over the levels both ran
    async_levels = {p["concurrency"] for p in runs["async"]["points"]}
    shared = [p for p in runs["plain"]["points"] if p["concurrency"] in async_levels]
    if len(shared) < len(runs["plain"]["points"]):
        plain_streams = headline(shared)["concurrency"]
    else:
        plain_streams = (runs["plain"].get("headline") or {}).get("concurrency", 0)
    async_streams = (runs["async"].get("headline") or {}).get("concurrency", 0)
    at_target = next((row for row in points if row["concurrency"] == target_streams), None)
    return {
        "command": {mode: runs[mode].get("command") for mode in MODES},
        "commit": runs["plain"].get("commit"),
        "gpu": runs["plain"].get("gpu"),
        "model_shapes": runs["plain"].get("model_shapes"),
        "headline": {mode: runs[mode].get("headline") for mode in MODES},
        "targets": {
            "async_headline_streams_share": round(async_streams / plain_streams, 3)
            if plain_streams
            else None,
            "sync_added_ttfa_p50_ms_at": target_streams,
            "sync_added_ttfa_p50_ms": at_target["sync_added_ttfa_p50_ms"] if at_target else None,
            "sync_over_async_ttfa_p50_ms": at_target["sync_over_async_ttfa_p50_ms"] if at_target else None,
            "sync_words_before_audio_p90_at_every_point": all(
                row["sync_words_before_audio_p90"] for row in points if row["sync"]
            ),
            "async_words_within_lag_ms": async_lag_ms,
            "async_words_within_lag_p90_at_every_point": all(
                row["async_words_within_lag_p90"] for row in points if row["async"]
            ),
        },
        "points": points,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", type=Path, required=True, help="the sweep without the aligner")
    parser.add_argument("--async", dest="asynced", type=Path, required=True, help='with it, "async" sessions')
    parser.add_argument("--sync", type=Path, required=True, help='with it, "sync" sessions')
    parser.add_argument("--streams", type=int, default=256, help="where sync's added TTFA is read")
    parser.add_argument("--async-lag-ms", type=float, default=300.0)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    paths = {"plain": args.plain, "async": args.asynced, "sync": args.sync}
    runs = {mode: json.loads(path.read_text()) for mode, path in paths.items()}
    record = merge(runs, args.streams, args.async_lag_ms)
    args.output.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    for row in record["points"]:
        cells = [f"C={row['concurrency']}"]
        for mode in MODES:
            figures = row[mode]
            if figures:
                cells.append(
                    f"{mode}: TTFA p50 {figures['ttfa_p50_ms']} ms, RTF p90 {figures['rtf_p90']}, "
                    f"words lag p90 {figures['words_lag_ms_p90']} ms"
                )
        print("; ".join(cells))
    print(f"targets: {json.dumps(record['targets'])}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
