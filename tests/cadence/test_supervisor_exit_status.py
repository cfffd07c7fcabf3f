"""The exit status of `cadence serve --gateways 2` (null engine, a real redis-server, real uvicorn on
loopback): a drained stop exits 0; a gateway that dies when the parent did not ask it to stop (just
before the stop, or killed while it drains) makes the parent exit 1 with a line naming it and how
it died."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import websockets

from tests.gateway.cluster.harness import ROOT, free_port, needs_redis, wait_until
from tests.integration.wsclient import Client

pytestmark = [pytest.mark.timeout(90), needs_redis]
LONG_TEXT = "A gateway that holds a session while it drains is still running when it is killed. " * 4


class Served:
    """`cadence serve --gateways 2` on a free port, its output kept for the assertions."""

    def __init__(self, redis_url: str, replica_id: str) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CADENCE_")}
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "cadence.cli", "serve", "--engine", "null", "--gateways", "2"),
                *("--port", str(self.port), "--redis", redis_url, "--replica-id", replica_id),
                *("--log-level", "warning"),
            ],
            cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        expected = [f"{replica_id}/g0", f"{replica_id}/g1"]
        wait_until(lambda: self.replicas() == expected, 40, "two gateways serving")

    def replicas(self) -> list[str]:
        assert self.process.poll() is None, "the parent exited before its gateways served"
        try:
            answer = httpx.get(f"http://127.0.0.1:{self.port}/v1/cluster", timeout=2)
        except httpx.HTTPError:
            return []
        return sorted(answer.json()["replicas"]) if answer.status_code == 200 else []

    def children(self) -> list[int]:
        """The gateway processes (the parent's children but its resource tracker)."""
        pids = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return [
            int(p)
            for p in pids
            if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        ]

    def finish(self) -> tuple[int, str]:
        """The parent's exit status and its standard error, once it has stopped by itself."""
        try:
            _, err = self.process.communicate(timeout=40)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        return self.process.returncode, err.decode(errors="replace")


def refused(port: int) -> bool:
    """No gateway listens on `port` any more (each has begun its drain)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_drained_stop_exits_0(redis_url: str) -> None:
    served = Served(redis_url, "clean")
    served.process.send_signal(signal.SIGTERM)
    code, err = served.finish()
    assert code == 0, err[-2000:]
    assert "unexpectedly" not in err, err[-2000:]


def test_a_gateway_killed_just_before_the_stop_makes_the_exit_status_1(redis_url: str) -> None:
    """The parent sees the stop before (or while) it handles the death: the gateway it did not ask
    to stop is not counted as drained, whether or not the parent had begun to restart it."""
    served = Served(redis_url, "killed")
    victim = served.children()[0]
    os.kill(victim, signal.SIGKILL)
    served.process.send_signal(signal.SIGTERM)
    code, err = served.finish()
    assert code == 1, err[-2000:]
    assert f"pid {victim}" in err and "SIGKILL" in err, err[-2000:]


async def test_a_gateway_killed_while_it_drains_makes_the_exit_status_1(redis_url: str) -> None:
    served = Served(redis_url, "draining")
    client = Client(await websockets.connect(f"ws://127.0.0.1:{served.port}/v1/stream", max_size=None))
    try:
        await client.send(type="session.start", pacing="realtime")
        await client.until("session.started")
        await client.send(type="speak.append", utterance_id="u1", text=LONG_TEXT)
        await client.send(type="speak.end", utterance_id="u1")
        await client.until("utterance.started", "u1")
        children = served.children()
        served.process.send_signal(signal.SIGTERM)
        # both stopped accepting: the one holding the session drains it for seconds yet
        await asyncio.to_thread(wait_until, lambda: refused(served.port), 10, "the drain to begin")
        killed = []
        for pid in children:
            with contextlib.suppress(ProcessLookupError):  # the one without sessions may be gone
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        code, err = await asyncio.to_thread(served.finish)
    finally:
        await client.ws.close()
    assert code == 1, err[-2000:]
    assert killed and any(f"pid {pid}" in err for pid in killed), (killed, err[-2000:])
    assert "SIGKILL" in err, err[-2000:]
