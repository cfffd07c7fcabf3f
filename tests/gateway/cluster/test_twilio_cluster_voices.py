"""A call's agent relayed to the replica holding the call speaks for its own credentials there
(two `cadence serve` replicas with eSpeak sharing a real redis-server): a voice-scoped token's
agent, connected to the other replica, speaks its voice and is refused any other with
`unauthorized`; the relay's `attach` carries the agent's key id and voice list to the owner."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import websockets

from gateway.auth import Principal
from gateway.cluster.calls import principal_from_link, principal_on_link
from tests.gateway.cluster.harness import Cluster, tools_available, two_keyed_replicas
from tests.gateway.twilio.conftest import Agent
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.gateway.twilio.test_call_voice_ownership import outcome

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]

Keys = tuple[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Keys]]:
    with two_keyed_replicas(
        tmp_path_factory.mktemp("twilio-cluster-voices"), {"CADENCE_TOKEN_SECRET": "shared-secret"}
    ) as made:
        yield made


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


@contextlib.asynccontextmanager
async def relayed_call(c: Cluster, stream_key: str, agent_credential: str) -> AsyncIterator[Agent]:
    """A call whose stream is held by r1 and whose agent connects to r2 (relayed to r1)."""
    r1, r2 = c.replicas
    call_sid = f"CA{uuid.uuid4().hex}"
    media = r1.http.replace("http://", "ws://") + f"/v1/twilio?token={stream_key}"
    async with TwilioSimulator(media, call_sid=call_sid):
        url = r2.http.replace("http://", "ws://") + f"/v1/twilio/control/{call_sid}"
        ws = await websockets.connect(url, additional_headers=bearer(agent_credential), max_size=None)
        agent = Agent(ws)
        try:
            await agent.until("call.started")
            yield agent
        finally:
            await agent.close()


async def relayed_outcome(c: Cluster, stream_key: str, agent_credential: str, voice: str) -> dict[str, Any]:
    async with relayed_call(c, stream_key, agent_credential) as agent:
        await agent.send(type="session.start", voice=voice)
        return await outcome(agent)


async def test_a_relayed_voice_scoped_agent_speaks_only_its_voices(cluster: tuple[Cluster, Keys]) -> None:
    c, (key, _) = cluster
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{c.replicas[0].http}/v1/tokens", json={"voices": ["Vivian"]}, headers=bearer(key)
        )
        token = r.json()["token"]
    allowed = await relayed_outcome(c, key, token, "Vivian")
    assert allowed["type"] == "utterance.started", allowed
    refused = await relayed_outcome(c, key, token, "Serena")
    assert (refused["type"], refused.get("code")) == ("error", "unauthorized"), refused


@pytest.mark.parametrize(
    "principal",
    [Principal("alpha"), Principal("alpha", frozenset({"Vivian", "v_0123456789abcdef"}), via_token=True)],
)
def test_the_relay_carries_the_agents_key_and_voices(principal: Principal) -> None:
    attach = {"op": "attach", "link": "l1", "call": "CA1", "relay": "r2"}
    assert (
        principal_from_link(json.loads(json.dumps({**attach, **principal_on_link(principal)}))) == principal
    )


def test_an_attach_without_credentials_speaks_for_no_key() -> None:
    principal = principal_from_link({"op": "attach", "link": "l1", "call": "CA1", "relay": "r2"})
    assert principal.key_id == "" and principal.voices is None
