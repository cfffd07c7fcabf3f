"""Twilio calls across two `cadence serve` replicas (eSpeak) sharing a real redis-server, with nginx
in front: Twilio's media stream on one replica, the agent's control channel on the other. The
agent must see what it sees on one replica (docs/twilio.md): the same events in the same order,
interruption reports with the right last word, webhooks sent once. Also: the agent first, a late
agent, a second agent refused, the agent leaving, and the owner replica killed mid-call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync
import websockets

from gateway.auth import new_key
from gateway.webhooks import SECRET_ENV, SIGNATURE_HEADER, verify
from tests.gateway.cluster.harness import Cluster, Replica, tools_available
from tests.gateway.twilio.conftest import Agent
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.gateway.twilio.test_twilio import LONG, _check_barge_in, _speak_and_wait_for_audio
from tests.integration.test_webhooks import Receiver, receiver  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not tools_available(), reason="needs redis-server and nginx (scripts/test installs them)"
    ),
]

SECRET = "cluster-twilio-secret"
CALL_WAIT_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    workdir: Path = tmp_path_factory.mktemp("twilio-cluster")
    key, stored = new_key("agent", iterations=1_000)
    keys_file = workdir / "keys"
    keys_file.write_text(stored.line() + "\n")
    c = Cluster(workdir)
    try:
        c.start_redis()
        c.start_replicas(
            3, "espeak", keys_file, env_extra={SECRET_ENV: SECRET, "CADENCE_CALL_WAIT_S": str(CALL_WAIT_S)}
        )
        c.start_nginx()
        yield c, key
    finally:
        c.stop()


def media_url(base: str, key: str) -> str:
    return base.replace("http://", "ws://") + f"/v1/twilio?token={key}"


@contextlib.asynccontextmanager
async def agent_at(base: str, key: str, call_sid: str) -> AsyncIterator[Agent]:
    url = base.replace("http://", "ws://") + f"/v1/twilio/control/{call_sid}"
    ws = await websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None)
    agent = Agent(ws)
    try:
        yield agent
    finally:
        await agent.close()


def directory(c: Cluster, call_sid: str) -> dict[str, Any] | None:
    store = redis_sync.Redis.from_url(c.redis_url)
    try:
        raw = store.get(f"cadence:call:{call_sid}")
        return json.loads(raw) if raw is not None else None
    finally:
        store.close()


def types(agent: Agent) -> list[str]:
    return [m["type"] for m in agent.messages]


async def until_closed(agent: Agent, timeout_s: float = 10.0) -> None:
    await asyncio.wait_for(agent.ws.wait_closed(), timeout_s)


async def test_agent_on_another_replica_barges_in_and_the_owner_sends_one_webhook(
    cluster: tuple[Cluster, str],
    receiver: Receiver,  # noqa: F811
) -> None:
    c, key = cluster
    r1, r2, _ = c.replicas
    params = {"webhook_url": receiver.url}
    async with TwilioSimulator(media_url(r1.http, key), call_sid="CA-cross", custom_parameters=params) as sim:
        async with agent_at(r2.http, key, "CA-cross") as agent:
            started = await agent.until("call.started")
            assert started["stream_sid"] == sim.stream_sid and started["custom_parameters"] == params
            assert directory(c, "CA-cross") == {"state": "live", "replica": "r1", "key": "agent"}
            await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.1)
            await agent.send(type="speak.cancel", utterance_id="u1")
            report = await agent.until("utterance.interrupted", utterance_id="u1")
            await agent.send(type="speak.cancel", utterance_id="u1")  # repeated: answered, not re-delivered
            await agent.until("utterance.interrupted", utterance_id="u1", timeout_s=5)
            while len([m for m in agent.messages if m["type"] == "utterance.interrupted"]) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.15)
            await sim.stop()  # the call ends: the relayed agent hears it, then its socket closes
            await until_closed(agent)
    assert report["by"] == "agent"
    _check_barge_in(sim, agent, report, LONG)
    # the same events, in the order a local agent gets them
    seen = types(agent)
    assert seen[:2] == ["call.started", "utterance.started"]
    assert set(seen[2 : seen.index("utterance.interrupted")]) <= {"words", "utterance.done"}
    assert agent.messages[-1] == {"type": "call.ended", "call_sid": "CA-cross", "reason": "stop"}
    # the owner sent the webhook, once
    deadline = time.monotonic() + 5
    while not receiver.got and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    [delivery] = receiver.got
    assert verify(SECRET, delivery.headers[SIGNATURE_HEADER], delivery.body)
    body = json.loads(delivery.body)
    assert body["call_sid"] == "CA-cross" and body["last_word"] == report["last_word"]
    ended = directory(c, "CA-cross")
    assert ended is not None and ended["state"] == "ended" and ended["replica"] == "r1"
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{r2.http}/metrics", headers={"Authorization": f"Bearer {key}"})).text
    relayed = re.search(r'(?m)^cadence_twilio_control_total\{outcome="relayed"\} ([0-9.]+)$', metrics)
    assert relayed is not None and float(relayed.group(1)) >= 1


async def test_caller_barge_in_dtmf_and_speech_events_reach_a_relayed_agent(
    cluster: tuple[Cluster, str],
) -> None:
    c, key = cluster
    r1, r2, _ = c.replicas
    async with TwilioSimulator(media_url(r2.http, key), call_sid="CA-caller") as sim:
        async with agent_at(r1.http, key, "CA-caller") as agent:
            await agent.until("call.started")  # (events before an agent attaches are not kept for it)
            await sim.dtmf("5")
            assert (await agent.until("dtmf"))["digit"] == "5"
            await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.3)
            sim.caller_dbfs = -20.0
            report = await agent.until("utterance.interrupted", utterance_id="u1")
            await agent.until("speech.started")
            sim.caller_dbfs = None
            await agent.until("speech.stopped")
            await sim.stop()
            await until_closed(agent)
    assert report["by"] == "caller"
    _check_barge_in(sim, agent, report, LONG)
    assert agent.messages[-1] == {"type": "call.ended", "call_sid": "CA-caller", "reason": "stop"}


async def test_agent_first_then_twilio_on_another_replica(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    r1, r2, _ = c.replicas
    async with agent_at(r2.http, key, "CA-first") as agent:
        await agent.send(type="session.start", language="English")
        await agent.say("u1", "First things first.")  # held until the stream starts, then relayed
        await asyncio.sleep(0.5)
        assert agent.messages == []  # nothing to say yet: no call
        async with TwilioSimulator(media_url(r1.http, key), call_sid="CA-first") as sim:
            await agent.until("utterance.played", utterance_id="u1")
            await agent.say("u2", "Then the second.")
            await agent.until("utterance.played", utterance_id="u2")
    seen = types(agent)
    assert seen[0] == "call.started" and seen.count("utterance.played") == 2
    names = sim.log.played_marks()
    assert names[-1] == "u2/end" and names.index("u1/end") < names.index("u2/w0")


async def test_agent_first_then_twilio_on_the_same_replica(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    r1, _, _ = c.replicas
    async with agent_at(r1.http, key, "CA-same") as agent:
        await agent.say("u1", "Right here.")
        async with TwilioSimulator(media_url(r1.http, key), call_sid="CA-same"):
            await agent.until("utterance.played", utterance_id="u1")
    assert types(agent)[:2] == ["call.started", "utterance.started"]


async def test_no_stream_a_late_agent_and_a_second_agent(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    r1, r2, _ = c.replicas
    began = time.monotonic()
    async with agent_at(r2.http, key, "CA-never") as agent:
        error = await agent.until("error", timeout_s=CALL_WAIT_S + 5)
        await until_closed(agent)
    assert error["code"] == "call_not_found" and time.monotonic() - began >= CALL_WAIT_S - 0.1
    assert agent.ws.close_code == 1008
    async with TwilioSimulator(media_url(r1.http, key), call_sid="CA-busy"):
        async with agent_at(r1.http, key, "CA-busy") as first:
            await first.until("call.started")
            async with agent_at(r2.http, key, "CA-busy") as second:
                await until_closed(second)
            assert second.ws.close_code == 1008 and second.messages == []
    async with agent_at(r2.http, key, "CA-busy") as late:  # the call has ended
        ended = await late.until("call.ended", timeout_s=5)
        await until_closed(late)
    assert ended["reason"] == "stop"


async def test_the_owner_learns_that_a_relayed_agent_left(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    r1, r2, _ = c.replicas
    async with TwilioSimulator(media_url(r1.http, key), call_sid="CA-leave") as sim:
        async with agent_at(r2.http, key, "CA-leave") as agent:
            await agent.until("call.started")
        # the owner detaches it at once (not after a ping timeout): another agent may attach
        await asyncio.sleep(0.3)
        async with agent_at(r1.http, key, "CA-leave") as again:
            await again.until("call.started", timeout_s=2)
            await again.say("u1", "Still on the line.")
            await again.until("utterance.played", utterance_id="u1")
        assert "u1/end" in sim.log.played_marks()


async def test_through_nginx(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    async with TwilioSimulator(media_url(c.front, key), call_sid="CA-front"):
        async with agent_at(c.front, key, "CA-front") as agent:
            await agent.until("call.started")
            await agent.say("u1", "Hello from behind the front.")
            await agent.until("utterance.played", utterance_id="u1")


async def test_the_owner_detaches_an_agent_whose_replica_died(cluster: tuple[Cluster, str]) -> None:
    """Kills r3 (the relay); the next test kills r1."""
    c, key = cluster
    r1, r2, r3 = c.replicas
    async with TwilioSimulator(media_url(r1.http, key), call_sid="CA-relay-dies"):
        async with agent_at(r3.http, key, "CA-relay-dies") as doomed:
            await doomed.until("call.started")
            c.kill(r3)
            killed_at = time.monotonic()
        while True:  # refused (1008: the call still has an agent) until the owner gives up on it
            async with agent_at(r2.http, key, "CA-relay-dies") as agent:
                with contextlib.suppress(TimeoutError):
                    await agent.until("call.started", timeout_s=1)
                    break
            assert time.monotonic() - killed_at < 8, "the owner kept the dead relay's agent"
            await asyncio.sleep(0.2)
        took = time.monotonic() - killed_at
    assert 2.5 < took < 8


async def test_owner_killed_mid_call_ends_the_relayed_agent(cluster: tuple[Cluster, str]) -> None:
    """Last in this module: it kills r1 (r3 is already gone)."""
    c, key = cluster
    r1, r2, _ = c.replicas
    owner: Replica = r1
    async with TwilioSimulator(media_url(owner.http, key), call_sid="CA-killed"):
        async with agent_at(r2.http, key, "CA-killed") as agent:
            await agent.until("call.started")
            await agent.say("u1", LONG)
            await agent.until("utterance.started", utterance_id="u1")
            c.kill(owner)
            killed_at = time.monotonic()
            error = await agent.until("error", timeout_s=10)
            ended = await agent.until("call.ended", timeout_s=2)
            await until_closed(agent, 2)
            took = time.monotonic() - killed_at
    assert error["code"] == "call_lost"
    assert ended == {"type": "call.ended", "call_sid": "CA-killed", "reason": "replica_lost"}
    assert agent.ws.close_code == 1011 and took < 6
