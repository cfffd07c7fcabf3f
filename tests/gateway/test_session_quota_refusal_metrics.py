"""A session refused at the door for its key's session quota is an error like any other: the
client gets `quota_exceeded` and a 1008 close, and `cadence_errors_total` counts it, over real
uvicorn on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from gateway.config import GatewayConfig
from gateway.quotas import QuotaLimits
from tests.fakes import FakeEngine
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import connect

pytestmark = pytest.mark.timeout(60)


def _errors(text: str, code: str) -> float:
    prefix = f'cadence_errors_total{{code="{code}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


async def test_a_session_over_the_key_quota_is_counted_in_the_errors() -> None:
    config = GatewayConfig(quota_limits=QuotaLimits(sessions=1), quota_anonymous=True)
    with run_gateway(FakeEngine(), config) as gw:
        async with connect(gw.ws), connect(gw.ws) as refused:
            error = json.loads(await asyncio.wait_for(refused.recv(), 5))
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(refused.recv(), 5)
            assert error["code"] == "quota_exceeded" and refused.close_code == 1008
            assert error["retry_after_ms"] == 1000  # a count: a hint to look again, not a promise
            async with httpx.AsyncClient(base_url=gw.http) as http:
                page = (await http.get("/metrics")).text
        assert _errors(page, "quota_exceeded") == 1.0
