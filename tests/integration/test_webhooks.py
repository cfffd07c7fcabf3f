"""Interruption webhooks: a real HTTP receiver on loopback gets signed, retried POSTs of each
`utterance.interrupted`, while the audio path never waits for it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from clients.client import Interrupted, connect
from gateway.webhooks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SECRET_ENV,
    SIGNATURE_HEADER,
    RetryPolicy,
    WebhookSender,
    sign,
    verify,
)
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory, RunningGateway
from tests.integration.wsclient import Client
from tests.integration.wsclient import connect as ws_connect

SECRET = "test-secret-123"
TEXT = "one two three four five six seven eight nine ten eleven twelve"
FAST = RetryPolicy(attempts=4, first_delay_s=0.1, factor=2.0, max_delay_s=1.0, jitter=0.0, timeout_s=2.0)


@dataclass
class Delivery:
    at: float
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.body)  # type: ignore[no-any-return]


@dataclass
class Receiver:
    """Answers each POST with the next status of `script` (then 200), after `delay_s`."""

    url: str = ""
    script: list[int] = field(default_factory=list)
    delay_s: float = 0.0
    got: list[Delivery] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)

    def wait(self, count: int, timeout_s: float = 10.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.got)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            state.got.append(Delivery(time.monotonic(), dict(self.headers.items()), body))
            if state.delay_s:
                time.sleep(state.delay_s)
            status = state.script.pop(0) if state.script else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/cadence"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def hooked_gateway(gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> RunningGateway:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    running = gateway_factory(FakeEngine(step_s=0.01))
    running.server.gateway.webhooks.policy = FAST
    return running


async def _interrupt_after_words(c: Client, uid: str, words: int) -> dict[str, Any]:
    await c.send(type="speak.append", utterance_id=uid, text=TEXT, flush=True)
    while len(c.got.words_of(uid)) < words:
        await c.next()
    played = c.got.words_of(uid)[words - 1]["end_ms"]
    while sum(len(payload) for _, payload in c.got.packets) < played * 48:  # s16le at 24 kHz: 48 B/ms
        await c.next()
    await c.send(type="speak.cancel", utterance_id=uid, played_ms=played)
    return await c.until("utterance.interrupted", uid)


async def test_interruption_is_posted_signed(hooked_gateway: RunningGateway, receiver: Receiver) -> None:
    async with ws_connect(hooked_gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", webhook_url=receiver.url)
        started = await c.until("session.started")
        interrupted = await _interrupt_after_words(c, "u1", 3)
        await c.send(type="speak.cancel", utterance_id="u1")  # a repeat: the same answer, no second POST
        await c.until("utterance.interrupted", "u1")
    [delivery] = receiver.wait(1)
    await asyncio.sleep(0.3)
    assert len(receiver.got) == 1
    assert delivery.headers[EVENT_HEADER] == "utterance.interrupted"
    assert verify(SECRET, delivery.headers[SIGNATURE_HEADER], delivery.body)
    assert not verify("another-secret", delivery.headers[SIGNATURE_HEADER], delivery.body)
    assert not verify(SECRET, delivery.headers[SIGNATURE_HEADER], delivery.body + b" ")
    payload = delivery.json
    assert payload["session_id"] == started["session_id"]
    assert {k: payload[k] for k in interrupted} == interrupted
    assert payload["last_word"]["text"] == "three" and payload["spoken_text"] == "one two three"


async def test_failed_deliveries_are_retried_with_backoff(
    hooked_gateway: RunningGateway, receiver: Receiver
) -> None:
    receiver.script = [503, 500]
    async with ws_connect(hooked_gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", webhook_url=receiver.url)
        await _interrupt_after_words(c, "u1", 2)
    deliveries = receiver.wait(3)
    assert len(deliveries) == 3
    assert len({d.headers[DELIVERY_HEADER] for d in deliveries}) == 1  # one delivery id over retries
    assert all(verify(SECRET, d.headers[SIGNATURE_HEADER], d.body) for d in deliveries)
    gaps = [b.at - a.at for a, b in zip(deliveries, deliveries[1:], strict=False)]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[1] > gaps[0]
    await asyncio.sleep(0.2)
    stats = hooked_gateway.server.gateway.webhooks.stats
    assert stats.delivered == 1 and stats.attempts == 3 and stats.failed == 0


async def test_a_refusal_is_not_retried(hooked_gateway: RunningGateway, receiver: Receiver) -> None:
    receiver.script = [400]
    async with ws_connect(hooked_gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", webhook_url=receiver.url)
        await _interrupt_after_words(c, "u1", 2)
    receiver.wait(1)
    await asyncio.sleep(0.5)
    assert len(receiver.got) == 1
    assert hooked_gateway.server.gateway.webhooks.stats.failed == 1


async def test_a_slow_receiver_never_holds_up_audio(
    hooked_gateway: RunningGateway, receiver: Receiver
) -> None:
    receiver.delay_s = 1.5
    async with ws_connect(hooked_gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", webhook_url=receiver.url)
        await c.until("session.started")
        t0 = time.monotonic()
        await _interrupt_after_words(c, "u1", 2)
        fence_s = time.monotonic() - t0
        await c.send(type="speak.append", utterance_id="u2", text="after the cut", flush=True)
        await c.send(type="speak.end", utterance_id="u2")
        await c.until("utterance.done", "u2")
        second_s = time.monotonic() - t0
    assert receiver.wait(1)
    assert fence_s < 1.0 and second_s < 1.4  # the receiver was still sleeping on the first POST


async def test_python_client_on_interrupt(hooked_gateway: RunningGateway, receiver: Receiver) -> None:
    seen: list[Interrupted] = []
    async with connect(hooked_gateway.ws, on_interrupt=seen.append, webhook_url=receiver.url) as session:
        await session.append("u1", TEXT, flush=True)
        events = session.events("u1")
        async for event in events:
            if getattr(event, "words", None):
                await session.interrupt("u1", played_ms=0)
            if isinstance(event, Interrupted):
                break
    [delivery] = receiver.wait(1)
    assert len(seen) == 1 and seen[0].utterance_id == "u1"
    assert delivery.json["utterance_id"] == "u1" and delivery.json["played_ms"] == seen[0].played_ms


async def test_without_a_secret_the_url_is_refused(
    gateway_factory: GatewayFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    running = gateway_factory(FakeEngine(step_s=0.01))
    async with ws_connect(running.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", webhook_url=receiver.url)
        await c.until("session.started")
        error = await c.until("error")
        assert "webhook" in error["message"]
        await _interrupt_after_words(c, "u1", 1)
    await asyncio.sleep(0.3)
    assert receiver.got == []


async def test_a_bad_url_is_an_invalid_message(gateway: RunningGateway) -> None:
    async with ws_connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", webhook_url="ftp://example.com/x")
        error = await c.until("error")
        assert error["code"] == "invalid_message" and "webhook_url" in error["message"]


def test_signature_rejects_stale_and_malformed_headers() -> None:
    body = b'{"a":1}'
    header = sign(SECRET, 1_000_000, body)
    assert verify(SECRET, header, body, now=1_000_100)
    assert not verify(SECRET, header, body, now=1_000_000 + 301)
    assert not verify(SECRET, "v1=abc", body) and not verify(SECRET, "t=x,v1=abc", body)


def test_backoff_grows_and_honours_retry_after() -> None:
    policy = RetryPolicy(first_delay_s=0.5, factor=2.0, max_delay_s=4.0, jitter=0.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert policy.delay(1, retry_after_s=3.0) == 3.0 and policy.delay(1, retry_after_s=60.0) == 4.0


async def test_sender_drops_beyond_its_bound() -> None:
    sender = WebhookSender(SECRET, FAST, max_in_flight=2)
    tasks = [sender.submit("http://127.0.0.1:9/", "x", {"n": n}) for n in range(3)]
    assert tasks[2] is None and sender.stats.dropped == 1 and sender.in_flight == 2
    await sender.close(grace_s=0.0)
    assert sender.in_flight == 0


async def test_building_the_http_client_never_stalls_the_loop(receiver: Receiver) -> None:
    import httpx

    def slow_factory() -> httpx.AsyncClient:
        time.sleep(0.3)  # like loading a TLS trust store
        return httpx.AsyncClient()

    sender = WebhookSender(SECRET, FAST, client_factory=slow_factory)
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    task = sender.submit(receiver.url, "x", {"n": 1})
    last = loop.time()
    while task is not None and not task.done():
        await asyncio.sleep(0.005)
        gaps.append(loop.time() - last)
        last = loop.time()
    assert task is not None and task.result() is True
    assert max(gaps) < 0.1
    await sender.close()
