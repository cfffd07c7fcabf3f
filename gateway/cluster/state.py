"""Several replicas as one service, through Redis (`cadence serve --redis URL`).

`Cluster` plugs into a Gateway: per-key quotas counted across replicas (gateway.cluster.quotas),
the shared voice registry (gateway.cluster.voices), a live-utterance directory, control routed
to the replica that holds an utterance's audio stream, and the Twilio call directory and
control-channel relay (gateway.cluster.calls).

Directory: every utterance opened on /v1/stream is written as `{prefix}utt:{key_id}:{utterance_id}`
-> "{replica} {session_id}" (an hour; two minutes once it ends, so a late interrupt still finds it).

Control: `POST /v1/utterances/{utterance_id}/interrupt` (body: optional `played_ms`, `session_id`)
may land on any replica. The owner is looked up in the directory and asked over pub/sub
(`{prefix}ctl:{replica}`); on a miss every replica is asked (`{prefix}ctl:*`). The owner runs it
as the session's own `speak.cancel` would (the client gets `utterance.interrupted` on its socket)
and the answer, the same `utterance.interrupted` message, comes back on `{prefix}reply:{replica}`.
The cost is one directory GET and two PUBLISH hops: see docs/deploy.md for measured figures.
Replicas announce themselves with a heartbeat key (`{prefix}replica:{id}`, 5 s); quotas stop
counting a replica whose heartbeat expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from engine.api import AudioChunk, Engine, SynthesisRequest, SynthesisStream, TextSegment
from gateway.auth import ANONYMOUS
from gateway.cluster.pubsub import listen_forever
from gateway.cluster.quotas import SharedQuotas
from gateway.cluster.voices import SharedVoiceRegistry

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.cluster.calls import CallRouter
    from gateway.twilio import TwilioGateway

log = logging.getLogger("cadence.redis")

PREFIX = "cadence:"
HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 5
VOICE_RESYNC_S = 2.0
CONTROL_TIMEOUT_S = 2.0
LIVE_TTL_S = 3600
ENDED_TTL_S = 120


class DirectoryEngine:
    """The gateway's engine, recording each /v1/stream utterance in the live-utterance directory."""

    def __init__(self, engine: Engine, cluster: Cluster) -> None:
        self.inner = engine
        self.cluster = cluster

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open(self, request: SynthesisRequest) -> SynthesisStream:
        stream = self.inner.open(request)
        key = self.cluster.directory_key_for(request.request_id)
        if key is None:
            return stream
        self.cluster.spawn(self.cluster.set_directory(key, request.request_id))
        return _DirectoryStream(stream, self.cluster, key)


class _DirectoryStream(SynthesisStream):
    def __init__(self, inner: SynthesisStream, cluster: Cluster, key: str) -> None:
        self.inner = inner
        self.request_id = inner.request_id
        self.cluster = cluster
        self.key = key

    def push(self, segment: TextSegment) -> None:
        self.inner.push(segment)

    def close_text(self) -> None:
        self.inner.close_text()

    def set_word_alignment(self, mode: str) -> None:
        self.inner.set_word_alignment(mode)

    def cancel(self) -> None:
        self.inner.cancel()
        self.cluster.spawn(self.cluster.end_directory(self.key))

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            async for chunk in self.inner:
                yield chunk
        finally:
            self.cluster.spawn(self.cluster.end_directory(self.key))


class Cluster:
    def __init__(
        self,
        gateway: Gateway,
        url: str,
        replica_id: str,
        prefix: str = PREFIX,
        twilio: TwilioGateway | None = None,
    ) -> None:
        self.gateway = gateway
        self.replica_id = replica_id
        self.prefix = prefix
        self.redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.sync_redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        old_quotas = gateway.quotas
        gateway.quotas = SharedQuotas(self.sync_redis, replica_id, old_quotas.limits, prefix)
        gateway.quotas.per_key.update(old_quotas.per_key)
        gateway.voices = SharedVoiceRegistry(gateway.engine, gateway.config, self.redis, prefix)
        gateway.engine = DirectoryEngine(gateway.engine, self)
        self.voices: SharedVoiceRegistry = gateway.voices
        self.calls: CallRouter | None = None  # Twilio calls: directory and control relay
        if twilio is not None:
            from gateway.cluster.calls import CallRouter

            self.calls = CallRouter(self.redis, replica_id, twilio, prefix, registry=gateway.metrics.registry)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._calls = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future[dict[str, Any]], list[dict[str, Any]], int]] = {}
        registry = gateway.metrics.registry
        self.control_routed = Counter(
            "cadence_control_routed", "Control messages by how they were served", ["route"], registry=registry
        )
        self.control_latency = Histogram(
            "cadence_control_remote_seconds",
            "Time to serve a control message held by another replica",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0),
            registry=registry,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait_s: float = 30.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self.redis.ping()
                break
            except (aioredis.ConnectionError, OSError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        await self._beat()
        await self.voices.resync()
        subscribed = asyncio.Event()
        self._loops = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._listen_loop(subscribed)),
        ]
        await asyncio.wait_for(subscribed.wait(), wait_s)
        if self.calls is not None:
            await self.calls.start(wait_s)
        log.info("replica %s joined the cluster", self.replica_id)

    async def stop(self) -> None:
        if self.calls is not None:
            await self.calls.stop()
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.redis.delete(f"{self.prefix}replica:{self.replica_id}")
        await self.voices.close()
        with contextlib.suppress(Exception):
            await self.redis.aclose()
        self.sync_redis.close()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("cluster task failed: %s", task.exception())

    async def _beat(self) -> None:
        await self.redis.set(f"{self.prefix}replica:{self.replica_id}", str(time.time()), ex=HEARTBEAT_TTL_S)

    async def _heartbeat_loop(self) -> None:
        last_resync = time.monotonic()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._beat()
                if time.monotonic() - last_resync >= VOICE_RESYNC_S:
                    last_resync = time.monotonic()
                    await self.voices.resync()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("Redis unreachable (%s); retrying", exc)

    # -- the live-utterance directory ---------------------------------------------------------
    def directory_key_for(self, request_id: str) -> str | None:
        session_id, _, utterance_id = request_id.partition("/")
        for session in self.gateway.sessions:
            if session.session_id == session_id:
                return f"{self.prefix}utt:{session.protocol.key_id}:{utterance_id}"
        return None

    async def set_directory(self, key: str, request_id: str) -> None:
        session_id = request_id.partition("/")[0]
        await self.redis.set(key, f"{self.replica_id} {session_id}", ex=LIVE_TTL_S)

    async def end_directory(self, key: str) -> None:
        await self.redis.expire(key, ENDED_TTL_S)

    async def replicas(self) -> list[str]:
        names = [
            k.decode()[len(self.prefix) + len("replica:") :]
            async for k in self.redis.scan_iter(match=f"{self.prefix}replica:*")
        ]
        return sorted(names)

    # -- control ------------------------------------------------------------------------------
    def interrupt_here(
        self, key_id: str, utterance_id: str, played_ms: int | None, session_id: str | None = None
    ) -> dict[str, Any] | None:
        """Interrupt an utterance of a session on this replica, as its own speak.cancel would."""
        for session in list(self.gateway.sessions):
            if session.protocol.key_id != key_id or (session_id and session.session_id != session_id):
                continue
            if session.protocol.utterance(utterance_id) is None:
                continue
            cancel: dict[str, Any] = {"type": "speak.cancel", "utterance_id": utterance_id}
            if played_ms is not None:
                cancel["played_ms"] = played_ms
            session.inject(json.dumps(cancel))
            utt = session.protocol.utterance(utterance_id)
            if utt is not None and utt.interrupted is not None:
                return {**utt.interrupted, "session_id": session.session_id}
        return None

    async def interrupt(
        self, key_id: str, utterance_id: str, played_ms: int | None, session_id: str | None = None
    ) -> tuple[dict[str, Any] | None, str, str | None]:
        """Interrupt wherever the utterance lives: (utterance.interrupted or None, route, owner)."""
        local = self.interrupt_here(key_id, utterance_id, played_ms, session_id)
        if local is not None:
            self.control_routed.labels("local").inc()
            return local, "local", self.replica_id
        started = time.perf_counter()
        request = {
            "op": "interrupt",
            "key_id": key_id,
            "utterance_id": utterance_id,
            "played_ms": played_ms,
            "session_id": session_id,
        }
        entry = await self.redis.get(f"{self.prefix}utt:{key_id}:{utterance_id}")
        answer: dict[str, Any] | None = None
        route = "broadcast"
        if entry is not None:
            owner, _, owner_session = (entry.decode() if isinstance(entry, bytes) else entry).partition(" ")
            if owner != self.replica_id:
                request["session_id"] = session_id or owner_session
                answer = await self.ask(f"{self.prefix}ctl:{owner}", request)
                route = "directory"
        if answer is None or answer.get("result") is None:
            request["session_id"] = session_id
            answer = await self.ask(f"{self.prefix}ctl:*", request)
            route = "broadcast"
        result = answer.get("result") if answer else None
        self.control_routed.labels(route if result is not None else "not_found").inc()
        if result is not None:
            self.control_latency.observe(time.perf_counter() - started)
        return result, route, answer.get("replica") if answer else None

    async def ask(self, channel: str, request: dict[str, Any]) -> dict[str, Any] | None:
        """Publish a control request; the first answer that found its target (or the last of
        all the answers, or None after CONTROL_TIMEOUT_S)."""
        call_id = next(self._calls)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        answers: list[dict[str, Any]] = []
        self._waiting[call_id] = (future, answers, 1 << 30)
        try:
            message = json.dumps({**request, "call_id": call_id, "reply_to": self.replica_id})
            receivers = await self.redis.publish(channel, message)
            if receivers == 0:
                return None
            self._waiting[call_id] = (future, answers, int(receivers))
            if len(answers) >= receivers and not future.done():
                future.set_result(answers[-1])
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        except TimeoutError:
            return answers[-1] if answers else None
        finally:
            self._waiting.pop(call_id, None)

    def _on_reply(self, reply: dict[str, Any]) -> None:
        waiting = self._waiting.get(int(reply.get("call_id", 0)))
        if waiting is None:
            return
        future, answers, expected = waiting
        answers.append(reply)
        if not future.done() and (reply.get("result") is not None or len(answers) >= expected):
            future.set_result(reply)

    async def _on_request(self, request: dict[str, Any]) -> None:
        result = None
        if request.get("op") == "interrupt":
            played = request.get("played_ms")
            result = self.interrupt_here(
                str(request["key_id"]),
                str(request["utterance_id"]),
                int(played) if played is not None else None,
                request.get("session_id"),
            )
        reply = {"call_id": request.get("call_id"), "result": result, "replica": self.replica_id}
        await self.redis.publish(f"{self.prefix}reply:{request['reply_to']}", json.dumps(reply))

    async def _listen_loop(self, subscribed: asyncio.Event) -> None:
        channels = [
            f"{self.prefix}ctl:{self.replica_id}",
            f"{self.prefix}ctl:*",
            f"{self.prefix}reply:{self.replica_id}",
            self.voices.events,
        ]

        def on_message(channel: str, raw: bytes) -> None:
            data = raw.decode()
            if channel == self.voices.events:
                self.spawn(self.voices.on_event(data))
            elif channel.startswith(f"{self.prefix}reply:"):
                self._on_reply(json.loads(data))
            else:
                self.spawn(self._on_request(json.loads(data)))

        await listen_forever(self.redis, channels, on_message, subscribed, "Redis control")

    # -- routes -------------------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/utterances/{utterance_id}/interrupt", self.interrupt_endpoint, methods=["POST"]),
            Route("/v1/cluster", self.cluster_endpoint, methods=["GET"]),
        ]

    async def interrupt_endpoint(self, request: Request) -> Response:
        principal = getattr(request.state, "principal", ANONYMOUS)
        utterance_id = request.path_params["utterance_id"]
        try:
            body = json.loads(await request.body() or b"{}")
            played_ms = body.get("played_ms")
            session_id = body.get("session_id")
            if played_ms is not None and (not isinstance(played_ms, int) or played_ms < 0):
                raise ValueError("`played_ms` must be a non-negative integer")
            if session_id is not None and not isinstance(session_id, str):
                raise ValueError("`session_id` must be a string")
        except (ValueError, AttributeError) as exc:
            message = str(exc) if str(exc).startswith("`") else "the body must be a JSON object"
            return JSONResponse({"error": {"message": message, "code": "invalid_message"}}, 400)
        try:
            result, route, owner = await self.interrupt(principal.key_id, utterance_id, played_ms, session_id)
        except (aioredis.RedisError, OSError) as exc:
            return JSONResponse(
                {"error": {"message": f"the shared store is unreachable: {exc}", "code": "internal"}}, 503
            )
        if result is None:
            return JSONResponse(
                {"error": {"message": f"no utterance {utterance_id[:64]!r}", "code": "unknown_utterance"}},
                404,
            )
        return JSONResponse({**result, "route": route, "owner": owner, "replica": self.replica_id})

    async def cluster_endpoint(self, request: Request) -> Response:
        return JSONResponse({"replica": self.replica_id, "replicas": await self.replicas()})
