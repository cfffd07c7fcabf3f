"""The cluster's background work outlives the store's faults, in this process against a real
redis-server on loopback: the pub/sub listener survives a store that answers its SUBSCRIBE with an
error, a link's pinger survives a failed PUBLISH, the FLAC codec of a voice's clip runs off the
event loop, characters spent while a quota write fails reach the shared budget later, and each
background loop ends when cancelled, even as a command's write finishes (a shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
import soundfile as sf

from gateway.cluster.calls import LINK_DEAD_S, LINK_PING_S, CallRouter, _Link
from gateway.cluster.pubsub import listen_forever
from gateway.cluster.quotas import SharedQuotas
from gateway.cluster.store import Store, StoreUnavailable
from gateway.cluster.voices import SharedVoiceRegistry, voice_from_redis, voice_to_redis
from gateway.config import GatewayConfig
from gateway.quotas import QuotaLimits
from gateway.voices import Voice
from tests.fakes import FakeEngine
from tests.gateway.cluster.harness import Cluster, endless_script, redis_cli, tools_available

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]

BUSY_REPLY_MS = 100  # Redis answers BUSY once a script has run this long


@pytest.fixture
async def store(redis_server: Cluster) -> AsyncIterator[Store]:
    made = Store(redis_server.redis_url, probe_s=0.05)
    watcher = asyncio.create_task(made.watch())
    yield made
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await made.close()


async def stop_redis(server: Cluster, store: Store) -> None:
    """Stop the store (the caller starts it again, empty, on the same port); the breaker opens."""
    await asyncio.to_thread(server.stop_redis)
    assert not await store.probe()


async def test_the_listener_outlives_a_subscribe_answered_with_busy(redis_server: Cluster) -> None:
    """A SUBSCRIBE reaches a store that a long script keeps busy (the breaker closed on an answer
    from just before): the BUSY error is no outage of the connection, yet the listener must wait
    and subscribe again, not end, so cross-replica messages flow once the script ends."""
    store = Store(redis_server.redis_url, probe_s=0.05)  # no watcher yet: the breaker stays closed
    raw = aioredis.Redis.from_url(redis_server.redis_url)
    received: list[bytes] = []
    listener: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    try:
        async with endless_script(redis_server, BUSY_REPLY_MS):
            for _ in range(100):
                if "BUSY" in (await asyncio.to_thread(redis_cli, redis_server, "ping")).stdout:
                    break
            else:
                pytest.fail("the script did not make the store answer BUSY")
            listener = asyncio.create_task(
                listen_forever(
                    store, ["chan"], lambda _channel, data: received.append(data), asyncio.Event(), "test"
                )
            )
            await asyncio.sleep(0.5)  # a few SUBSCRIBEs answered with BUSY
            assert not listener.done(), listener.exception()
            watcher = asyncio.create_task(store.watch())
            killed = await asyncio.to_thread(redis_cli, redis_server, "script", "kill")
            assert killed.stdout.strip() == "OK"
            async with asyncio.timeout(5):
                while not received:
                    await raw.publish("chan", b"hello")
                    await asyncio.sleep(0.05)
            assert received[0] == b"hello" and not listener.done()
    finally:
        for task in (listener, watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await raw.aclose()
        await store.close()


async def test_a_link_pinger_outlives_a_failed_publish(redis_server: Cluster, store: Store) -> None:
    """The store goes away for a moment: the pings published meanwhile fail, and the pinger goes
    on, so the peer hears it again within LINK_DEAD_S of the store's return."""
    router = CallRouter(store, "r1", SimpleNamespace(), "cadence:")  # type: ignore[arg-type]
    pinger = asyncio.create_task(router._ping("l1", _Link("r2")))

    async def a_ping_arrives() -> bool:
        raw = aioredis.Redis.from_url(redis_server.redis_url)
        pubsub = raw.pubsub()
        try:
            await pubsub.subscribe(router.channel_of("r2"))
            async with asyncio.timeout(LINK_DEAD_S):
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
                    if message is not None:
                        return b'"ping"' in message["data"]
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
            await raw.aclose()

    try:
        assert await a_ping_arrives()
        await stop_redis(redis_server, store)
        assert not store.up
        await asyncio.sleep(LINK_PING_S * 1.5)  # at least one ping while the store is away
        assert not pinger.done(), pinger.exception()
        await asyncio.to_thread(redis_server.start_redis, False)
        await asyncio.wait_for(store.wait_up(), 5)
        assert await a_ping_arrives()
    finally:
        pinger.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pinger


def long_clip(rate: int = 48_000, seconds: float = 30.0) -> Voice:
    """A voice with the longest clip a registration takes, at a common recording rate, with enough
    noise in it that FLAC cannot make it small (a few megabytes, as a real recording)."""
    rng = np.random.default_rng(7)
    t = np.arange(int(rate * seconds)) / rate
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * rng.standard_normal(t.size)).clip(-1, 1)
    return Voice("v_0000000000000000", "long", "k", "text", rate, audio.astype(np.float32), time.time())


async def loop_stall(operation: Callable[[], Awaitable[Any]], tick_s: float = 0.002) -> float:
    """The longest a timer on the event loop fired late while `operation()` ran."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        while not done:
            due = loop.time() + tick_s
            await asyncio.sleep(tick_s)
            worst = max(worst, loop.time() - due)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(tick_s * 3)  # ticking
    try:
        await operation()
    finally:
        done = True
        await task
    return worst


async def test_a_voice_clip_is_encoded_and_decoded_off_the_event_loop(
    redis_server: Cluster, store: Store
) -> None:
    """Writing a voice to the store (FLAC encoding) and reading it back on another replica
    (decoding) leave the event loop free: its timers are never late by anything near what one
    codec call costs, measured here on the loop."""
    voice = long_clip()
    fields = voice_to_redis(voice)
    assert len(fields["audio"]) > 2_000_000  # a realistic worst case, not a toy clip
    encode_s = decode_s = float("inf")
    for _ in range(3):  # the least each costs on this machine, now
        started = time.perf_counter()
        voice_to_redis(voice)
        encode_s = min(encode_s, time.perf_counter() - started)
        started = time.perf_counter()
        voice_from_redis(voice.voice_id, {b"meta": fields["meta"], b"audio": fields["audio"]})
        decode_s = min(decode_s, time.perf_counter() - started)
    assert min(encode_s, decode_s) > 0.005  # what the loop would stall for, were they on it

    wav = io.BytesIO()
    sf.write(wav, voice.audio, voice.sample_rate, format="WAV")
    config = GatewayConfig(redis_url=redis_server.redis_url)
    here = SharedVoiceRegistry(FakeEngine(), config, store, "cadence:")
    there = SharedVoiceRegistry(FakeEngine(), config, store, "cadence:")
    added: list[str] = []

    async def add() -> None:
        added.append((await here.add("k", "long", "text", wav.getvalue()))[0].voice_id)

    # the best of three runs of each: a loaded machine may delay one tick now and then, while a
    # codec on the loop delays one in every run
    add_stall = min([await loop_stall(add) for _ in range(3)])
    fetch_stall = min([await loop_stall(lambda v=v: there.fetch(v)) for v in added])  # type: ignore[misc]
    assert all(there.get(v) is not None for v in added)  # each read, decoded and kept
    assert np.array_equal(there.get(added[0]).audio, here.get(added[0]).audio)  # type: ignore[union-attr]
    assert add_stall < encode_s / 2, (add_stall, encode_s)
    assert fetch_stall < decode_s / 2, (fetch_stall, decode_s)


def cancel_as_written(
    monkeypatch: pytest.MonkeyPatch, store: Store, command: bytes
) -> list[asyncio.Task[Any]]:
    """The first task put in the returned list is cancelled just as the store's client finishes
    writing `command`. redis-py writes each command inside asyncio.wait_for, and Python 3.11's
    wait_for then returns as if nothing happened, leaving the cancellation undelivered: a loaded
    machine hits that moment now and then (a shutdown that never ends); here it is hit each time."""
    targets: list[asyncio.Task[Any]] = []
    connection_class = store.client.connection_pool.connection_class
    send = connection_class._send_packed_command

    async def sending(self: Any, parts: Any) -> None:
        parts = list(parts)
        await send(self, parts)
        if targets and command in b"".join(parts):
            targets.pop().cancel()

    monkeypatch.setattr(connection_class, "_send_packed_command", sending)
    return targets


async def ends_when_cancelled(task: asyncio.Task[Any]) -> None:
    """`task` (cancelled by its command's write) ends as cancelled; one that goes on is stopped."""
    try:
        done, _ = await asyncio.wait([task], timeout=2)
        assert task in done, "the cancelled task goes on"
        assert task.cancelled(), task.result()
    finally:
        task.cancel()  # one that lost its cancellation takes a second one
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 2)


async def test_the_store_watch_ends_when_cancelled_as_its_probe_is_written(
    redis_server: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(redis_server.redis_url, probe_s=0.05)
    cancel_on_ping = cancel_as_written(monkeypatch, store, b"PING")
    try:
        watcher = asyncio.create_task(store.watch())
        cancel_on_ping.append(watcher)
        await ends_when_cancelled(watcher)
    finally:
        await store.close()


async def test_the_quota_writer_ends_when_cancelled_as_its_write_is_sent(
    redis_server: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guarded command (the writer's pipeline, through the breaker) cancelled as it is sent."""
    store = Store(redis_server.redis_url, probe_s=0.05)
    quotas = SharedQuotas(store, "a", QuotaLimits(sessions=10))
    cancel_on_write = cancel_as_written(monkeypatch, store, b"MULTI")
    try:
        writer = asyncio.create_task(quotas.run())
        cancel_on_write.append(writer)
        quotas.open_session("k")  # a change: the writer sends it
        await ends_when_cancelled(writer)
    finally:
        await store.close()


async def test_a_listener_ends_when_cancelled_as_its_subscribe_is_written(
    redis_server: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(redis_server.redis_url, probe_s=0.05)
    cancel_on_subscribe = cancel_as_written(monkeypatch, store, b"SUBSCRIBE")
    try:
        listener = asyncio.create_task(
            listen_forever(store, ["chan"], lambda _channel, _data: None, asyncio.Event(), "test")
        )
        cancel_on_subscribe.append(listener)
        await ends_when_cancelled(listener)
    finally:
        await store.close()


@pytest.mark.parametrize("fault", ["down", "refusing"])
async def test_characters_spent_while_a_quota_write_fails_reach_the_shared_budget(
    redis_server: Cluster, store: Store, fault: str
) -> None:
    """A write of this replica's spending fails (the store is away, or refuses writes): what it
    carried is sent with the next write that succeeds, so the shared budget counts it."""
    quotas = SharedQuotas(store, "a", QuotaLimits(chars_per_minute=100))
    direct = aioredis.Redis.from_url(redis_server.redis_url)
    try:
        quotas.take_chars("k", 60, time.monotonic())
        if fault == "down":
            await stop_redis(redis_server, store)
            with pytest.raises(StoreUnavailable):
                await quotas.write(full=False)
            await asyncio.to_thread(redis_server.start_redis, False)
            await asyncio.wait_for(store.wait_up(), 5)
            await direct.aclose()
            direct = aioredis.Redis.from_url(redis_server.redis_url)
        else:
            await direct.config_set("maxmemory", 1)  # noeviction: every write answers OOM
            with pytest.raises(aioredis.ResponseError):
                await quotas.write(full=False)
            await direct.config_set("maxmemory", 256 * 1024 * 1024)
        quotas.take_chars("k", 10, time.monotonic())
        await quotas.write(full=False)
        level = float(await direct.hget("cadence:chars:k", "level"))  # type: ignore[arg-type]
        # 100 - 70 spent, plus what refilled since (100 a minute: under 10 in this test's time)
        assert level < 40, level
    finally:
        await direct.aclose()
