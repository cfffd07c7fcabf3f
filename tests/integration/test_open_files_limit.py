"""`cadence serve` started under a low soft limit on open files still takes more sessions than
that limit: it raises the limit to the hard one at start (gateway.open_files). Without that, past
the limit accept() fails and new clients hang, neither served nor refused."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import websockets

from tests.gateway.cluster.harness import free_port, wait_until

resource = pytest.importorskip("resource")

ROOT = Path(__file__).resolve().parents[2]
SOFT = 128  # the server's soft limit when it starts
SESSIONS = 300  # sessions open at once: well past it


def _low_soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))


async def _open_all(url: str) -> int:
    sockets = await asyncio.gather(*(websockets.connect(url, open_timeout=20) for _ in range(SESSIONS)))
    try:
        # every session is served: a ping each, answered
        pongs = [await ws.ping() for ws in sockets]
        await asyncio.wait_for(asyncio.gather(*pongs), 20)
        return len(sockets)
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets))


def test_the_server_takes_more_sessions_than_its_starting_soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2 * SESSIONS + 64:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room for the test")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CADENCE_API_KEYS", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--engine", "null", "--port", str(port)]
        + ["--log-level", "warning"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_low_soft_limit,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/readyz", timeout=1).status_code == 200, 30, "cadence serve")
        own = resource.getrlimit(resource.RLIMIT_NOFILE)
        if own[0] != resource.RLIM_INFINITY and own[0] < SESSIONS + 64:  # this process is the clients
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(own[1], 4 * SESSIONS), own[1]))
        assert asyncio.run(_open_all(f"ws://127.0.0.1:{port}/v1/stream")) == SESSIONS
    finally:
        server.terminate()
        server.wait(15)
