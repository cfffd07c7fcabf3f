"""A voice deleted through one replica leaves every replica's engine, not just the registries: two
in-process gateways with an engine that clones (the test fake) share a real redis-server."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.cluster.harness import Cluster, tools_available, wait_until
from tests.gateway.cluster.test_shared_voice_use import clip
from tests.integration.conftest import run_gateway

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]


async def test_a_voice_deleted_on_one_replica_leaves_the_engine_of_another(redis_server: Cluster) -> None:
    engines = [FakeEngine(), FakeEngine()]
    configs = [GatewayConfig(redis_url=redis_server.redis_url, replica_id=f"r{i}") for i in (1, 2)]
    with run_gateway(engines[0], configs[0]) as a, run_gateway(engines[1], configs[1]) as b:
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{a.http}/v1/voices?name=Grace&text=hello", content=clip())
            assert response.status_code == 201, response.text
            voice_id = response.json()["voice_id"]
            wait_until(lambda: voice_id in engines[1].registered, 5, "the voice on replica b")
            assert (await http.delete(f"{b.http}/v1/voices/{voice_id}")).status_code == 200
            assert voice_id not in engines[1].registered  # the replica that took the deletion
            wait_until(lambda: voice_id not in engines[0].registered, 5, "the deletion on replica a")
            body = {"input": "Hello there.", "voice": voice_id, "response_format": "pcm"}
            refused = await http.post(f"{a.http}/v1/audio/speech", json=body)
            assert (refused.status_code, refused.json()["error"]["code"]) == (400, "unknown_voice")
