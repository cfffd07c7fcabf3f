"""The aligner sweep's tools on a CPU: `cadence bench --alignment` against the real gateway (null
engine ahead of real time, the stage with a fake aligner at the model boundary) records the words'
lag behind their audio per point; bench/aligner_sweep.py merges three runs into the targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.aligner_sweep import main as merge_main
from bench.aligner_sweep import merge
from clients.loadtest import bench_main
from engine.alignment.engine import AlignedEngine
from engine.null import NullEngine
from tests.engine.alignment.fakes import SpreadAligner
from tests.integration.conftest import run_gateway

PROMPTS = [
    {"text": "Sure, I can help you with that today.", "frames": 12},
    {"text": "Anything else? I am happy to look into it for you.", "frames": 14},
]


def sweep(url: str, corpus: Path, out: Path, *flags: str) -> dict:
    argv = ["--url", url, "--corpus", str(corpus), "--concurrency", "2", "--min-seconds", "0.5"]
    argv += ["--max-seconds", "3", "--warmup-seconds", "0.2", "--no-plots", "-o", str(out), *flags]
    assert bench_main(argv, command="cadence bench") == 0
    return json.loads(out.read_text())


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def test_sync_words_come_before_their_audio_and_async_words_after(tmp_path: Path, corpus: Path) -> None:
    engine = AlignedEngine(NullEngine(chunk_ms=80, speed=8.0), SpreadAligner())
    with run_gateway(engine) as gateway:
        synced = sweep(gateway.ws, corpus, tmp_path / "sync.json", "--alignment", "sync")
        asynced = sweep(gateway.ws, corpus, tmp_path / "async.json", "--alignment", "async")
    assert (synced["alignment"], asynced["alignment"]) == ("sync", "async")
    (sync_point,), (async_point,) = synced["points"], asynced["points"]
    for point in (sync_point, async_point):
        assert point["requests"] > 0 and point["errors"] == 0 and point["words_timed"] > 0
    # sync: the stage holds audio until its words are out, so every word leads its first packet
    assert sync_point["words_before_audio_pct"] == 100.0 and sync_point["words_lag_ms_p90"] <= 0
    # async: audio is sent as made and each segment's words follow once aligned
    assert async_point["words_lag_ms_p50"] > 0 and async_point["words_before_audio_pct"] < 50
    assert sync_point["engine_figures"]["aligner_jobs"] > 0


def point(c: int, ttfa: float, lag: float | None) -> dict:
    return {"concurrency": c, "ttfa_p50_ms": ttfa, "rtf_p90": 0.5, "words_lag_ms_p90": lag}


def run(points: list[dict], headline: int) -> dict:
    return {
        "command": "cadence bench",
        "commit": "c",
        "points": points,
        "headline": {"concurrency": headline},
    }


def test_the_merge_compares_the_three_runs_point_by_point(tmp_path: Path) -> None:
    runs = {
        "plain": run([point(1, 14.0, 900.0), point(256, 40.0, 1200.0)], 512),
        "async": run([point(1, 15.0, 120.0), point(256, 44.0, 350.0)], 384),
        "sync": run([point(1, 90.0, -40.0), point(256, 130.0, -5.0)], 256),
    }
    record = merge(runs, target_streams=256)
    first, at_256 = record["points"]
    assert (at_256["sync_added_ttfa_p50_ms"], at_256["sync_over_async_ttfa_p50_ms"]) == (90.0, 86.0)
    assert first["async_added_ttfa_p50_ms"] == 1.0
    assert (first["async_words_within_lag_p90"], at_256["async_words_within_lag_p90"]) == (True, False)
    assert at_256["sync"]["words_lag_ms_p90"] == -5.0 and at_256["sync_words_before_audio_p90"]
    targets = record["targets"]
    assert targets["async_headline_streams_share"] == 0.75
    assert targets["sync_added_ttfa_p50_ms"] == 90.0
    assert targets["sync_words_before_audio_p90_at_every_point"] is True
    assert targets["async_words_within_lag_p90_at_every_point"] is False
    paths = {}
    for mode, body in runs.items():
        paths[mode] = tmp_path / f"{mode}.json"
        paths[mode].write_text(json.dumps(body))
    out = tmp_path / "merged.json"
    argv = ["--plain", str(paths["plain"]), "--async", str(paths["async"]), "--sync", str(paths["sync"])]
    assert merge_main([*argv, "-o", str(out)]) == 0
    assert json.loads(out.read_text())["targets"] == targets
