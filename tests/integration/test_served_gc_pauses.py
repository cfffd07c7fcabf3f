"""`cadence serve`, a process of its own, times its garbage collector's pauses for /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.gateway.cluster.harness import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_the_served_gateway_reports_its_collector_pauses() -> None:
    port = free_port()
    # a low young threshold: the few syntheses below make collections certain
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CADENCE_GC_YOUNG_THRESHOLD": "100"}
    env.pop("CADENCE_API_KEYS", None)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "serve",
            "--engine",
            "espeak",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/readyz", timeout=1).status_code == 200, 30, "cadence serve")
        for text in ("Hello there.", "The weather looks fine today.", "Please hold on."):
            reply = httpx.post(
                f"{base}/v1/audio/speech", json={"input": text, "response_format": "pcm"}, timeout=30
            )
            assert reply.status_code == 200 and reply.content
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
    finally:
        server.terminate()
        server.wait(15)
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(lines["cadence_gc_pause_longest_seconds"]) >= 0.0
    young = float(lines['cadence_gc_pause_seconds_count{generation="0"}'])
    assert young > 0  # three syntheses made garbage enough for young collections, each one timed
    assert 0 < float(lines['cadence_gc_pause_seconds_sum{generation="0"}']) < young  # each under a second


def test_settling_the_collector_freezes_start_up_and_sets_its_thresholds() -> None:
    """In a process of its own (the collector's state is the whole process's): the default young and
    full thresholds, then CADENCE_GC_YOUNG_THRESHOLD's and CADENCE_GC_FULL_AFTER's."""
    probe = (
        "import gc; from gateway.server import settle_garbage_collector; settle_garbage_collector(); "
        "t = gc.get_threshold(); print(t[0], t[2], gc.get_freeze_count() > 1000)"
    )
    for young, full, expected in ((None, None, "7000 100 True"), ("1500", "40", "1500 40 True")):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for name, value in (("CADENCE_GC_YOUNG_THRESHOLD", young), ("CADENCE_GC_FULL_AFTER", full)):
            env.pop(name, None)
            if value is not None:
                env[name] = value
        out = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        assert out == expected
