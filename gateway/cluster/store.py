"""The shared store (Redis) behind a circuit breaker, so that a store which hangs or goes away
never stalls a stream.

Every command goes through the breaker (`GuardedRedis.execute_command`, or `Store.call` for a
pipeline). While the breaker is closed a command has `COMMAND_TIMEOUT_S` to answer; a command that
cannot reach the store, or takes longer, opens it. While it is open every command fails at once
with `StoreUnavailable`, without touching the network, and a probe (`PING`, every `PROBE_S`)
closes it again as soon as the store answers; `on_recovery` callbacks then re-assert what this
replica holds (its sessions, utterances, calls and voices). The probe also runs while the breaker
is closed, so a store that hangs without a command in flight is noticed within a probe period
and a timeout.

Each transition is logged once (not once per failed command), `cadence_store_breaker_state` says
where the breaker is (0 closed, 1 open), and `Store.state()` is what `/readyz` shows.

A task cancelled while it sends a command ends, whenever the cancellation lands: see
`delivering_cancellation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("cadence.redis")

COMMAND_TIMEOUT_S: Final = 0.5  # a command slower than this counts as the store being unreachable
PROBE_S: Final = 0.25

T = TypeVar("T")

# a longer deadline for the commands in its scope (a voice's clip is a large write)
_patience: contextvars.ContextVar[float | None] = contextvars.ContextVar("store_patience", default=None)


class StoreUnavailable(ConnectionError):
    """The shared store cannot be used now: the breaker is open, or this command failed."""


@contextlib.contextmanager
def delivering_cancellation() -> Iterator[None]:
    """Raise CancelledError on leaving the block when the task was cancelled within it and the
    block returned (or failed otherwise) instead. redis-py writes each command inside
    asyncio.wait_for, and Python 3.11's wait_for returns the write's result when a cancellation
    lands as the write finishes, leaving it undelivered: a background loop cancelled at that moment
    (a shutdown, more often on a loaded machine) would otherwise run on for good."""
    task = asyncio.current_task()
    requested = task.cancelling() if task is not None else 0
    try:
        yield
    except Exception as exc:
        if task is not None and task.cancelling() > requested:
            raise asyncio.CancelledError from exc
        raise
    if task is not None and task.cancelling() > requested:
        raise asyncio.CancelledError


def is_outage(exc: BaseException) -> bool:
    """A failure of the store itself (unreachable, too slow, still loading its data: a
    ConnectionError), not of one command (a ResponseError, bad input)."""
    return isinstance(exc, ConnectionError | RedisTimeoutError | OSError | TimeoutError)


class Store:
    def __init__(
        self,
        url: str,
        registry: CollectorRegistry | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
        probe_s: float = PROBE_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self.client = GuardedRedis.connect(url, self)
        self.up = True  # the breaker is closed: commands go to the store
        self.reason: str | None = None
        self.changed_at = time.monotonic()
        self._up_event = asyncio.Event()
        self._up_event.set()
        self._down_event = asyncio.Event()
        self._recovery: list[Callable[[], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.breaker_state = Gauge(
            "cadence_store_breaker_state",
            "The shared store's circuit breaker: 0 closed (the store answers), "
            "1 open (unreachable: degraded mode, each replica on its own)",
            registry=registry,
        )
        self.outages = Counter(
            "cadence_store_outages", "Times the shared store's breaker opened", registry=registry
        )

    # -- the breaker ----------------------------------------------------------------------------
    def check(self) -> None:
        if not self.up:
            raise StoreUnavailable(f"the shared store is unreachable ({self.reason})")

    def trip(self, exc: BaseException) -> None:
        """Open the breaker (once per outage: later failures add nothing)."""
        if not self.up:
            return
        self.up, self.reason, self.changed_at = False, describe(exc), time.monotonic()
        self._up_event.clear()
        self._down_event.set()
        self.breaker_state.set(1)
        self.outages.inc()
        log.error(
            "shared store unreachable (%s): degraded mode: streaming goes on, each replica enforces "
            "the quotas on its own, cross-replica operations answer 503 until the store is back",
            self.reason,
        )

    def _close(self) -> None:
        if self.up:
            return
        down_s = time.monotonic() - self.changed_at
        self.up, self.reason, self.changed_at = True, None, time.monotonic()
        self._up_event.set()
        self._down_event.clear()
        self.breaker_state.set(0)
        log.warning("shared store reachable again after %.1f s: re-asserting this replica's state", down_s)
        for callback in self._recovery:
            self.spawn(callback())

    def on_recovery(self, callback: Callable[[], Awaitable[None]]) -> None:
        """`callback()` runs (as a task of its own) each time the store comes back."""
        self._recovery.append(callback)

    async def wait_up(self) -> None:
        await self._up_event.wait()

    def state(self) -> dict[str, Any]:
        """For /readyz: the store's state, and for how long it has been down."""
        if self.up:
            return {"state": "up", "breaker": "closed"}
        return {
            "state": "degraded",
            "breaker": "open",
            "reason": self.reason,
            "down_for_s": round(time.monotonic() - self.changed_at, 1),
            "effects": "streaming goes on; quotas are enforced by each replica on its own; "
            "cross-replica operations answer 503",
        }

    # -- guarded calls ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def patient(self, timeout_s: float) -> Iterator[None]:
        """Commands in this scope may take up to `timeout_s` (large values)."""
        token = _patience.set(timeout_s)
        try:
            yield
        finally:
            _patience.reset(token)

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """`operation()` (Redis commands) through the breaker, within the command deadline."""
        self.check()
        patience = _patience.get()
        # outside the deadline's scope, which takes back its own cancellation on leaving
        with delivering_cancellation():
            try:
                async with asyncio.timeout(patience or self.timeout_s):
                    if patience is None:
                        return await operation()
                    return await self._unless_tripped(operation)
            except StoreUnavailable:
                raise  # the breaker opened meanwhile (_unless_tripped), and said so
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.trip(exc)
                raise StoreUnavailable(f"the shared store is unreachable ({describe(exc)})") from exc

    async def execute(self, pipe: Pipeline) -> list[Any]:
        """A pipeline's commands through the breaker; the pipeline is released either way."""
        try:
            return await self.call(pipe.execute)
        finally:
            await pipe.reset()  # type: ignore[no-untyped-call]

    async def _unless_tripped(self, operation: Callable[[], Awaitable[T]]) -> T:
        """A long operation gives up as soon as the breaker opens (another command found the
        store gone), not at the end of its own deadline."""

        async def run() -> T:
            return await operation()

        work = asyncio.ensure_future(run())
        tripped = asyncio.ensure_future(self._down_event.wait())
        try:
            await asyncio.wait((work, tripped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tripped.cancel()
            if not work.done():
                # it ends on a later pass of the loop: its outcome is of no use by then
                work.cancel()
                work.add_done_callback(_dropped)
        if not work.done():
            raise StoreUnavailable(f"the shared store is unreachable ({self.reason})")
        return work.result()

    async def probe(self) -> bool:
        """One PING past the breaker: True (and the breaker closed) when the store answers."""
        try:
            with delivering_cancellation():
                async with asyncio.timeout(self.timeout_s):
                    await self.client.unguarded("PING")
        except Exception as exc:
            # an error instead of PONG (BUSY: a long script; MASTERDOWN) is a store that cannot
            # serve either, and must not end the watch that closes the breaker once it can
            self.trip(exc)
            return False
        if not self.up:
            # idle connections from before the outage may lead to a store that is gone (a restart):
            # commands after the recovery get new ones
            await self.client.connection_pool.disconnect(inuse_connections=False)
        self._close()
        return True

    async def watch(self) -> None:
        """Probe the store every `probe_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.probe_s)
            await self.probe()

    def spawn(self, coro: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await coro
            except StoreUnavailable:
                pass  # the breaker said so already; the next recovery runs it again
            except Exception:
                log.exception("shared store task failed")

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.client.aclose()


def _dropped(task: asyncio.Future[Any]) -> None:
    """Reads the outcome of a command given up on, so that asyncio does not report it as lost."""
    if not task.cancelled():
        task.exception()


def describe(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    if isinstance(exc, TimeoutError) and not str(exc):
        text = "no answer in time"
    return text[:200]


class GuardedRedis(aioredis.Redis):
    """redis-py's asyncio client with every command passed through the store's breaker."""

    store: Store

    @classmethod
    def connect(cls, url: str, store: Store) -> GuardedRedis:
        client = cls.from_url(
            url,
            socket_timeout=store.timeout_s,
            socket_connect_timeout=store.timeout_s,
            retry=Retry(NoBackoff(), 0),  # the breaker decides when to try again
        )
        assert isinstance(client, GuardedRedis)
        client.store = store
        return client

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        return await self.store.call(lambda: self.unguarded(*args, **options))

    async def unguarded(self, *args: Any, **options: Any) -> Any:
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
