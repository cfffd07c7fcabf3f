"""Admission end to end over real uvicorn on loopback, with the null engine admitting one stream and
queueing one: `utterance.queued` with its position and expected wait, `overloaded` with
`retry_after_ms` past the queue or the client's `max_wait_ms`, REST's 429 with Retry-After, and
the figures in /metrics and /v1/load."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.null import NullEngine
from tests.integration.conftest import GatewayFactory, RunningGateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)

LONG = "This one keeps the only slot busy for a good two seconds of audio."  # ~4.8 s at 14 chars/s
SHORT = "Hi there."


def sample(text: str, name: str, labels: str = "") -> float:
    """A sample's value from the Prometheus text."""
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}{labels} in /metrics")


@pytest.fixture
def one_slot(gateway_factory: GatewayFactory) -> RunningGateway:
    return gateway_factory(NullEngine(max_streams=1, queue_limit=1))


async def test_queued_then_admitted_and_refused_past_the_queue(one_slot: RunningGateway) -> None:
    async with connect(one_slot.ws) as ws:
        c = Client(ws)
        for uid, text in (("u1", SHORT), ("u2", SHORT), ("u3", SHORT)):
            await c.send(type="speak.append", utterance_id=uid, text=text)
            await c.send(type="speak.end", utterance_id=uid)
        refused = await c.until("error", "u3")
        done1 = await c.until("utterance.done", "u1")
        done2 = await c.until("utterance.done", "u2")
    got = c.got
    (queued,) = got.of_type("utterance.queued")
    assert queued["utterance_id"] == "u2" and queued["position"] == 1 and queued["expected_wait_ms"] >= 0
    order = [m["type"] for m in got.messages if m.get("utterance_id") == "u2"]
    assert order.index("utterance.started") < order.index("utterance.queued") < order.index("utterance.done")
    assert refused["code"] == "overloaded" and refused["retry_after_ms"] >= 500
    assert not got.of_type("utterance.started", "u3")  # a refused utterance is forgotten
    # u2's audio came after u1's: it waited for the slot, and says how long
    assert "queued_ms" not in done1 and done2["queued_ms"] > 0
    last_of_u1 = max(
        i for i, x in enumerate(got.order) if not isinstance(x, dict) and x.stream == got.stream_of("u1")
    )
    first_of_u2 = min(
        i for i, x in enumerate(got.order) if not isinstance(x, dict) and x.stream == got.stream_of("u2")
    )
    assert last_of_u1 < first_of_u2

    async with httpx.AsyncClient(base_url=one_slot.http) as http:
        metrics = (await http.get("/metrics")).text
        load = (await http.get("/v1/load")).json()["engine"]
    assert sample(metrics, "cadence_engine_capacity") == 1
    assert sample(metrics, "cadence_engine_queue_limit") == 1
    assert sample(metrics, "cadence_engine_refusals_total", '{reason="queue_full"}') == 1
    assert sample(metrics, "cadence_engine_refusals_total", '{reason="max_wait"}') == 0
    assert sample(metrics, "cadence_engine_queue_wait_seconds_count") == 1
    assert sample(metrics, "cadence_engine_admitted_total") == 2
    assert sample(metrics, "cadence_engine_queued_total") == 1
    assert sample(metrics, "cadence_errors_total", '{code="overloaded"}') == 1
    admission = load["admission"]
    assert (admission["capacity"], admission["queued"], admission["queue_limit"]) == (1, 0, 1)
    assert admission["refused"]["queue_full"] == 1 and admission["queue_wait_p50_ms"] > 0


async def test_max_wait_refuses_at_once_or_when_it_passes(one_slot: RunningGateway) -> None:
    async with connect(one_slot.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="short", text=SHORT)  # how long a stream lives
        await c.send(type="speak.end", utterance_id="short")
        await c.until("utterance.done", "short")
        await c.send(type="speak.append", utterance_id="busy", text=LONG)
        await c.send(type="speak.end", utterance_id="busy")
        await c.until("utterance.started", "busy")
        await c.send(type="speak.append", utterance_id="now", text=SHORT, max_wait_ms=0)
        at_once = await c.until("error", "now")
        # expected to wait about the short stream's life: queued, then refused when 1.5 s pass
        await c.send(type="speak.append", utterance_id="soon", text=SHORT, max_wait_ms=1500)
        await c.until("utterance.queued", "soon")
        expired = await c.until("error", "soon", wait_s=5)
        await c.send(type="speak.cancel", utterance_id="busy")
        await c.until("utterance.interrupted", "busy")
    assert at_once["code"] == "overloaded" and "max_wait_ms" in at_once["message"]
    assert expired["code"] == "overloaded" and expired["retry_after_ms"] >= 500
    async with httpx.AsyncClient(base_url=one_slot.http) as http:
        metrics = (await http.get("/metrics")).text
    assert sample(metrics, "cadence_engine_refusals_total", '{reason="max_wait"}') == 1
    assert sample(metrics, "cadence_engine_refusals_total", '{reason="wait_expired"}') == 1


async def test_rest_answers_429_with_retry_after(one_slot: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=one_slot.http, timeout=10) as http:
        first = await http.post("/v1/audio/speech", json={"input": SHORT})  # how long a stream lives
        assert first.status_code == 200
        async with connect(one_slot.ws) as ws:  # a stream holds the only slot
            c = Client(ws)
            await c.send(type="speak.append", utterance_id="busy", text=LONG)
            await c.until("utterance.started", "busy")
            at_once = await http.post("/v1/audio/speech", json={"input": SHORT, "max_wait_ms": 0})
            assert at_once.status_code == 429 and int(at_once.headers["Retry-After"]) >= 1
            assert at_once.json()["error"]["code"] == "overloaded"
            # queued (the queue holds one), then refused when its own wait passes: flac is sent
            # whole, so the refusal is still a 429
            expired = await http.post(
                "/v1/audio/speech", json={"input": SHORT, "max_wait_ms": 1500, "response_format": "flac"}
            )
            assert expired.status_code == 429 and int(expired.headers["Retry-After"]) >= 1
            bad = await http.post("/v1/audio/speech", json={"input": SHORT, "max_wait_ms": "soon"})
            assert bad.status_code == 400
            waiting = asyncio.ensure_future(
                http.post("/v1/audio/speech", json={"input": SHORT, "response_format": "wav"})
            )
            await asyncio.sleep(0.3)
            full = await http.post("/v1/audio/speech", json={"input": SHORT})
            assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
            await c.send(type="speak.cancel", utterance_id="busy")
            served = await waiting  # admitted once the stream's slot freed
            assert served.status_code == 200 and served.headers["content-type"] == "audio/wav"
        metrics = (await http.get("/metrics")).text
    refusals = {
        reason: sample(metrics, "cadence_engine_refusals_total", f'{{reason="{reason}"}}')
        for reason in ("queue_full", "max_wait", "wait_expired")
    }
    assert refusals == {"queue_full": 1, "max_wait": 1, "wait_expired": 1}
