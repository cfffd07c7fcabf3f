"""The store's circuit breaker and the shared quotas, in this process against a real redis-server
on loopback: the breaker opens once and fails fast, closes on the store's return and runs the
recovery; quotas decide from local counts (no command on the hot path), see the other replicas'
counts, share the character budget, and are exact again after the store lost everything."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import soundfile as sf
from prometheus_client import CollectorRegistry

from gateway.cluster.quotas import SharedQuotas
from gateway.cluster.store import Store, StoreUnavailable
from gateway.cluster.voices import WRITE_TIMEOUT_S, SharedVoiceRegistry
from gateway.config import GatewayConfig
from gateway.quotas import QuotaExceeded, QuotaLimits, RateLimited
from tests.fakes import FakeEngine
from tests.gateway.cluster.harness import Cluster, free_port, tools_available, wait_until
from tests.integration.conftest import run_gateway

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]


def connections_taken(store: Store) -> list[int]:
    """Count, from now on, the connections taken from the client's pool: every command, pipeline
    and subscription takes one."""
    taken: list[int] = []
    pool = store.client.connection_pool
    get_connection = pool.get_connection

    async def counting(*args: Any, **options: Any) -> Any:
        taken.append(1)
        return await get_connection(*args, **options)

    pool.get_connection = counting  # type: ignore[method-assign]
    return taken


def breaker(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("cadence_store_breaker_state")


async def test_the_breaker_opens_once_fails_fast_and_closes_when_the_store_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = Cluster(tmp_path, redis_port=free_port())
    registry = CollectorRegistry()
    store = Store(server.redis_url, registry, probe_s=0.05)
    recovered = asyncio.Event()

    async def recovery() -> None:
        recovered.set()

    store.on_recovery(recovery)
    caplog.set_level(logging.WARNING, "cadence.redis")
    try:
        with pytest.raises(StoreUnavailable):  # nothing listens: the first command opens it
            await store.client.get("k")
        assert store.state()["state"] == "degraded" and "reason" in store.state()
        taken = connections_taken(store)
        for _ in range(50):  # open: every command fails at once, none reaches the network
            with pytest.raises(StoreUnavailable):
                await store.client.set("k", "v")
        assert taken == []
        assert breaker(registry) == 1.0
        watcher = asyncio.create_task(store.watch())
        await asyncio.sleep(0.2)  # probes keep failing, and say nothing more
        server.start_redis(persistent=False)
        await asyncio.wait_for(recovered.wait(), 5)
        assert store.up and store.state() == {"state": "up", "breaker": "closed"}
        assert breaker(registry) == 0.0
        assert await store.client.set("k", "v")
        watcher.cancel()
        lines = [r.getMessage() for r in caplog.records]
        assert sum("unreachable" in line for line in lines) == 1, lines
        assert sum("reachable again" in line for line in lines) == 1, lines
    finally:
        await store.close()
        server.stop()


async def test_a_hung_store_opens_the_breaker_within_the_command_deadline(redis_server: Cluster) -> None:
    store = Store(redis_server.redis_url)
    try:
        for _ in range(20):  # connected (a loaded machine may take a while the first time)
            if await store.probe():
                break
        assert await store.client.ping()
        redis_server.pause_redis()
        with pytest.raises(StoreUnavailable):
            await store.client.get("k")
        assert not store.up
        redis_server.resume_redis()
        assert await store.probe() and await store.client.ping()
    finally:
        redis_server.resume_redis()
        await store.close()


async def test_a_voice_written_as_the_store_hangs_is_kept_here(redis_server: Cluster) -> None:
    """The clip's write (a command with a longer deadline) is on its way to a store that hangs
    when the breaker opens (another command's deadline ran out): the write gives up then, and the
    registration succeeds here, as one made while the store is away does."""
    store = Store(redis_server.redis_url)
    registry = SharedVoiceRegistry(
        FakeEngine(), GatewayConfig(redis_url=redis_server.redis_url), store, "cadence:"
    )
    unguarded = store.client.unguarded
    writing = asyncio.Event()

    async def watched(*args: Any, **options: Any) -> Any:
        if args[0] == "HSET":
            writing.set()
        return await unguarded(*args, **options)

    store.client.unguarded = watched  # type: ignore[method-assign]
    adding: asyncio.Task[Any] | None = None
    try:
        redis_server.pause_redis()
        adding = asyncio.create_task(registry.add("k", "Grace", "hello", clip()))
        await asyncio.wait_for(writing.wait(), 5)
        store.trip(TimeoutError())
        # far less than the write's own deadline, WRITE_TIMEOUT_S, which it must not wait for
        async with asyncio.timeout(WRITE_TIMEOUT_S / 2):
            voice, _ = await adding
        assert registry.get(voice.voice_id) is voice
    finally:
        redis_server.resume_redis()
        if adding is not None:
            adding.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await adding
        await store.close()


async def test_the_hot_path_sends_no_command(stores: list[Store]) -> None:
    quotas = SharedQuotas(stores[0], "a", QuotaLimits(sessions=2, utterances=2, chars_per_minute=100))
    taken = connections_taken(stores[0])
    quotas.open_session("k")
    quotas.begin_utterance("k", "u1")
    quotas.take_chars("k", 10, 0.0, "u1")
    assert taken == [] and quotas.usage("k") == (1, 1)
    quotas.end_utterance("k")
    quotas.close_session("k")
    assert taken == []
    await quotas.write(full=False)  # the writer sends it all, in one pipeline
    assert taken == [1]


async def test_limits_hold_across_replicas_from_their_published_counts(stores: list[Store]) -> None:
    limits = QuotaLimits(sessions=3, utterances=2, chars_per_minute=1_000)
    a, b = (SharedQuotas(store, name, limits) for store, name in zip(stores, "ab", strict=True))
    await a.write(full=True)
    await b.write(full=True)
    a.open_session("k")
    a.open_session("k")
    a.begin_utterance("k")
    await a.write(full=False)
    await b.read_others()
    assert b.usage("k") == (2, 1)
    b.open_session("k")
    with pytest.raises(QuotaExceeded):
        b.open_session("k")
    b.begin_utterance("k")
    with pytest.raises(QuotaExceeded):
        b.begin_utterance("k")
    a.close_session("k")
    await a.write(full=False)
    await b.read_others()
    b.open_session("k")  # room again
    # a message and a read that cross: the older one does not undo the newer
    a.end_utterance("k")
    await a.write(full=False)
    await b.read_others()
    b.on_message(json.dumps({"replica": "a", "seq": 1, "full": True, "counts": {"u:k": 5}}).encode())
    assert b.usage("k")[1] == 1  # b's own utterance only


async def test_the_character_budget_is_shared(stores: list[Store]) -> None:
    limits = QuotaLimits(chars_per_minute=100)
    a, b = (SharedQuotas(store, name, limits) for store, name in zip(stores, "ab", strict=True))
    loop = asyncio.get_running_loop()
    a.take_chars("k", 80, loop.time())
    await a.write(full=False)
    b.take_chars("k", 5, loop.time())  # b's local bucket is full until its next write
    await b.write(full=False)  # the shared level (15) comes back
    with pytest.raises(RateLimited):
        b.take_chars("k", 30, loop.time())
    b.take_chars("k", 10, loop.time())


async def test_counts_are_exact_again_after_the_store_lost_them(
    stores: list[Store], redis_server: Cluster
) -> None:
    a = SharedQuotas(stores[0], "a", QuotaLimits())
    for _ in range(3):
        a.open_session("k")
    a.begin_utterance("k")
    await a.write(full=True)
    direct = aioredis.Redis(port=redis_server.redis_port)
    try:
        await direct.flushall()
        await direct.hset("cadence:usage:a", mapping={"s:k": 99, "u:gone": 7})  # stale, from before
        await a.write(full=True)
        assert await direct.hgetall("cadence:usage:a") == {b"s:k": b"3", b"u:k": b"1", b"_seq": a_seq(a)}
        assert await direct.exists("cadence:replica:a") and await direct.sismember("cadence:replicas", "a")
    finally:
        await direct.aclose()


def a_seq(quotas: SharedQuotas) -> bytes:
    return str(quotas._seq).encode()


async def test_while_the_store_is_away_each_replica_counts_alone(stores: list[Store]) -> None:
    limits = QuotaLimits(sessions=2)
    a, b = (SharedQuotas(store, name, limits) for store, name in zip(stores, "ab", strict=True))
    a.open_session("k")
    a.open_session("k")
    await a.write(full=True)
    await b.read_others()
    with pytest.raises(QuotaExceeded):
        b.open_session("k")
    stores[1].trip(OSError("test: the store went away"))
    b.open_session("k")  # degraded: b's own count only
    b.open_session("k")
    with pytest.raises(QuotaExceeded):
        b.open_session("k")


def clip() -> bytes:
    rate = 16_000
    t = np.arange(rate * 2) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


async def test_a_voice_registered_while_the_store_is_away_is_real_and_reaches_it_later(
    redis_server: Cluster,
) -> None:
    engines = [FakeEngine(), FakeEngine()]
    configs = [GatewayConfig(redis_url=redis_server.redis_url, replica_id=f"r{i}") for i in (1, 2)]
    with run_gateway(engines[0], configs[0]) as a, run_gateway(engines[1], configs[1]) as b:
        redis_server.stop_redis()
        async with httpx.AsyncClient() as http:
            for _ in range(100):  # until replica a has noticed
                if (await http.get(f"{a.http}/readyz")).json()["store"]["state"] == "degraded":
                    break
                await asyncio.sleep(0.05)
            response = await http.post(f"{a.http}/v1/voices?name=Grace&text=hello", content=clip())
            assert response.status_code == 201, response.text  # kept here, usable here at once
            voice_id = response.json()["voice_id"]
            assert voice_id in engines[0].registered
            assert (await http.get(f"{a.http}/v1/voices/{voice_id}")).status_code == 200
            cluster = await http.get(f"{b.http}/v1/cluster")
            assert cluster.status_code == 503 and cluster.json()["error"]["code"] == "store_unavailable"
        redis_server.start_redis(persistent=False)  # back, and empty
        wait_until(lambda: voice_id in engines[1].registered, 5, "the voice on replica b")
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{b.http}/v1/voices/{voice_id}")).status_code == 200
            replicas = None
            for _ in range(100):  # both replicas announced themselves again
                replicas = (await http.get(f"{b.http}/v1/cluster")).json().get("replicas")
                if replicas == ["r1", "r2"]:
                    break
                await asyncio.sleep(0.05)
            assert replicas == ["r1", "r2"]
