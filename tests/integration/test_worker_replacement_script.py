"""bench/worker_replacement.py against the real server with one eSpeak worker process: the worker it
kills is replaced, the replacement is counted alive, and a stream then plays without an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import worker_replacement

pytestmark = pytest.mark.timeout(120)


def test_a_killed_worker_is_replaced_and_serves(tmp_path: Path) -> None:
    out = tmp_path / "replacement.json"
    assert worker_replacement.main(["-o", str(out), "--", "--engine", "espeak", "--gpus", "1"]) == 0
    record = json.loads(out.read_text())
    assert record["replacement_alive_s"] > 0
    assert record["after"]["requests"] > 0 and record["after"]["errors"] == 0
