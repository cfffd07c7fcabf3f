"""Several replicas as one service, through Redis (`cadence serve --redis URL`).

`Cluster` is what a Gateway is built with to be one replica of several: per-key quotas counted
across replicas (gateway.cluster.quotas), the shared voice registry (gateway.cluster.voices), a
live-utterance directory, control routed to the replica that holds an utterance's audio stream,
and the Twilio call directory and control-channel relay (gateway.cluster.calls). All of it goes
through the store's circuit breaker (gateway.cluster.store): nothing on a session's hot path waits
on Redis, and while Redis is unreachable each replica goes on serving alone (docs/deploy.md,
"When Redis is unreachable").

Directory: every utterance opened on /v1/stream is written as `{prefix}utt:{key_id}:{utterance_id}`
-> "{replica} {session_id}" (an hour; two minutes once it ends, so a late interrupt still finds it).
The entries of live utterances are written again when the store comes back.

Control: `POST /v1/utterances/{utterance_id}/interrupt` (body: optional `played_ms`, `session_id`)
may land on any replica. The owner is looked up in the directory and asked over pub/sub
(`{prefix}ctl:{replica}`); on a miss every replica is asked (`{prefix}ctl:*`). The owner runs it
as the session's own `speak.cancel` would (the client gets `utterance.interrupted` on its socket)
and the answer, the same `utterance.interrupted` message, comes back on `{prefix}reply:{replica}`.
The cost is one directory GET and two PUBLISH hops (docs/deploy.md).
Replicas announce themselves with a heartbeat key (`{prefix}replica:{id}`, 5 s) and in the set
`{prefix}replicas`; quotas stop counting a replica whose heartbeat expired.
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

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from engine.api import AudioChunk, Engine, QueuePosition, SynthesisRequest, SynthesisStream, TextSegment
from gateway.auth import principal_of
from gateway.cluster.pubsub import listen_forever
from gateway.cluster.quotas import SharedQuotas
from gateway.cluster.store import Store, StoreUnavailable
from gateway.cluster.voices import SharedVoiceRegistry
from gateway.config import GatewayConfig
from gateway.session import Session

if TYPE_CHECKING:
    from gateway.cluster.calls import CallRouter
    from gateway.twilio import TwilioGateway

log = logging.getLogger("cadence.redis")

PREFIX = "cadence:"
HEARTBEAT_S = 1.0
VOICE_RESYNC_S = 2.0
CONTROL_TIMEOUT_S = 2.0
START_WAIT_S = 5.0  # how long start-up waits for the store before serving without it
LIVE_TTL_S = 3600
ENDED_TTL_S = 120


def unavailable(reason: str | None, what: str) -> JSONResponse:
    """503: the store's outage, said plainly (streaming on each replica is not affected)."""
    reason = f" ({reason})" if reason else ""
    message = (
        f"the shared store (Redis) is unreachable{reason}: {what} are unavailable until it is back; "
        "streaming on each replica goes on"
    )
    return JSONResponse(
        {"error": {"message": message, "type": "server_error", "code": "store_unavailable"}},
        503,
        headers={"Retry-After": "1"},
    )


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
        self.cluster.live_started(key, request.request_id)
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
        # a stream cancelled before its first pull is never iterated: its end is said here
        self.cluster.live_ended(self.key)

    def queue_position(self) -> QueuePosition | None:
        return self.inner.queue_position()

    def queue_wait_s(self) -> float:
        return self.inner.queue_wait_s()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            async for chunk in self.inner:
                yield chunk
        finally:
            self.cluster.live_ended(self.key)


class Cluster:
    """One replica's part of the cluster; a Gateway built with it uses its quotas, voices, engine
    (the directory's) and set of live sessions."""

    def __init__(
        self,
        engine: Engine,
        config: GatewayConfig,
        twilio: TwilioGateway | None = None,
        prefix: str = PREFIX,
    ) -> None:
        if not config.redis_url:
            raise ValueError("a cluster needs config.redis_url")
        self.replica_id = config.replica_id
        self.prefix = prefix
        self.registry = CollectorRegistry()  # the cluster's metrics, served with the gateway's
        self.store = Store(config.redis_url, self.registry)
        self.redis = self.store.client
        self.sessions: set[Session] = set()  # this replica's open /v1/stream sessions
        self.quotas = SharedQuotas(self.store, self.replica_id, config.quota_limits, prefix)
        self.voices = SharedVoiceRegistry(engine, config, self.store, prefix)
        self.engine = DirectoryEngine(engine, self)
        self.calls: CallRouter | None = None  # Twilio calls: directory and control relay
        if twilio is not None:
            from gateway.cluster.calls import CallRouter

            self.calls = CallRouter(self.store, self.replica_id, twilio, prefix, registry=self.registry)
        self._live: dict[str, str] = {}  # directory entries of the live utterances held here
        self._live_writes: dict[str, asyncio.Task[Any]] = {}  # their SETs still on the way
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._calls = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future[dict[str, Any]], list[dict[str, Any]], int]] = {}
        self.control_routed = Counter(
            "cadence_control_routed",
            "Control messages by how they were served",
            ["route"],
            registry=self.registry,
        )
        self.control_latency = Histogram(
            "cadence_control_remote_seconds",
            "Time to serve a control message held by another replica",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0),
            registry=self.registry,
        )
        self.store.on_recovery(self.reassert)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait_s: float = START_WAIT_S) -> None:
        """Join the cluster; a store that does not answer within `wait_s` leaves this replica
        serving on its own (degraded) until it does."""
        deadline = time.monotonic() + wait_s
        for _ in range(int(wait_s / self.store.probe_s) + 1):
            if await self.store.probe() or time.monotonic() > deadline:
                break
            await asyncio.sleep(self.store.probe_s)
        if self.store.up:
            with contextlib.suppress(StoreUnavailable):
                await self.quotas.write(full=True)
                await self.voices.resync()
        subscribed = asyncio.Event()
        self._loops = [
            asyncio.create_task(self.store.watch()),
            asyncio.create_task(self.quotas.run()),
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._listen_loop(subscribed)),
        ]
        if self.store.up:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(subscribed.wait(), wait_s)
        if self.calls is not None:
            await self.calls.start(wait_s)
        if self.store.up:
            log.info("replica %s joined the cluster", self.replica_id)
        else:
            log.error("replica %s serves without the shared store until it answers", self.replica_id)

    async def stop(self) -> None:
        if self.calls is not None:
            await self.calls.stop()
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.store.up:
            with contextlib.suppress(Exception):
                pipe = self.redis.pipeline(transaction=False)
                pipe.delete(
                    self.quotas.heartbeat_key(self.replica_id), self.quotas.usage_key(self.replica_id)
                )
                pipe.srem(self.quotas.members, self.replica_id)
                await self.store.execute(pipe)
        await self.voices.close()
        await self.store.close()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("cluster task failed: %s", task.exception())

    async def _heartbeat_loop(self) -> None:
        last_resync = time.monotonic()
        refused_at = -1e9
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if not self.store.up:
                continue
            try:
                await self.quotas.write(full=True)
                await self.quotas.read_others()
                if time.monotonic() - last_resync >= VOICE_RESYNC_S:
                    last_resync = time.monotonic()
                    await self.voices.resync()
            except StoreUnavailable:
                pass  # the breaker logged it once; its recovery writes everything again
            except Exception as exc:  # the store refused a command (out of memory, ...): said once a minute
                if time.monotonic() - refused_at > 60:
                    refused_at = time.monotonic()
                    log.error("the shared store refused this replica's heartbeat: %s", exc)

    async def reassert(self) -> None:
        """The store is back (perhaps empty): write this replica's state again, at once."""
        await self.quotas.write(full=True)
        await self.quotas.read_others()
        if self._live:
            pipe = self.redis.pipeline(transaction=False)
            for key, value in self._live.items():
                pipe.set(key, value, ex=LIVE_TTL_S)
            await self.store.execute(pipe)
        if self.calls is not None:
            self.calls.reassert()
        await self.voices.resync()

    # -- the live-utterance directory ---------------------------------------------------------
    def directory_key_for(self, request_id: str) -> str | None:
        session_id, _, utterance_id = request_id.partition("/")
        for session in self.sessions:
            if session.session_id == session_id:
                return f"{self.prefix}utt:{session.protocol.key_id}:{utterance_id}"
        return None

    def live_started(self, key: str, request_id: str) -> None:
        value = f"{self.replica_id} {request_id.partition('/')[0]}"
        self._live[key] = value
        if self.store.up:  # else written when the store is back (reassert)
            written = self.spawn(self.redis.set(key, value, ex=LIVE_TTL_S))
            self._live_writes[key] = written
            written.add_done_callback(lambda task: self._landed(key, task))

    def _landed(self, key: str, written: asyncio.Task[Any]) -> None:
        if self._live_writes.get(key) is written:
            del self._live_writes[key]

    def live_ended(self, key: str) -> None:
        written = self._live_writes.pop(key, None)
        if self._live.pop(key, None) is not None and self.store.up:
            self.spawn(self._expire_after(written, key))

    async def _expire_after(self, written: asyncio.Task[Any] | None, key: str) -> None:
        """The ended entry's short life, set after its SET lands: the two go over different
        connections, and an EXPIRE that came first would leave the SET's hour standing."""
        if written is not None:
            await asyncio.wait([written])
        await self.redis.expire(key, ENDED_TTL_S)

    async def replicas(self) -> list[str]:
        """The live replicas, from the store."""
        return await self.quotas.live_replicas()

    # -- control ------------------------------------------------------------------------------
    def interrupt_here(
        self, key_id: str, utterance_id: str, played_ms: int | None, session_id: str | None = None
    ) -> dict[str, Any] | None:
        """Interrupt an utterance of a session on this replica, as its own speak.cancel would."""
        for session in list(self.sessions):
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
            self.quotas.channel,
        ]

        def on_message(channel: str, raw: bytes) -> None:
            data = raw.decode()
            if channel == self.quotas.channel:
                self.quotas.on_message(raw)
            elif channel == self.voices.events:
                self.spawn(self.voices.on_event(data))
            elif channel.startswith(f"{self.prefix}reply:"):
                self._on_reply(json.loads(data))
            else:
                self.spawn(self._on_request(json.loads(data)))

        await listen_forever(self.store, channels, on_message, subscribed, "cluster control")

    # -- routes -------------------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/utterances/{utterance_id}/interrupt", self.interrupt_endpoint, methods=["POST"]),
            Route("/v1/cluster", self.cluster_endpoint, methods=["GET"]),
        ]

    async def interrupt_endpoint(self, request: Request) -> Response:
        principal = principal_of(request)
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
        except StoreUnavailable:
            return unavailable(self.store.reason, "interrupts of utterances held by other replicas")
        if result is None:
            return JSONResponse(
                {"error": {"message": f"no utterance {utterance_id[:64]!r}", "code": "unknown_utterance"}},
                404,
            )
        return JSONResponse({**result, "route": route, "owner": owner, "replica": self.replica_id})

    async def cluster_endpoint(self, request: Request) -> Response:
        try:
            replicas = await self.replicas()
        except StoreUnavailable:
            return unavailable(self.store.reason, "the cluster's view")
        return JSONResponse({"replica": self.replica_id, "replicas": replicas})
