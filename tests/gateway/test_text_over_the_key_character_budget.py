"""A request whose text alone is more than its key's whole characters-per-minute budget can never
be accepted, however long the client waits: it is refused as `text_too_long` (REST: 400), with a
message naming the budget and no retry hint, and it spends nothing of the budget nor holds an
utterance slot. Sans-I/O first, then over real uvicorn on loopback (WebSocket and REST)."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.quotas import QuotaError, QuotaLimits, Quotas, RateLimited
from tests.fakes import FakeEngine
from tests.gateway.quota_session import append, errors, opened, quota_protocol
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)


def test_the_budget_refuses_such_text_as_too_long_without_a_retry_time() -> None:
    q = Quotas(QuotaLimits(chars_per_minute=100))
    with pytest.raises(QuotaError) as refused:
        q.take_chars("k", 101, now=0.0)
    assert not isinstance(refused.value, RateLimited)
    assert refused.value.code == "text_too_long" and refused.value.retry_after_s is None
    assert "100 characters per minute" in refused.value.message
    q.take_chars("k", 100, now=0.0)  # the refusal spent nothing


def test_a_key_with_its_own_smaller_budget_is_held_to_it() -> None:
    q = Quotas(QuotaLimits(chars_per_minute=1000), per_key={"small": QuotaLimits(chars_per_minute=10)})
    q.take_chars("big", 11, now=0.0)
    with pytest.raises(QuotaError) as refused:
        q.take_chars("small", 11, now=0.0)
    assert refused.value.code == "text_too_long"


def test_a_new_utterance_over_the_budget_is_too_long_and_holds_nothing() -> None:
    quotas = Quotas(QuotaLimits(chars_per_minute=100))
    p = quota_protocol(quotas)
    out = p.receive_text(append("a", "x" * 101), 0.0)
    (refused,) = errors(out)
    assert not opened(out)
    assert refused["code"] == "text_too_long" and refused["utterance_id"] == "a"
    assert "retry_after_ms" not in refused and "per minute" in refused["message"]
    assert quotas.usage("k") == (0, 0)
    assert opened(p.receive_text(append("a", "x" * 100), 0.0))  # the whole budget was still there


def test_an_append_over_the_budget_is_refused_and_the_utterance_goes_on() -> None:
    quotas = Quotas(QuotaLimits(chars_per_minute=100))
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "hello "), 0.0))
    p.open_succeeded("a")
    (refused,) = errors(p.receive_text(append("a", "y" * 101), 0.0))
    assert refused["code"] == "text_too_long" and "retry_after_ms" not in refused
    assert errors(p.receive_text(append("a", "world"), 0.0)) == []
    assert p.utterance("a").text == "hello world"  # type: ignore[union-attr]


def test_the_permanent_refusal_comes_before_a_busy_one() -> None:
    """With the key's utterance cap reached too, the client learns the text can never pass,
    rather than being told to retry in a second only to be refused for good then."""
    quotas = Quotas(QuotaLimits(utterances=1, chars_per_minute=100))
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "x"), 0.0))
    p.open_succeeded("a")
    (refused,) = errors(p.receive_text(append("b", "y" * 101), 0.0))
    assert refused["code"] == "text_too_long" and "retry_after_ms" not in refused
    assert quotas.usage("k") == (0, 1)


def test_a_resume_whose_unspoken_text_is_over_the_budget_is_too_long() -> None:
    quotas = Quotas(QuotaLimits(chars_per_minute=100))
    p = quota_protocol(quotas)
    assert opened(p.receive_text(append("a", "x" * 60), 0.0))
    p.open_succeeded("a")
    p.receive_text(json.dumps({"type": "speak.cancel", "utterance_id": "a"}), 0.0)
    quotas.limits = QuotaLimits(chars_per_minute=50)  # the key's budget shrank meanwhile
    resume = json.dumps({"type": "speak.resume", "utterance_id": "b", "from_utterance": "a"})
    (refused,) = errors(p.receive_text(resume, 100.0))
    assert refused["code"] == "text_too_long" and "retry_after_ms" not in refused
    assert quotas.usage("k") == (0, 0)


# -- over real uvicorn -------------------------------------------------------------------------


async def test_over_the_wire_text_over_the_budget_is_too_long_and_the_id_stays_free() -> None:
    config = GatewayConfig(quota_limits=QuotaLimits(chars_per_minute=100), quota_anonymous=True)
    with run_gateway(FakeEngine(), config) as gw:
        async with connect(gw.ws) as ws:
            c = Client(ws)
            await c.send(type="speak.append", utterance_id="u1", text="ab " * 40)
            refused = await c.until("error", "u1")
            assert refused["code"] == "text_too_long" and "retry_after_ms" not in refused
            await c.send(type="speak.append", utterance_id="u1", text="ab " * 30)
            await c.until("utterance.started", "u1")


async def test_over_rest_text_over_the_budget_is_400_without_retry_after_and_frees_its_slot() -> None:
    config = GatewayConfig(quota_limits=QuotaLimits(utterances=1, chars_per_minute=100), quota_anonymous=True)
    with run_gateway(FakeEngine(), config) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            r = await http.post("/v1/audio/speech", json={"input": "ab " * 40, "response_format": "pcm"})
            assert r.status_code == 400 and "Retry-After" not in r.headers
            error = r.json()["error"]
            assert error["code"] == "text_too_long" and error["type"] == "invalid_request_error"
            assert "100 characters per minute" in error["message"]
            ok = await http.post("/v1/audio/speech", json={"input": "ab " * 30, "response_format": "pcm"})
            assert ok.status_code == 200, ok.text
