"""Quota refusals of a replica in a cluster, against a real redis-server on loopback: the
`retry_after_ms` of a `rate_limited` counts what the other replicas spent of the key's shared
budget (it is when the shared budget, not only this replica's, has room for the request), and a
text over the key's whole budget is `text_too_long` with no hint, spending nothing anywhere."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.cluster.quotas import SharedQuotas
from gateway.cluster.store import Store
from gateway.config import GatewayConfig
from gateway.protocol import OpenStream, SendControl, SessionProtocol
from gateway.quotas import QuotaLimits
from tests.fakes import FakeEngine
from tests.gateway.cluster.harness import Cluster, tools_available

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]


def _session(quotas: SharedQuotas, key_id: str = "k") -> SessionProtocol:
    return SessionProtocol("s", FakeEngine().info, GatewayConfig(), key_id=key_id, quotas=quotas)


def _append(uid: str, text: str) -> str:
    return json.dumps({"type": "speak.append", "utterance_id": uid, "text": text})


def _errors(actions: list[Any]) -> list[Any]:
    return [a.message for a in actions if isinstance(a, SendControl) and a.message["type"] == "error"]


async def test_the_hint_counts_what_the_other_replicas_spent(stores: list[Store]) -> None:
    limits = QuotaLimits(chars_per_minute=600)  # 10 characters a second
    a, b = (SharedQuotas(store, name, limits) for store, name in zip(stores, "ab", strict=True))
    loop = asyncio.get_running_loop()
    a.take_chars("k", 500, loop.time())
    await a.write(full=False)
    b.take_chars("k", 50, loop.time())  # b's own bucket is full until its write brings the level
    await b.write(full=False)  # the shared level (~50) comes back
    at = loop.time()
    (refused,) = _errors(_session(b).receive_text(_append("u", "x" * 80), at))
    assert refused["code"] == "rate_limited"
    # 30 characters short of the shared budget: 3 s (less what refilled since the write); b's
    # own spending alone (550 left) would have let it through
    assert 2500 <= refused["retry_after_ms"] <= 3000
    b.take_chars("k", 80, at + refused["retry_after_ms"] / 1000)  # in, when the hint says


async def test_text_over_the_key_budget_is_too_long_and_reaches_no_shared_bucket(
    stores: list[Store], redis_server: Cluster
) -> None:
    b = SharedQuotas(
        stores[1],
        "b",
        QuotaLimits(chars_per_minute=1000),
        per_key={"small": QuotaLimits(chars_per_minute=10)},
    )
    loop = asyncio.get_running_loop()
    out = _session(b, "small").receive_text(_append("u", "x" * 11), loop.time())
    (refused,) = _errors(out)
    assert not any(isinstance(a, OpenStream) for a in out)
    assert refused["code"] == "text_too_long" and "retry_after_ms" not in refused
    assert "10 characters per minute" in refused["message"]
    await b.write(full=True)
    direct = aioredis.Redis(port=redis_server.redis_port)
    try:
        assert not await direct.exists("cadence:chars:small")  # nothing was spent
        assert await direct.hget("cadence:usage:b", "u:small") is None  # no utterance held
    finally:
        await direct.aclose()
    assert b.usage("small") == (0, 0)
