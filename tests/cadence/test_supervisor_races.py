"""`cadence serve --gateways 2` (null engine, a real redis-server, real uvicorn on loopback) when a
terminal's Ctrl-C comes while a gateway process is still starting: SIGINT then reaches the whole
foreground process group, the gateway as well as the parent, before the gateway has moved to a
group of its own. The Ctrl-C is the parent's to pass on (as SIGTERM): the stop is an ordinary stop,
exit status 0, with no gateway named as having ended unexpectedly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gateway.cluster.harness import ROOT, free_port, needs_redis

pytestmark = [pytest.mark.timeout(90), needs_redis]


def gateways_in_group(parent: int) -> list[int]:
    """The parent's gateway processes (not its resource tracker) still in the parent's group."""
    try:
        pids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return []
    found = []
    for pid in pids:
        try:
            if "resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                continue
            group = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if group == parent:
            found.append(int(pid))
    return found


def test_a_ctrl_c_while_a_gateway_starts_is_an_ordinary_stop(redis_url: str) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CADENCE_")}
    parent = subprocess.Popen(
        [
            *(sys.executable, "-m", "cadence.cli", "serve", "--engine", "null", "--gateways", "2"),
            *("--port", str(port), "--redis", redis_url, "--replica-id", "ctrl-c"),
            *("--log-level", "warning"),
        ],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # a group of its own, as a shell gives a foreground job
    )
    try:
        deadline = time.monotonic() + 30
        while not gateways_in_group(parent.pid):
            assert parent.poll() is None and time.monotonic() < deadline, "no gateway started"
            time.sleep(0.002)
        os.killpg(parent.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    text = err.decode(errors="replace")
    assert parent.returncode == 0, text[-2000:]
    assert "unexpectedly" not in text and "failed to start" not in text, text[-2000:]
