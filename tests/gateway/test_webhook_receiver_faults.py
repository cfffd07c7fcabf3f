"""Webhook receivers that misbehave, over real loopback sockets: an answer whose body never ends,
many deliveries stuck on one dead receiver while another is healthy, a `Retry-After` in either of
its forms; and the signature checked by a verifier written from docs/twilio.md alone."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from email.utils import formatdate

import pytest

from gateway.config import GatewayConfig
from gateway.webhooks import DELIVERY_HEADER, SECRET_ENV, SIGNATURE_HEADER, RetryPolicy, WebhookSender
from tests.fakes import FakeEngine
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client
from tests.integration.wsclient import connect as ws_connect

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-ünïcode"

Request = tuple[float, dict[str, str], bytes]  # (arrived at, headers, body)
Answer = Callable[[int, asyncio.StreamWriter], Awaitable[None]]  # (request number, writer)


@asynccontextmanager
async def receiver(answer: Answer) -> AsyncIterator[tuple[str, list[Request]]]:
    """A raw HTTP/1.1 receiver on loopback: reads each POST whole, then lets `answer` reply."""
    got: list[Request] = []
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")[1:]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            got.append((time.monotonic(), headers, body))
            await answer(len(got), writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            handlers.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/hooks", got
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await server.wait_closed()


async def _hold_open(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(60)


def _docs_verify(secret: str, header: str, body: bytes, now: float, tolerance_s: float = 300) -> bool:
    """docs/twilio.md: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>`."""
    fields = dict(part.split("=", 1) for part in header.split(","))
    t = int(fields["t"])
    mac = hmac.new(secret.encode("utf-8"), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return abs(now - t) <= tolerance_s and hmac.compare_digest(mac, fields["v1"])


async def test_an_answer_whose_body_never_ends_is_delivered_once() -> None:
    """The status line is the receiver's answer: a 200 whose body is slow (or endless) is a
    delivery, not a timeout to retry (the receiver has the event already: a retry duplicates it)."""

    async def ok_then_stall(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 100)
        await writer.drain()
        await _hold_open(writer)

    async with receiver(ok_then_stall) as (url, got):
        policy = RetryPolicy(attempts=3, first_delay_s=0.05, jitter=0.0, timeout_s=1.0)
        sender = WebhookSender(SECRET, policy)
        try:
            started = time.monotonic()
            task = sender.submit(url, "utterance.interrupted", {"n": 1})
            assert task is not None
            delivered = await asyncio.wait_for(task, 10)
            took = time.monotonic() - started
            assert delivered is True and len(got) == 1, (delivered, len(got))
            assert took < 0.8, took
            assert sender.stats.delivered == 1 and sender.stats.failed == 0 and sender.in_flight == 0
        finally:
            await sender.close(grace_s=0.0)


async def test_a_dead_receiver_does_not_starve_deliveries_to_a_healthy_one() -> None:
    """Deliveries to one receiver that never answers each hold a connection for their whole
    timeout; another session's receiver still gets its POST at once."""

    async def never(n: int, writer: asyncio.StreamWriter) -> None:
        await _hold_open(writer)

    async def ok(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with receiver(never) as (dead_url, stuck), receiver(ok) as (good_url, good):
        sender = WebhookSender(SECRET, RetryPolicy(attempts=1, jitter=0.0, timeout_s=3.0))
        try:
            for n in range(150):
                sender.submit(dead_url, "utterance.interrupted", {"n": n})
            deadline = time.monotonic() + 5
            while len(stuck) < 100:  # the stuck POSTs hold their connections now
                assert time.monotonic() < deadline, len(stuck)
                await asyncio.sleep(0.01)
            started = time.monotonic()
            task = sender.submit(good_url, "utterance.interrupted", {"n": "healthy"})
            assert task is not None
            delivered = await asyncio.wait_for(task, 10)
            took = time.monotonic() - started
            assert delivered is True and len(good) == 1
            assert took < 1.0, took
        finally:
            await sender.close(grace_s=0.0)


def test_jitter_never_shortens_a_retry_after_nor_passes_the_largest_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = RetryPolicy(first_delay_s=0.5, factor=2.0, max_delay_s=30.0, jitter=0.1)
    monkeypatch.setattr(random, "uniform", lambda a, b: a)  # the shortest draw
    assert policy.delay(1, retry_after_s=2.0) >= 2.0
    monkeypatch.setattr(random, "uniform", lambda a, b: b)  # the longest draw
    assert policy.delay(1, retry_after_s=120.0) <= 30.0
    assert policy.delay(10) <= 30.0


async def test_a_retry_after_http_date_is_honoured() -> None:
    """RFC 9110 allows `Retry-After` as a date as well as seconds."""

    async def busy_then_ok(n: int, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            when = formatdate(time.time() + 2, usegmt=True)  # whole seconds: 1 to 2 s from now
            writer.write(f"HTTP/1.1 503 Busy\r\nRetry-After: {when}\r\nContent-Length: 0\r\n\r\n".encode())
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async with receiver(busy_then_ok) as (url, got):
        sender = WebhookSender(SECRET, RetryPolicy(attempts=3, first_delay_s=0.05, jitter=0.0))
        try:
            task = sender.submit(url, "utterance.interrupted", {"n": 1})
            assert task is not None
            assert await asyncio.wait_for(task, 10) is True
            assert len(got) == 2
            assert got[1][0] - got[0][0] >= 0.9, got[1][0] - got[0][0]
        finally:
            await sender.close(grace_s=0.0)


async def test_the_signature_verifies_as_documented_over_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's interruption, non-ASCII text included, POSTed by real uvicorn to a receiver that
    fails once: both attempts verify with the documented computation on the raw body, under one
    delivery id."""

    async def fail_then_ok(n: int, writer: asyncio.StreamWriter) -> None:
        status = b"500 Oops" if n == 1 else b"200 OK"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    monkeypatch.setenv(SECRET_ENV, SECRET)
    async with receiver(fail_then_ok) as (url, got):
        with run_gateway(FakeEngine(step_s=0.01), GatewayConfig()) as gw:
            gw.server.gateway.webhooks.policy = RetryPolicy(attempts=3, first_delay_s=0.05, jitter=0.0)
            async with ws_connect(gw.ws) as ws:
                c = Client(ws)
                await c.send(type="session.start", webhook_url=url)
                await c.until("session.started")
                await c.send(type="speak.append", utterance_id="ü1", text="grüße aus köln " * 5, flush=True)
                await c.until("utterance.started", "ü1")
                await c.send(type="speak.cancel", utterance_id="ü1", played_ms=0)
                await c.until("utterance.interrupted", "ü1")
            deadline = time.monotonic() + 5
            while len(got) < 2:
                assert time.monotonic() < deadline, len(got)
                await asyncio.sleep(0.02)
    assert {h[DELIVERY_HEADER.lower()] for _, h, _ in got} == {got[0][1][DELIVERY_HEADER.lower()]}
    for _, headers, body in got:
        assert "ü1".encode() in body
        assert _docs_verify(SECRET, headers[SIGNATURE_HEADER.lower()], body, time.time())
        assert not _docs_verify("other", headers[SIGNATURE_HEADER.lower()], body, time.time())
