"""Edges of the store's faults, in this process against a real redis-server on loopback."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis

from engine.api import SynthesisRequest, SynthesisStream
from gateway.cluster.state import ENDED_TTL_S
from gateway.cluster.state import Cluster as Replica
from gateway.cluster.store import Store, StoreUnavailable
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.cluster.harness import Cluster, endless_script, redis_cli, tools_available

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]

BUSY_REPLY_MS = 1500  # Redis answers BUSY (instead of nothing) once a script has run this long


async def test_a_store_busy_with_a_long_script_is_used_again_once_the_script_ends(
    redis_server: Cluster,
) -> None:
    """A long Lua script first makes the store silent (the breaker opens), then makes it answer
    every command, PING included, with a BUSY error; once the script ends the breaker closes."""
    store = Store(redis_server.redis_url, probe_s=0.05)
    watcher = asyncio.create_task(store.watch())
    try:
        assert await store.client.ping()
        async with endless_script(redis_server, BUSY_REPLY_MS):
            await asyncio.sleep(0.2)
            with pytest.raises(StoreUnavailable):  # no answer within the command deadline
                await store.client.get("k")
            await asyncio.sleep(BUSY_REPLY_MS / 1000 + 0.5)  # the probes get BUSY now
            killed = await asyncio.to_thread(redis_cli, redis_server, "script", "kill")
            assert killed.stdout.strip() == "OK"
            await asyncio.wait_for(store.wait_up(), 3)
            assert not watcher.done()
            assert await store.client.set("k", "v")
    finally:
        watcher.cancel()
        await store.close()


class _Protocol:
    key_id = "k"


class _Session:
    session_id = "s1"
    protocol = _Protocol()


async def test_an_utterance_cancelled_before_its_stream_is_pulled_leaves_the_directory(
    redis_server: Cluster,
) -> None:
    """A session cancels an utterance whose pull task has not run yet (open and cancel in one
    step, as a speak.cancel right behind the speak.append, or a cross-replica interrupt): the
    iteration never starts, and the directory entry must still end (no hour-long key, no entry
    re-asserted after every outage)."""
    replica = Replica(FakeEngine(), GatewayConfig(redis_url=redis_server.redis_url, replica_id="r1"))
    raw = aioredis.Redis.from_url(redis_server.redis_url)
    try:
        replica.sessions.add(_Session())  # type: ignore[arg-type]
        stream = replica.engine.open(SynthesisRequest("s1/u1"))

        async def pull(stream: SynthesisStream) -> None:  # as the session iterates a stream
            async for _ in stream:
                pass

        task = asyncio.create_task(pull(stream))
        stream.cancel()  # the session's _cancel_stream: the stream, then its pull task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # the directory writes
        assert replica._live == {}
        assert 0 < await raw.ttl("cadence:utt:k:u1") <= ENDED_TTL_S
    finally:
        await raw.aclose()
        await replica.voices.close()
        await replica.store.close()
