"""`cadence serve`, a process of its own, times its garbage collector's pauses for /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.cluster.harness import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_the_served_gateway_reports_its_collector_pauses() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CADENCE_API_KEYS", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--engine", "espeak", "--port", str(port),
         "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/readyz", timeout=1).status_code == 200, 30, "cadence serve")
        for text in ("Hello there.", "The weather looks fine today.", "Please hold on."):
            reply = httpx.post(f"{base}/v1/audio/speech", json={"input": text, "response_format": "pcm"}, timeout=30)
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
