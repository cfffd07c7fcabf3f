"""A voice registered through one replica is spoken through another: two in-process gateways
with an engine that clones (the test fake) share a real redis-server."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.cluster.harness import Cluster, tools_available, wait_until
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]


def clip() -> bytes:
    rate = 16_000
    t = np.arange(rate * 2) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


async def test_voice_registered_on_one_replica_is_spoken_by_another(tmp_path: Path) -> None:
    redis = Cluster(tmp_path)
    redis.start_redis()
    try:
        engines = [FakeEngine(), FakeEngine()]
        configs = [GatewayConfig(redis_url=redis.redis_url, replica_id=f"r{i}") for i in (1, 2)]
        with run_gateway(engines[0], configs[0]) as a, run_gateway(engines[1], configs[1]) as b:
            async with httpx.AsyncClient() as http:
                response = await http.post(f"{a.http}/v1/voices?name=Grace&text=hello", content=clip())
            assert response.status_code == 201, response.text
            voice_id = response.json()["voice_id"]
            # replica b's engine got the same clip from Redis
            wait_until(lambda: voice_id in engines[1].registered, 5, "the voice on replica b")
            assert engines[1].registered[voice_id] == (16_000, "hello")
            async with websockets.connect(b.ws, max_size=None) as ws:
                client = Client(ws)
                await client.send(type="session.start", voice=voice_id)
                await client.until("session.started")
                await client.send(type="speak.append", utterance_id="u1", text="Hello there.")
                await client.send(type="speak.end", utterance_id="u1")
                done = await client.until("utterance.done", "u1")
                assert done["duration_ms"] > 0 and not client.got.of_type("error")
            assert engines[1].streams[-1].request.voice == voice_id
            # deleted on b: gone on a too
            async with httpx.AsyncClient() as http:
                assert (await http.delete(f"{b.http}/v1/voices/{voice_id}")).status_code == 200
            wait_until(
                lambda: httpx.get(f"{a.http}/v1/voices/{voice_id}").status_code == 404, 5, "the deletion"
            )
    finally:
        redis.stop()
