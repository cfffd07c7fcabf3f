"""Edges of a call's two links: a relayed control channel's publishes across a moment without the
shared store (gateway.cluster.calls), and Twilio events whose field is not a JSON object."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.cluster import calls
from gateway.cluster.calls import CallRouter, _LinkSink
from gateway.cluster.store import StoreUnavailable
from tests.gateway.twilio.conftest import agent_for, twilio_url
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.integration.conftest import RunningGateway

pytestmark = pytest.mark.timeout(60)

STORE_AWAY_S = 0.2  # well within LINK_DEAD_S


class BlinkingStore:
    """The Store's face to a CallRouter: a publish fails (the breaker opens) while `away`, and the
    store comes back STORE_AWAY_S after `blink()`, or never with `blink(forever=True)`."""

    def __init__(self) -> None:
        self.up = True
        self.probe_s = 0.05
        self.published: list[dict[str, Any]] = []
        self.failures = 0
        self._up = asyncio.Event()
        self._up.set()
        self.client = SimpleNamespace(publish=self._publish)

    def blink(self, forever: bool = False) -> None:
        self.up = False
        self._up.clear()
        if not forever:
            asyncio.get_running_loop().call_later(STORE_AWAY_S, self._back)

    def _back(self) -> None:
        self.up = True
        self._up.set()

    async def wait_up(self) -> None:
        await self._up.wait()

    async def _publish(self, channel: str, data: str) -> int:
        if not self.up:
            self.failures += 1
            raise StoreUnavailable("the shared store is unreachable (test)")
        self.published.append({"channel": channel, **json.loads(data)})
        return 1


def router_on(store: BlinkingStore) -> CallRouter:
    return CallRouter(store, "r1", SimpleNamespace(), "cadence:")  # type: ignore[arg-type]


async def test_a_relayed_agents_frames_outlive_a_failed_publish() -> None:
    """The agent's frames reach the owner in order, none lost, across a store that is away for a
    moment: one failed publish must not end the link (the pinger already outlives it)."""
    store = BlinkingStore()
    router = router_on(store)
    frames: asyncio.Queue[str | bytes | None] = asyncio.Queue()
    forward = asyncio.create_task(router._forward("l1", "r2", frames))
    try:
        frames.put_nowait('{"type": "speak.append", "utterance_id": "u1", "text": "Hi."}')
        await asyncio.sleep(0.01)
        store.blink()
        frames.put_nowait('{"type": "speak.end", "utterance_id": "u1"}')
        frames.put_nowait(b"\x00")
        frames.put_nowait(None)
        await asyncio.wait_for(forward, 2.0)
    finally:
        forward.cancel()
        with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
            await forward
    assert store.failures >= 1
    assert [(m["channel"], m["op"], m.get("text")) for m in store.published] == [
        ("cadence:calls:r2", "frame", '{"type": "speak.append", "utterance_id": "u1", "text": "Hi."}'),
        ("cadence:calls:r2", "frame", '{"type": "speak.end", "utterance_id": "u1"}'),
        ("cadence:calls:r2", "binary", None),
        ("cadence:calls:r2", "detach", None),
    ]


async def test_the_owners_events_outlive_a_failed_publish() -> None:
    """The call's events to a relayed agent: a publish that fails while the store is away is sent
    once it is back, instead of ending the agent's link on the owner."""
    store = BlinkingStore()
    sink = _LinkSink(router_on(store), "r2", "l1")
    store.blink()
    await asyncio.wait_for(sink.send_text('{"type": "utterance.started"}'), 2.0)
    assert store.failures >= 1
    assert [(m["op"], m["link"], m["text"]) for m in store.published] == [
        ("event", "l1", '{"type": "utterance.started"}')
    ]


async def test_a_store_away_past_the_link_deadline_ends_the_relay_as_a_lost_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store does not come back: the frame's publish gives up after LINK_DEAD_S, and the agent
    hears what a silent owner gives it (`call_lost`, `call.ended`, close 1011), not a bare close."""
    monkeypatch.setattr(calls, "LINK_DEAD_S", 0.5)
    store = BlinkingStore()
    router = router_on(store)
    sent: list[dict[str, Any]] = []
    closed: list[int] = []
    websocket = SimpleNamespace(
        scope={},  # no credentials: the relay attaches the agent as anonymous
        send_text=lambda text: _append(sent, json.loads(text)),
        close=lambda code=1000, reason="": _append(closed, code),
    )
    frames: asyncio.Queue[str | bytes | None] = asyncio.Queue()
    relay = asyncio.create_task(router._relay(websocket, "CA1", "r2", frames))  # type: ignore[arg-type]
    try:
        while not store.published:  # noqa: ASYNC110 (the attach, then the owner's answer)
            await asyncio.sleep(0.01)
        link_id = store.published[0]["link"]
        router._dispatch(router.channel, {"op": "attached", "link": link_id})
        await asyncio.sleep(0.05)
        store.blink(forever=True)
        frames.put_nowait('{"type": "speak.cancel"}')
        # the owner's pings go on reaching this side (its subscription outlived the blink), so
        # the frame's publish alone can end the link
        for _ in range(40):
            if relay.done():
                break
            router._dispatch(router.channel, {"op": "ping", "link": link_id})
            await asyncio.sleep(0.05)
        assert relay.done()
    finally:
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay
    assert [m["type"] for m in sent] == ["error", "call.ended"]
    assert sent[0]["code"] == "call_lost" and closed == [1011]


async def _append(items: list[Any], item: Any) -> None:
    items.append(item)


async def test_a_twilio_event_whose_field_is_not_an_object_is_dropped_alone(
    espeak_gateway: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A `media`, `mark` or `dtmf` whose field is a string, list or number: logged and ignored; the
    media stream, the call and the events after it go on."""
    sid = "CA-malformed-fields"
    caplog.set_level(logging.WARNING, logger="cadence.twilio")
    async with TwilioSimulator(twilio_url(espeak_gateway), call_sid=sid) as sim:
        async with agent_for(espeak_gateway, sid) as agent:
            await agent.until("call.started")
            for event, body in (("media", "not an object"), ("mark", ["u1/end"]), ("dtmf", 7)):
                await sim._send({"event": event, "streamSid": sim.stream_sid, event: body})
            await sim.dtmf("5")
            assert (await agent.until("dtmf"))["digit"] == "5"
            await agent.say("u1", "Still on the line.")
            await agent.until("utterance.played", utterance_id="u1")
            assert [m["digit"] for m in agent.of_type("dtmf")] == ["5"]
            assert not agent.of_type("call.ended") and not agent.of_type("error")
    logged = [r.getMessage() for r in caplog.records if r.name == "cadence.twilio"]
    assert sum("is not an object" in line for line in logged) == 3


async def test_a_start_whose_custom_parameters_are_not_an_object_still_starts_the_call(
    espeak_gateway: RunningGateway,
) -> None:
    """`customParameters` as a string: no parameters, and the call goes on with the defaults."""
    sid = "CA-malformed-start"
    oops: Any = "voice=x"
    async with TwilioSimulator(twilio_url(espeak_gateway), call_sid=sid, custom_parameters=oops):
        async with agent_for(espeak_gateway, sid) as agent:
            await agent.until("call.started")
            await agent.say("u1", "Still on the line.")
            await agent.until("utterance.played", utterance_id="u1")
            assert not agent.of_type("error")
