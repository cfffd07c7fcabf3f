"""Webhook deliveries on /metrics, over real uvicorn on loopback: each one delivered, failed (a final
refusal) or dropped (too many in flight) is counted under a fixed `outcome` label, with the POST
attempts beside them, so a scrape sees what the process's own WebhookStats see."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.webhooks import SECRET_ENV, RetryPolicy
from tests.fakes import FakeEngine
from tests.gateway.test_webhook_receiver_faults import receiver
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client
from tests.integration.wsclient import connect as ws_connect

pytestmark = pytest.mark.timeout(60)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_delivered_failed_and_dropped_webhooks_are_counted_on_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def ok_then_refuse(n: int, writer: asyncio.StreamWriter) -> None:
        status = b"200 OK" if n == 1 else b"400 Nope"  # 400 is final: the delivery fails
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    monkeypatch.setenv(SECRET_ENV, "metrics-secret")
    async with receiver(ok_then_refuse) as (url, got):
        with run_gateway(FakeEngine(step_s=0.01), GatewayConfig()) as gw:
            sender = gw.server.gateway.webhooks
            sender.policy = RetryPolicy(attempts=3, first_delay_s=0.05, jitter=0.0)

            async def settled() -> None:
                deadline = time.monotonic() + 5
                while sender.in_flight:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)

            async with ws_connect(gw.ws) as ws:
                c = Client(ws)
                await c.send(type="session.start", webhook_url=url)
                await c.until("session.started")
                for uid in ("u1", "u2", "u3"):
                    if uid == "u3":
                        sender.max_in_flight = 0  # no room: the delivery is dropped
                    await c.send(type="speak.append", utterance_id=uid, text="one two three " * 5, flush=True)
                    await c.until("utterance.started", uid)
                    await c.send(type="speak.cancel", utterance_id=uid, played_ms=0)
                    await c.until("utterance.interrupted", uid)
                    await asyncio.sleep(0.05)
                    await settled()
            async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
                page = await http.get("/metrics")
    assert page.status_code == 200
    assert len(got) == 2
    samples = _samples(page.text)
    for outcome in ("delivered", "failed", "dropped"):
        key = ("cadence_webhook_deliveries_total", (("outcome", outcome),))
        assert samples.get(key) == 1.0, (outcome, {k: v for k, v in samples.items() if "webhook" in k[0]})
    assert samples.get(("cadence_webhook_attempts_total", ())) == 2.0


async def test_webhook_counters_are_on_metrics_before_any_delivery() -> None:
    """Zero from the start, so a rate over them has a baseline."""
    with run_gateway(FakeEngine(), GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            page = await http.get("/metrics")
    samples = _samples(page.text)
    for outcome in ("delivered", "failed", "dropped"):
        assert samples.get(("cadence_webhook_deliveries_total", (("outcome", outcome),))) == 0.0
