"""Twilio calls across replicas (`cadence serve --redis URL`): the call directory, and the relay of
an agent's control channel to the replica that holds the call's media stream.

Directory: `{prefix}call:{callSid}` -> {"state": "live", "replica": owner, "key": key id}, written
when Twilio's `start` arrives, for CALL_TTL_S and refreshed every CALL_REFRESH_S while the call
lives; at its end {"state": "ended", "replica", "reason", "key"} for ENDED_TTL_S (a late agent gets
`call.ended` at once). Each start is also announced on `{prefix}calls:up`, so an agent that came
first stops waiting. `key` is the key the call's media stream authenticated with: a control channel
of another key reads the entry as absent (the answer for a callSid that does not exist), on every
replica, and the owner checks the relayed agent's key again.

Relay: `WS /v1/twilio/control/{callSid}` landing on a replica that does not hold the call opens a
link to the owner over pub/sub, one channel per replica (`{prefix}calls:{replica}`): `attach` (with
the agent's key id and voice list, which the call speaks for), the agent's frames, `detach` one
way; `attached` / `refused`, the call's events, `close` the other.
Each side publishes from one task at a time, so both directions keep their order. Both ends ping
every LINK_PING_S; a link silent for LINK_DEAD_S is dead (the agent gets `error` `call_lost` and
`call.ended`, or the owner detaches the agent). The owner runs the agent exactly as a local one
(TwilioGateway.run_agent), so the agent sees the same messages in the same order, and the call's
interruption webhooks are sent once, by the owner.

While the store is unreachable (gateway.cluster.store) directory writes are skipped, and the live
calls held here are written again when it is back; a control channel that needs the directory is
refused at once with `internal` (close 1011).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter
from starlette.websockets import WebSocket, WebSocketState

from gateway.auth import Principal, principal_of
from gateway.cluster.pubsub import listen_forever
from gateway.cluster.store import Store
from gateway.messages import encode
from gateway.twilio import CLOSE_POLICY, AgentFrame, TwilioGateway, next_agent_frame

log = logging.getLogger("cadence.calls")

CALL_TTL_S: Final = 15
CALL_REFRESH_S: Final = 5.0
ENDED_TTL_S: Final = 120
LINK_PING_S: Final = 1.0
LINK_DEAD_S: Final = 3.5
ATTACH_TIMEOUT_S: Final = 2.0
CALL_WAIT_S: Final = 10.0  # how long an agent that came first waits for Twilio's stream
WAIT_ENV: Final = "CADENCE_CALL_WAIT_S"
POLL_S: Final = 0.25  # the directory is read again this often while an agent waits
MAX_PENDING_FRAMES: Final = 1000  # agent frames held while the owner is not known yet
CLOSE_INTERNAL: Final = 1011

# compare-and-set: retire a call's entry only while it still names this replica's live call
_RETIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
end
return false
"""


@dataclass(eq=False)
class _Link:
    """One agent relayed between two replicas, seen from either end."""

    peer: str  # the other replica
    inbox: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)


class _LinkSink:
    """The owner's AgentSink for a relayed agent: each event is published to the relay."""

    def __init__(self, router: CallRouter, relay: str, link_id: str) -> None:
        self.router, self.relay, self.link_id = router, relay, link_id

    async def send_text(self, data: str) -> None:
        await self.router.send_on_link(self.relay, {"op": "event", "link": self.link_id, "text": data})


class CallRouter:
    """The call directory and the control-channel relay of one replica (TwilioGateway.router)."""

    def __init__(
        self,
        store: Store,
        replica_id: str,
        twilio: TwilioGateway,
        prefix: str,
        wait_s: float | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.store = store
        self.redis = store.client
        self.replica_id = replica_id
        self.twilio = twilio
        self.prefix = prefix
        self.wait_s = wait_s if wait_s is not None else float(os.environ.get(WAIT_ENV, CALL_WAIT_S))
        self.channel = self.channel_of(replica_id)
        self.up_channel = f"{prefix}calls:up"
        self._owned: dict[str, str] = {}  # the live calls held here: callSid -> directory entry
        self._links: dict[str, _Link] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}
        # directory writes, in order: (kind, callSid, the live entry, the end's reason)
        self._writes: asyncio.Queue[tuple[str, str, str, str]] = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self.outcomes = Counter(
            "cadence_twilio_control",
            "Twilio control channels that landed on a replica not holding the call, "
            "by outcome (relayed, local, ended, not_found, busy, lost, unreachable)",
            ["outcome"],
            registry=registry,
        )
        twilio.router = self

    def channel_of(self, replica: str) -> str:
        return f"{self.prefix}calls:{replica}"

    def key(self, call_sid: str) -> str:
        return f"{self.prefix}call:{call_sid}"

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait_s: float = 30.0) -> None:
        subscribed = asyncio.Event()
        self._loops = [
            asyncio.create_task(self._listen_loop(subscribed)),
            asyncio.create_task(self._write_loop()),
            asyncio.create_task(self._refresh_loop()),
        ]
        if self.store.up:  # else it subscribes when the store answers
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(subscribed.wait(), wait_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        for call_sid in list(self._owned):  # streams not yet closed by the shutdown
            self.call_ended(call_sid, "server shutting down")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._writes.join(), grace_s)  # ended calls recorded as such
        for task in [*self._loops, *self._tasks]:
            task.cancel()
        for task in [*self._loops, *self._tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def send(self, replica: str, message: dict[str, Any]) -> None:
        await self.redis.publish(self.channel_of(replica), json.dumps(message))

    async def send_on_link(self, replica: str, message: dict[str, Any]) -> None:
        """A link's frame or event, published again while the store is away: the link lives on,
        and loses nothing, if the store is back before the peer's LINK_DEAD_S runs out (each side
        publishes from one task, so the order holds); a store away longer ends it, as silence does."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINK_DEAD_S
        while True:
            try:
                await self.send(replica, message)
                return
            except (aioredis.RedisError, OSError):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                if self.store.up:  # a failure that left the breaker closed: try again shortly
                    await asyncio.sleep(min(remaining, self.store.probe_s))
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.store.wait_up(), remaining)

    # -- the directory ------------------------------------------------------------------------
    def live_value(self, owner: str) -> str:
        return json.dumps({"state": "live", "replica": self.replica_id, "key": owner})

    def call_started(self, call_sid: str, owner: str) -> None:
        self._owned[call_sid] = live = self.live_value(owner)
        self._wake(call_sid)
        self._writes.put_nowait(("live", call_sid, live, ""))

    def call_ended(self, call_sid: str, reason: str) -> None:
        live = self._owned.pop(call_sid, None)
        if live is not None:
            self._writes.put_nowait(("ended", call_sid, live, reason))

    async def lookup_for(self, call_sid: str, key_id: str) -> dict[str, Any] | None:
        """The directory entry of `call_sid` as key `key_id` may see it: another key's call is
        absent, exactly as a callSid that does not exist."""
        entry = await self.lookup(call_sid)
        return entry if entry is not None and entry.get("key") == key_id else None

    async def lookup(self, call_sid: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self.key(call_sid))
        if raw is None:
            return None
        with contextlib.suppress(ValueError):
            entry = json.loads(raw)
            if isinstance(entry, dict) and entry.get("state") in ("live", "ended"):
                return entry
        return None

    def reassert(self) -> None:
        """The store is back: the live calls held here are written again (those that ended
        meanwhile expire with their entry's time to live)."""
        if self._owned:
            self._writes.put_nowait(("refresh", "", "", ""))

    async def _write_loop(self) -> None:
        while True:
            kind, call_sid, live, reason = await self._writes.get()
            try:
                if not self.store.up:
                    log.debug(
                        "call directory write (%s %s) skipped: the store is unreachable", kind, call_sid
                    )
                elif kind == "live":
                    await self.redis.set(self.key(call_sid), live, ex=CALL_TTL_S)
                    await self.redis.publish(
                        self.up_channel, json.dumps({"call": call_sid, "owner": self.replica_id})
                    )
                elif kind == "ended":
                    ended = json.dumps({**json.loads(live), "state": "ended", "reason": reason})
                    await self.redis.eval(_RETIRE, 1, self.key(call_sid), live, ended, ENDED_TTL_S)
                else:
                    owned = list(self._owned.items())  # those still live when the refresh is written
                    if owned:
                        async with self.redis.pipeline(transaction=False) as pipe:
                            for sid, value in owned:
                                pipe.set(self.key(sid), value, ex=CALL_TTL_S)
                            await self.store.execute(pipe)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("call directory write (%s %s) failed: %s", kind, call_sid, exc)
            finally:
                self._writes.task_done()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(CALL_REFRESH_S)
            if self._owned:
                self._writes.put_nowait(("refresh", "", "", ""))

    def _wake(self, call_sid: str) -> None:
        for event in self._waiters.get(call_sid, ()):
            event.set()

    # -- pub/sub ------------------------------------------------------------------------------
    async def _listen_loop(self, subscribed: asyncio.Event) -> None:
        def on_message(channel: str, data: bytes) -> None:
            self._dispatch(channel, json.loads(data))

        await listen_forever(
            self.store, (self.channel, self.up_channel), on_message, subscribed, "call relay"
        )

    def _dispatch(self, channel: str, message: dict[str, Any]) -> None:
        """Synchronous, in arrival order: each link's messages reach its inbox in the order sent."""
        if channel == self.up_channel:
            self._wake(str(message.get("call")))
            return
        link_id = str(message.get("link"))
        if message.get("op") == "attach":
            link = self._links[link_id] = _Link(str(message.get("relay")))
            principal = principal_from_link(message)
            self._spawn(self._serve_relayed(str(message.get("call")), link_id, link, principal))
            return
        known = self._links.get(link_id)
        if known is not None:
            known.inbox.put_nowait(message)

    async def _ping(self, link_id: str, link: _Link) -> None:
        while True:
            # a ping lost to the store (the breaker says so, once) must not end the pinger: the
            # link lives on if the store is back before the peer's LINK_DEAD_S runs out
            with contextlib.suppress(aioredis.RedisError, OSError):
                await self.send(link.peer, {"op": "ping", "link": link_id})
            await asyncio.sleep(LINK_PING_S)

    # -- the owner's end of a link ------------------------------------------------------------
    async def _serve_relayed(self, call_sid: str, link_id: str, link: _Link, principal: Principal) -> None:
        """An agent attached through another replica: served as a local one would be."""
        pinger: asyncio.Task[None] | None = None
        try:
            call = self.twilio.owned(call_sid, principal.key_id)  # another key's: not here
            if call is None or call.agent is not None:
                reason = "not_here" if call is None else "busy"
                await self.send(link.peer, {"op": "refused", "link": link_id, "reason": reason})
                return
            sink = _LinkSink(self, link.peer, link_id)
            # before any await: a second agent is refused from here on
            self.twilio.attach(call, sink, principal)
            await self.send(link.peer, {"op": "attached", "link": link_id})
            pinger = self._spawn(self._ping(link_id, link))
            await self.twilio.run_agent(call, sink, lambda: self._relayed_frame(link))
            await self.send(link.peer, {"op": "close", "link": link_id})  # after the call's last event
        except (aioredis.RedisError, OSError) as exc:
            log.warning("relayed agent of %s lost the store: %s", call_sid, exc)
        finally:
            if pinger is not None:
                pinger.cancel()
            self._links.pop(link_id, None)

    async def _relayed_frame(self, link: _Link) -> AgentFrame:
        while True:
            try:
                message = await asyncio.wait_for(link.inbox.get(), LINK_DEAD_S)
            except TimeoutError:
                return None  # the relay went silent: its replica is gone
            op = message.get("op")
            if op == "frame":
                return str(message.get("text", ""))
            if op == "binary":
                return b""
            if op == "detach":
                return None

    # -- the agent's end ----------------------------------------------------------------------
    async def serve_agent(self, websocket: WebSocket, call_sid: str) -> None:
        """A control channel for a call this replica does not hold: wait for the call to appear
        (bounded), then serve it here (if it started here meanwhile) or relay it to its owner."""
        frames: asyncio.Queue[AgentFrame] = asyncio.Queue()
        reader = self._spawn(self._pump(websocket, frames))
        try:
            entry = await self._find(call_sid, principal_of(websocket).key_id, reader)
            if reader.done():
                return  # the agent left while waiting
            if entry is None or entry["state"] == "ended" or entry.get("replica") == self.replica_id:
                self.outcomes.labels(
                    "not_found" if entry is None else "ended" if entry["state"] == "ended" else "local"
                ).inc()
            if entry is None:
                await self._refuse(
                    websocket,
                    "call_not_found",
                    f"no media stream for call {call_sid[:64]!r} started within {self.wait_s:g} s",
                )
            elif entry["state"] == "ended":
                await _send(
                    websocket, {"type": "call.ended", "call_sid": call_sid, "reason": entry.get("reason")}
                )
            elif entry.get("replica") == self.replica_id:
                await self._serve_here(websocket, call_sid, frames)
            else:
                await self._relay(websocket, call_sid, str(entry.get("replica")), frames)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("control channel of %s: the store is unreachable (%s)", call_sid, exc)
            self.outcomes.labels("unreachable").inc()
            await self._refuse(websocket, "internal", "the shared store is unreachable", CLOSE_INTERNAL)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await websocket.close()

    async def _pump(self, websocket: WebSocket, frames: asyncio.Queue[AgentFrame]) -> None:
        """The agent's frames, read as they come (held while the owner is looked for)."""
        while True:
            frame = await next_agent_frame(websocket)
            if frame is not None and frames.qsize() >= MAX_PENDING_FRAMES:
                with contextlib.suppress(Exception):
                    await websocket.close(CLOSE_POLICY, "too many messages before the call started")
                frame = None
            frames.put_nowait(frame)
            if frame is None:
                return

    async def _find(self, call_sid: str, key_id: str, reader: asyncio.Task[None]) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        event = asyncio.Event()
        self._waiters.setdefault(call_sid, set()).add(event)
        try:
            while True:
                event.clear()
                entry = await self.lookup_for(call_sid, key_id)
                remaining = deadline - loop.time()
                if entry is not None or remaining <= 0 or reader.done():
                    return entry
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, POLL_S))
        finally:
            waiters = self._waiters.get(call_sid)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[call_sid]

    async def _refuse(
        self, websocket: WebSocket, code: str, message: str, close_code: int = CLOSE_POLICY
    ) -> None:
        await _send(websocket, {"type": "error", "code": code, "message": message})
        with contextlib.suppress(Exception):
            await websocket.close(close_code, message[:120])

    async def _serve_here(
        self, websocket: WebSocket, call_sid: str, frames: asyncio.Queue[AgentFrame]
    ) -> None:
        principal = principal_of(websocket)
        call = self.twilio.owned(call_sid, principal.key_id)
        if call is None:
            await self._refuse(websocket, "call_not_found", f"call {call_sid[:64]!r} has ended")
            return
        if call.agent is not None:
            with contextlib.suppress(Exception):
                await websocket.close(CLOSE_POLICY, "this call already has an agent")
            return
        self.twilio.attach(call, websocket, principal)
        await self.twilio.run_agent(call, websocket, frames.get)

    async def _relay(
        self, websocket: WebSocket, call_sid: str, owner: str, frames: asyncio.Queue[AgentFrame]
    ) -> None:
        link_id = uuid.uuid4().hex
        link = self._links[link_id] = _Link(owner)
        tasks: list[asyncio.Task[Any]] = []
        try:
            attach = {"op": "attach", "link": link_id, "call": call_sid, "relay": self.replica_id}
            await self.send(owner, {**attach, **principal_on_link(principal_of(websocket))})
            answer = await self._attach_answer(link)
            self.outcomes.labels(
                "lost"
                if answer is None
                else "relayed"
                if answer.get("op") == "attached"
                else "busy"
                if answer.get("reason") == "busy"
                else "not_found"
            ).inc()
            if answer is None:
                await self._refuse(
                    websocket, "call_lost", "the replica holding this call does not answer", CLOSE_INTERNAL
                )
                return
            if answer.get("op") == "refused":
                if answer.get("reason") == "busy":
                    with contextlib.suppress(Exception):
                        await websocket.close(CLOSE_POLICY, "this call already has an agent")
                else:
                    await self._refuse(websocket, "call_not_found", f"call {call_sid[:64]!r} has ended")
                return
            forward = self._spawn(self._forward(link_id, owner, frames))
            deliver = self._spawn(self._deliver(websocket, link))
            tasks = [forward, deliver, self._spawn(self._ping(link_id, link))]
            await asyncio.wait({forward, deliver}, return_when=asyncio.FIRST_COMPLETED)
            # lost: the owner went silent, or the store stayed away past LINK_DEAD_S for a frame
            if (
                deliver.done()
                and not deliver.cancelled()
                and deliver.exception() is None
                and not deliver.result()
            ) or (forward.done() and not forward.cancelled() and forward.exception() is not None):
                self.outcomes.labels("lost").inc()
                message = "the replica holding this call stopped answering"
                await _send(websocket, {"type": "error", "code": "call_lost", "message": message})
                await _send(websocket, {"type": "call.ended", "call_sid": call_sid, "reason": "replica_lost"})
                with contextlib.suppress(Exception):
                    await websocket.close(CLOSE_INTERNAL, message)
        finally:
            for task in tasks:
                task.cancel()
            self._links.pop(link_id, None)

    async def _attach_answer(self, link: _Link) -> dict[str, Any] | None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ATTACH_TIMEOUT_S):
                while True:
                    message = await link.inbox.get()
                    if message.get("op") in ("attached", "refused"):
                        return message
        return None

    async def _forward(self, link_id: str, owner: str, frames: asyncio.Queue[AgentFrame]) -> None:
        """The agent's frames to the owner, one publish at a time (in order); `detach` at its end."""
        while True:
            frame = await frames.get()
            if frame is None:
                await self.send_on_link(owner, {"op": "detach", "link": link_id})
                return
            if isinstance(frame, str):
                await self.send_on_link(owner, {"op": "frame", "link": link_id, "text": frame})
            else:
                await self.send_on_link(owner, {"op": "binary", "link": link_id})

    async def _deliver(self, websocket: WebSocket, link: _Link) -> bool:
        """The call's events to the agent; True when the owner closed the link, False when it
        went silent (its replica is gone)."""
        while True:
            try:
                message = await asyncio.wait_for(link.inbox.get(), LINK_DEAD_S)
            except TimeoutError:
                return False
            op = message.get("op")
            if op == "event":
                await websocket.send_text(str(message.get("text", "")))
            elif op == "close":
                return True


def principal_on_link(principal: Principal) -> dict[str, Any]:
    """The agent's credentials as the relay's `attach` carries them: the owner's call speaks for
    this key, within this voice list, as it would for an agent connected to it directly."""
    voices = sorted(principal.voices) if principal.voices is not None else None
    return {"key": principal.key_id, "voices": voices, "via_token": principal.via_token}


def principal_from_link(message: dict[str, Any]) -> Principal:
    """The agent's credentials from `attach`; a link without a key id speaks for no registered
    voice (an id no key has)."""
    voices = message.get("voices")
    return Principal(
        str(message.get("key") or ""),
        frozenset(str(v) for v in voices) if isinstance(voices, list) else None,
        via_token=bool(message.get("via_token")),
    )


async def _send(websocket: WebSocket, message: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):
        await websocket.send_text(encode(message))
