"""A request refused for its key's quota says when to retry: `rate_limited` carries
`retry_after_ms`, the time until enough of the characters-per-minute budget has drained back for
that very request (retrying then succeeds, retrying earlier does not); a count (the key's
utterances in progress, its open sessions) carries a one-second hint; the session's lifetime cap,
which never frees within the session, carries none. Sans-I/O first, then over real uvicorn on
loopback (WebSocket and REST)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.quotas import QuotaExceeded, QuotaLimits, Quotas, RateLimited
from tests.fakes import FakeEngine
from tests.gateway.quota_session import append, errors, opened, quota_protocol
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)


# -- the budget's arithmetic ------------------------------------------------------------------


def test_rate_limited_says_when_the_budget_has_drained_enough_for_this_request() -> None:
    q = Quotas(QuotaLimits(chars_per_minute=600))  # 10 characters a second
    q.take_chars("k", 590, now=0.0)
    with pytest.raises(RateLimited) as refused:
        q.take_chars("k", 40, now=0.5)  # 15 available: 25 short, 2.5 s of refill
    assert refused.value.retry_after_s == pytest.approx(2.5)
    with pytest.raises(RateLimited):
        q.take_chars("k", 40, now=2.9)
    q.take_chars("k", 40, now=3.0)


def test_a_count_quota_gives_a_one_second_hint() -> None:
    q = Quotas(QuotaLimits(sessions=1, utterances=1))
    q.open_session("k")
    q.begin_utterance("k")
    with pytest.raises(QuotaExceeded) as sessions:
        q.open_session("k")
    with pytest.raises(QuotaExceeded) as utterances:
        q.begin_utterance("k")
    assert sessions.value.retry_after_s == utterances.value.retry_after_s == 1.0


# -- the session's error message ---------------------------------------------------------------


def test_a_rate_limited_append_carries_retry_after_ms_and_succeeds_when_retried_then() -> None:
    quotas = Quotas(QuotaLimits(chars_per_minute=600))
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "x" * 590), 0.0))
    p.open_succeeded("a")
    (refused,) = errors(p.receive_text(append("a", "y" * 40), 0.5))
    assert refused["code"] == "rate_limited" and refused["utterance_id"] == "a"
    assert refused["retry_after_ms"] == 2500
    (early,) = errors(p.receive_text(append("a", "y" * 40), 2.9))
    assert early["code"] == "rate_limited" and 0 < early["retry_after_ms"] <= 100
    assert errors(p.receive_text(append("a", "y" * 40), 0.5 + refused["retry_after_ms"] / 1000)) == []


def test_a_refused_new_utterance_carries_retry_after_ms_and_gives_its_slot_back() -> None:
    quotas = Quotas(QuotaLimits(chars_per_minute=600))
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "x" * 600), 0.0))
    p.open_succeeded("a")
    (refused,) = errors(p.receive_text(append("b", "y" * 7), 0.0))
    assert refused["code"] == "rate_limited" and refused["utterance_id"] == "b"
    assert refused["retry_after_ms"] == 700
    assert quotas.usage("k") == (0, 1)  # "a" only
    assert opened(p.receive_text(append("b", "y" * 7), 0.7))


def test_a_hint_never_asks_for_a_retry_that_comes_too_early() -> None:
    """The hint is rounded up to the millisecond: a client that waits exactly that long is in."""
    quotas = Quotas(QuotaLimits(chars_per_minute=7))  # 60/7 s per character: no whole ms
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "x" * 7), 0.0))
    p.open_succeeded("a")
    (refused,) = errors(p.receive_text(append("a", "y"), 0.0))
    assert refused["retry_after_ms"] == math.ceil(60_000 / 7)
    assert errors(p.receive_text(append("a", "y"), refused["retry_after_ms"] / 1000)) == []


def test_the_key_utterance_cap_hints_and_the_session_lifetime_cap_does_not() -> None:
    quotas = Quotas(QuotaLimits(utterances=1))
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "x"), 0.0))
    p.open_succeeded("a")
    (busy,) = errors(p.receive_text(append("b", "x"), 0.0))
    assert busy["code"] == "quota_exceeded" and busy["retry_after_ms"] == 1000
    # the session's own lifetime cap never frees within the session: no time to wait for
    p = quota_protocol(Quotas(), max_utterances_per_session=1)
    assert opened(p.receive_text(append("a", "x"), 0.0))
    p.open_succeeded("a")
    p.receive_text(json.dumps({"type": "speak.cancel", "utterance_id": "a"}), 0.0)
    (spent,) = errors(p.receive_text(append("b", "x"), 0.0))
    assert spent["code"] == "quota_exceeded" and "retry_after_ms" not in spent


# -- over real uvicorn -------------------------------------------------------------------------


async def test_over_the_wire_a_client_that_waits_retry_after_ms_is_admitted() -> None:
    config = GatewayConfig(quota_limits=QuotaLimits(chars_per_minute=600), quota_anonymous=True)
    with run_gateway(FakeEngine(), config) as gw:
        async with connect(gw.ws) as ws:
            c = Client(ws)
            await c.send(type="speak.append", utterance_id="u1", text="ab " * 200)  # the whole budget
            await c.until("utterance.started", "u1")
            await c.send(type="speak.cancel", utterance_id="u1")  # what was spent stays spent
            await c.until("utterance.interrupted", "u1")
            await c.send(type="speak.append", utterance_id="u2", text="hello")
            refused = await c.until("error", "u2")
            assert refused["code"] == "rate_limited"
            assert 0 < refused["retry_after_ms"] <= 500
            await asyncio.sleep(refused["retry_after_ms"] / 1000)
            await c.send(type="speak.append", utterance_id="u2", text="hello")
            assert (await c.until("utterance.started", "u2"))["utterance_id"] == "u2"


async def test_over_rest_rate_limited_is_429_with_retry_after_in_whole_seconds_rounded_up() -> None:
    config = GatewayConfig(quota_limits=QuotaLimits(chars_per_minute=600), quota_anonymous=True)
    with run_gateway(FakeEngine(), config) as gw:
        async with connect(gw.ws) as ws:
            c = Client(ws)
            await c.send(type="speak.append", utterance_id="u1", text="ab " * 200)
            await c.until("utterance.started", "u1")
            await c.send(type="speak.cancel", utterance_id="u1")
            await c.until("utterance.interrupted", "u1")
            async with httpx.AsyncClient(base_url=gw.http) as http:
                # 25 characters short of ~0: 2.5 s of refill, said as 3 (never as 2: too early)
                r = await http.post("/v1/audio/speech", json={"input": "z" * 25, "response_format": "pcm"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert r.headers["Retry-After"] == "3"
