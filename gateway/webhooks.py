"""Interruption webhooks: each `utterance.interrupted` POSTed to the session's `webhook_url`.

Deliveries are signed (HMAC-SHA256, Stripe-style `t=<unix>,v1=<hex>` over `"<t>." + body`), retried
with exponential backoff on network errors, 408, 425, 429 and 5xx (a `Retry-After` is honoured up to
the largest delay), and run as their own tasks: `submit()` never waits, so the audio path is never
held up by a slow or dead receiver. Each delivery keeps one id (`Cadence-Delivery`) over its
retries, so a receiver can drop duplicates. See docs/twilio.md ("Interruption webhooks").
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import hmac
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC
from typing import Any, Final

import httpx

from gateway.protocol import Action, SendControl
from gateway.session import Session

log = logging.getLogger("cadence.webhooks")

SIGNATURE_HEADER: Final = "Cadence-Signature"
DELIVERY_HEADER: Final = "Cadence-Delivery"
EVENT_HEADER: Final = "Cadence-Event"
SECRET_ENV: Final = "CADENCE_WEBHOOK_SECRET"
RETRY_STATUSES: Final = frozenset({408, 425, 429})


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp` (unix seconds)."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance_s: float = 300.0, now: float | None = None
) -> bool:
    """Whether `header` signs `body` with `secret` and is no older than `tolerance_s` (receivers)."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        fields.setdefault(key, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body).split("v1=", 1)[1]
    return any(hmac.compare_digest(expected, given) for given in fields.get("v1", []))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 6  # in all, the first included
    first_delay_s: float = 0.5
    factor: float = 2.0
    max_delay_s: float = 30.0
    jitter: float = 0.1  # +- this fraction of each delay
    timeout_s: float = 5.0  # per attempt

    def delay(self, retry: int, retry_after_s: float | None = None) -> float:
        """Seconds before retry number `retry` (1 = the first retry)."""
        base = min(self.max_delay_s, self.first_delay_s * self.factor ** (retry - 1))
        delay = base * (1.0 + random.uniform(-self.jitter, self.jitter))
        if retry_after_s is not None:  # the receiver's wish is a lower bound: jitter only adds to it
            delay = max(delay, retry_after_s)
        return max(0.0, min(self.max_delay_s, delay))


@dataclass(slots=True)
class WebhookStats:
    submitted: int = 0
    delivered: int = 0
    failed: int = 0  # gave up (permanent refusal or out of attempts)
    dropped: int = 0  # too many deliveries in flight
    attempts: int = 0


class WebhookSender:
    """Signed, retried, fire-and-forget POSTs. Create and use it on the gateway's event loop."""

    def __init__(
        self,
        secret: str | None,
        policy: RetryPolicy | None = None,
        max_in_flight: int = 1000,
        client_factory: Callable[[], httpx.AsyncClient] | None = None,
    ) -> None:
        self.secret = secret or None
        self.policy = policy or RetryPolicy()
        self.max_in_flight = max_in_flight
        self.stats = WebhookStats()
        # a connection for every delivery in flight: with httpx's default pool (100), deliveries
        # stuck on one dead receiver would hold every connection and starve the healthy ones
        limits = httpx.Limits(max_connections=max_in_flight)
        self._client_factory = client_factory or (
            lambda: httpx.AsyncClient(follow_redirects=False, limits=limits)
        )
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[bool]] = set()
        self._client_lock: asyncio.Lock | None = None

    @classmethod
    def from_env(cls, policy: RetryPolicy | None = None) -> WebhookSender:
        """The signing secret from CADENCE_WEBHOOK_SECRET (webhooks are off without one)."""
        return cls(os.environ.get(SECRET_ENV), policy)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def submit(self, url: str, event: str, payload: Mapping[str, Any]) -> asyncio.Task[bool] | None:
        """Start delivering `payload` to `url`; returns at once (None when dropped or disabled)."""
        if self.secret is None:
            return None
        self.stats.submitted += 1
        if len(self._tasks) >= self.max_in_flight:
            self.stats.dropped += 1
            log.warning("webhook to %s dropped: %d deliveries in flight", url, len(self._tasks))
            return None
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        task = asyncio.get_running_loop().create_task(self._deliver(url, event, body, uuid.uuid4().hex))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _deliver(self, url: str, event: str, body: bytes, delivery_id: str) -> bool:
        assert self.secret is not None
        client = await self._http()
        for attempt in range(1, self.policy.attempts + 1):
            headers = {
                "Content-Type": "application/json",
                EVENT_HEADER: event,
                DELIVERY_HEADER: delivery_id,
                SIGNATURE_HEADER: sign(self.secret, int(time.time()), body),
                "User-Agent": "cadence-webhooks/1",
            }
            self.stats.attempts += 1
            retry_after: float | None = None
            try:
                # httpx's timeout bounds each read or write, not the attempt: a receiver that
                # trickles its answer would hold the delivery (and its place in flight) for good.
                # The status line is the answer; the body is never read: a slow or endless one
                # must not turn a delivered event into a timeout (and a duplicate), nor fill memory
                async with asyncio.timeout(self.policy.timeout_s):
                    async with client.stream(
                        "POST", url, content=body, headers=headers, timeout=self.policy.timeout_s
                    ) as response:
                        status, retry_after = response.status_code, _retry_after(response)
            except httpx.InvalidURL as exc:  # no attempt can reach it
                log.warning("webhook %s to %s: %s", delivery_id, url, exc)
                break
            except (httpx.HTTPError, TimeoutError) as exc:
                log.info(
                    "webhook %s to %s, attempt %d: %s", delivery_id, url, attempt, str(exc) or "timed out"
                )
            else:
                if 200 <= status < 300:
                    self.stats.delivered += 1
                    return True
                if status < 500 and status not in RETRY_STATUSES:
                    log.warning("webhook %s refused by %s with %d", delivery_id, url, status)
                    break
            if attempt < self.policy.attempts:
                await asyncio.sleep(self.policy.delay(attempt, retry_after))
        self.stats.failed += 1
        return False

    async def _http(self) -> httpx.AsyncClient:
        """The shared client, built in a worker thread: loading the TLS trust store takes a good part
        of a second, which must not stall the event loop that carries the audio."""
        if self._client is None:
            if self._client_lock is None:
                self._client_lock = asyncio.Lock()
            async with self._client_lock:
                if self._client is None:
                    self._client = await asyncio.to_thread(self._client_factory)
        return self._client

    async def close(self, grace_s: float = 1.0) -> None:
        """Let deliveries in flight finish for `grace_s`, cancel the rest, close the HTTP client."""
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from now that `Retry-After` asks for: delay-seconds or an HTTP-date (RFC 9110)."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - time.time())


def interruption_payload(message: Mapping[str, Any], session_id: str, **extra: Any) -> dict[str, Any]:
    """The webhook body: the `utterance.interrupted` message, plus which session it came from."""
    return {**message, "session_id": session_id, "created_at": round(time.time(), 3), **extra}


class WebhookSession(Session):
    """A `/v1/stream` session that also POSTs each interruption to its `webhook_url`."""

    def __init__(self, *args: Any, webhooks: WebhookSender, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.webhooks = webhooks
        self._notified: set[str] = set()

    def _execute(self, actions: list[Action]) -> None:
        if self.protocol.webhook_url is None:  # nothing to notify (the per-packet path stays lean)
            super()._execute(actions)
            return
        out: list[Action] = []
        for action in actions:
            out.append(action)
            if not isinstance(action, SendControl):
                continue
            kind = action.message["type"]
            if kind == "utterance.interrupted":
                self._notify(action.message)
            elif kind == "session.started" and self.protocol.webhook_url and not self.webhooks.enabled:
                out.append(
                    SendControl(
                        {
                            "type": "error",
                            "code": "invalid_message",
                            "message": "webhook_url: this server has no webhook signing secret; no webhooks will be sent",
                        }
                    )
                )
        super()._execute(out)

    def _notify(self, message: Mapping[str, Any]) -> None:
        url = self.protocol.webhook_url
        uid = str(message.get("utterance_id"))
        if url is None or uid in self._notified:
            return  # a repeated cancel answers the same message again: delivered once
        self._notified.add(uid)
        self.webhooks.submit(url, "utterance.interrupted", interruption_payload(message, self.session_id))
