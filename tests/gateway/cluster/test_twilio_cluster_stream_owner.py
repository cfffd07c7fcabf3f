"""A call belongs to the key its media stream authenticated with, across replicas (two `cadence
serve` replicas with eSpeak sharing a real redis-server): the stream authenticates, as Twilio's
must, with the `token` parameter of its `start`; the call directory names its key; a token of
that key controls it from either replica, and another key's control channel, on either replica,
gets what a callSid that does not exist gets (`call_not_found` after the wait, close 1008)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.cluster.harness import Cluster, tools_available, two_keyed_replicas
from tests.gateway.cluster.test_twilio_cluster import agent_at, directory
from tests.gateway.twilio.simulator import TwilioSimulator

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]

CALL_WAIT_S = 2.0
Keys = tuple[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Keys]]:
    with two_keyed_replicas(
        tmp_path_factory.mktemp("twilio-cluster-owner"),
        {"CADENCE_TOKEN_SECRET": "shared-secret", "CADENCE_CALL_WAIT_S": str(CALL_WAIT_S)},
    ) as made:
        yield made


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def ws_base(http: str) -> str:
    return http.replace("http://", "ws://")


async def mint(c: Cluster, key: str) -> str:
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{c.replicas[0].http}/v1/tokens", json={"ttl_s": 300}, headers=bearer(key))
        r.raise_for_status()
        return str(r.json()["token"])


async def refusal(http: str, credential: str, call_sid: str) -> tuple[str, str, int | None]:
    """What a control channel gets: its error's code and message (the callSid masked), its close."""
    async with agent_at(http, credential, call_sid) as agent:
        error = await agent.until("error", timeout_s=CALL_WAIT_S + 5)
        await agent.ws.wait_closed()
        assert "call.started" not in {m["type"] for m in agent.messages}
        return error["code"], error["message"].replace(call_sid, "<sid>"), agent.ws.close_code


async def test_a_stream_authenticated_by_its_token_parameter_is_controlled_only_by_its_key(
    cluster: tuple[Cluster, Keys],
) -> None:
    c, (key_a, key_b) = cluster
    r1, r2 = c.replicas
    call_sid = f"CA{uuid.uuid4().hex}"
    stream_token = await mint(c, key_a)
    params = {"token": stream_token, "voice": "Vivian"}
    async with TwilioSimulator(
        f"{ws_base(r1.http)}/v1/twilio", call_sid=call_sid, custom_parameters=params
    ) as sim:
        async with agent_at(r2.http, await mint(c, key_a), call_sid) as agent:  # relayed to r1
            started = await agent.until("call.started")
            assert started["custom_parameters"] == {"voice": "Vivian"}
            assert directory(c, call_sid) == {"state": "live", "replica": "r1", "key": "alpha"}
            await agent.say("u1", "Hello there.")
            await agent.until("utterance.done", utterance_id="u1", timeout_s=30)
            assert sim.log.media_in
            assert stream_token not in str(agent.messages)
        unknown = await refusal(r2.http, key_b, f"CA{uuid.uuid4().hex}")
        assert unknown[0] == "call_not_found" and unknown[2] == 1008
        for replica in (r2, r1):  # relayed, and on the replica holding the call
            assert await refusal(replica.http, key_b, call_sid) == unknown
    ended = directory(c, call_sid)
    assert ended is not None and ended["state"] == "ended" and ended["key"] == "alpha"


async def test_a_stream_with_a_bad_token_is_refused_and_never_enters_the_directory(
    cluster: tuple[Cluster, Keys],
) -> None:
    c, _ = cluster
    call_sid = f"CA{uuid.uuid4().hex}"
    url = f"{ws_base(c.replicas[0].http)}/v1/twilio"
    sim = TwilioSimulator(url, call_sid=call_sid, custom_parameters={"token": "forged.token"})
    await sim.__aenter__()
    try:
        assert sim._ws is not None
        await sim._ws.wait_closed()
        assert sim._ws.close_code == 1008
    finally:
        await sim.stop()
    assert directory(c, call_sid) is None
