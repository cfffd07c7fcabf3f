"""A point's drain is bounded: a request still under way when it ends is recorded as unfinished, and
the load-test process that holds it still reports every other record (the real gateway, null engine
in real time, one request far longer than the drain)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import clients.loadtest
from clients.loadtest import bench_main
from engine.null import NullEngine
from tests.integration.conftest import run_gateway

PROMPTS = [
    {"text": "Sure, I can help you with that today.", "frames": 4},  # 0.32 s of audio
    {"text": "This one goes on for far longer than the point's drain allows.", "frames": 1500},  # 120 s
]


def test_a_request_that_outlasts_the_drain_is_unfinished_and_the_rest_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    monkeypatch.setattr(clients.loadtest, "DRAIN_S", 1.0)
    out = tmp_path / "run.json"
    argv = ["--corpus", str(corpus), "--concurrency", "3", "--min-seconds", "1.5", "--max-seconds", "2"]
    argv += ["--warmup-seconds", "0", "--pacing", "realtime", "--no-plots", "-o", str(out)]
    with run_gateway(NullEngine(speed=1.0)) as gateway:
        assert bench_main(["--url", gateway.ws, *argv], command="cadence bench") == 0
    (point,) = json.loads(out.read_text())["points"]
    assert point["workers_unreported"] == 0
    assert point["unfinished"] >= 1 and point["errors"] >= point["unfinished"]
    assert point["requests"] >= 1  # the short prompts' records came back with the cut-off ones
