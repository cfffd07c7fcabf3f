"""bench/ab_summary.py: two builds' runs side by side, medians per build and new's ratio to base,
points with errors left out and named; bench/gpu_ab.sh refuses a missing base tree."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.ab_summary import main, summarise

ROOT = Path(__file__).resolve().parents[2]


def run(*points: tuple[int, float, float, int]) -> dict:
    """A `cadence bench` record: (concurrency, audio-s/s, step ms, errors) per point."""
    return {
        "points": [
            {
                "concurrency": c,
                "errors": errors,
                "audio_s_per_s": aps,
                "ttfa_p50_ms": 50.0,
                "underrun_streams_pct": 0.0,
                "engine_figures": {"step_time_ms": step, "step_ms_gpu_gaps": step / 10},
            }
            for c, aps, step, errors in points
        ]
    }


def test_medians_per_build_and_the_ratio_leave_out_points_with_errors():
    runs = {
        "base-1": run((512, 800.0, 30.0, 0), (768, 500.0, 40.0, 99)),
        "new-2": run((512, 860.0, 27.0, 0), (768, 900.0, 27.0, 0)),
        "base-3": run((512, 780.0, 29.0, 0), (768, 840.0, 34.0, 0)),
        "new-4": run((512, 880.0, 28.0, 0), (768, 880.0, 28.0, 0)),
    }
    s = summarise(runs)
    assert s["medians"]["512"]["base"]["audio_s_per_s"] == 790.0 and s["medians"]["512"]["base"]["runs"] == 2
    assert s["medians"]["512"]["new"]["audio_s_per_s"] == 870.0
    assert s["medians"]["768"]["base"] == {
        "audio_s_per_s": 840.0,
        "ttfa_p50_ms": 50.0,
        "underrun_streams_pct": 0.0,
        "step_time_ms": 34.0,
        "step_ms_gpu_gaps": 3.4,
        "runs": 1,
    }
    assert s["new_over_base"]["512"] == {
        "audio_s_per_s": round(870 / 790, 3),
        "step_time_ms": round(27.5 / 29.5, 3),
    }
    assert s["left_out"] == ["base-1 at 768: 99 errors"]


def test_the_command_writes_every_run_and_skips_a_missing_file(tmp_path: Path, capsys):
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(run((1, 12.0, 6.0, 0))))
    new.write_text(json.dumps(run((1, 13.0, 6.0, 0))))
    out = tmp_path / "ab.json"
    assert main([f"base-1={base}", f"new-2={new}", f"new-3={tmp_path / 'missing.json'}", "-o", str(out)]) == 0
    written = json.loads(out.read_text())
    assert set(written["runs"]) == {"base-1", "new-2"}
    assert written["new_over_base"]["1"]["audio_s_per_s"] == round(13 / 12, 3)
    assert "C=1 new/base" in capsys.readouterr().out


def test_gpu_ab_refuses_a_missing_base_tree(tmp_path: Path):
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_ab.sh")],
        env={"PATH": "/usr/bin:/bin", "BASE": str(tmp_path / "nowhere"), "OUTDIR": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no tree at" in done.stdout


def test_gpu_ab_serves_each_tree_in_turn_on_a_cpu(tmp_path: Path):
    """The whole chain at tiny shapes: a copy of this tree as the base, each build served from its
    own tree (its packages first on the path) through bench/gpu_bench_e2e.sh, then the summary."""
    import shutil
    import sys

    base = tmp_path / "base"
    for name in ("engine", "cadence", "gateway", "clients", "aligner", "bench", "scripts"):
        shutil.copytree(ROOT / name, base / name, ignore=shutil.ignore_patterns("__pycache__"))
    (base / "deploy" / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "bench" / "corpus.jsonl", base / "deploy" / "bench")
    server = base / "gateway" / "server.py"  # the base tree's server says which tree it is
    server.write_text(
        server.read_text().replace("no API keys configured", "base tree: no API keys configured")
    )
    out = tmp_path / "out"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "BASE": str(base),
        "OUTDIR": str(out),
        "SIZE": "tiny",
        "DEVICE": "cpu",
        "CKPT": str(tmp_path / "ckpt"),
        "CONC": "1",
        "POINT_SECONDS": "1",
        "WARMUP_SECONDS": "1",
        "ORDER": "base new",
        "EACH": "240",
        "PORT": "8797",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_ab.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ab = json.loads((out / "ab.json").read_text())
    assert set(ab["runs"]) == {"base-1", "new-2"} and ab["left_out"] == []
    assert {b: m["runs"] for b, m in ab["medians"]["1"].items()} == {"base": 1, "new": 1}
    assert ab["new_over_base"]["1"]["audio_s_per_s"] > 0
    # each server ran from its own tree
    assert "base tree: no API keys" in (out / "serve-base-1.log").read_text()
    assert "base tree" not in (out / "serve-new-2.log").read_text()
