"""Twilio's media stream authenticates with keys configured, over loopback against real uvicorn:
Twilio sends no Authorization header and drops query strings from the `<Stream>` url, so the
credential comes as `<Parameter name="token">` in `start.customParameters`. A good token is served
and speaks, a bad or missing one closes 1008 and registers nothing, and the token never reaches
the agent. The call then belongs to that key: another key's control channel is answered as for a
call that does not exist, and a token of the same key controls it."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
import websockets
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection

from gateway.twilio import TwilioGateway
from tests.fakes import FakeEngine
from tests.gateway.test_voice_ownership import Keys, bearer, keys  # noqa: F401 (a fixture)
from tests.gateway.twilio.conftest import Agent, agent_for
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)

QUIET_S = 1.0  # how long a refused or unknown call is watched for anything reaching anyone


def new_call_sid() -> str:
    return f"CA{uuid.uuid4().hex}"


def twilio_of(gw: RunningGateway) -> TwilioGateway:
    app = gw.server.config.app
    assert isinstance(app, Starlette)
    twilio: TwilioGateway = app.state.twilio
    return twilio


def stream_url(gw: RunningGateway) -> str:
    return f"ws://127.0.0.1:{gw.port}/v1/twilio"  # as Twilio connects: no header, no query string


async def mint(gw: RunningGateway, key: str) -> str:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        r = await http.post("/v1/tokens", json={"ttl_s": 300}, headers=bearer(key))
        r.raise_for_status()
        return str(r.json()["token"])


async def closed_with(sim: TwilioSimulator) -> tuple[int | None, str | None]:
    assert sim._ws is not None
    await asyncio.wait_for(sim._ws.wait_closed(), 10)
    return sim._ws.close_code, sim._ws.close_reason


async def speaks(agent: Agent, sim: TwilioSimulator) -> None:
    """The agent's utterance is admitted and its audio reaches the line."""
    await agent.say("u1", "Hello there.")
    await agent.until("utterance.started", utterance_id="u1")
    await agent.until("utterance.done", utterance_id="u1")
    assert sim.log.media_in


@pytest.mark.parametrize("credential", ["key", "token"])
async def test_a_stream_authenticated_by_its_token_parameter_is_served_and_speaks(
    keys: Keys,  # noqa: F811
    credential: str,
) -> None:
    auth, key, _ = keys
    with run_gateway(FakeEngine(), auth=auth) as gw:
        secret = key if credential == "key" else await mint(gw, key)
        call_sid = new_call_sid()
        params = {"token": secret, "voice": "alice"}
        async with TwilioSimulator(stream_url(gw), call_sid=call_sid, custom_parameters=params) as sim:
            async with agent_for(gw, call_sid, key) as agent:
                started = await agent.until("call.started")
                await speaks(agent, sim)
    assert started["custom_parameters"] == {"voice": "alice"}  # the token stays with Cadence
    assert secret not in str(agent.messages)


@pytest.mark.parametrize("token", [None, "", "forged.token", "cadence_alpha_not-the-secret"])
async def test_a_stream_without_a_good_token_closes_1008_and_registers_nothing(
    keys: Keys,  # noqa: F811
    token: str | None,
) -> None:
    auth, key, _ = keys
    with run_gateway(FakeEngine(), auth=auth) as gw:
        call_sid = new_call_sid()
        async with agent_for(gw, call_sid, key) as agent:  # the agent came first, and waits
            params = {"voice": "alice"} if token is None else {"token": token}
            sim = TwilioSimulator(stream_url(gw), call_sid=call_sid, custom_parameters=params)
            await sim.__aenter__()
            try:
                code, reason = await closed_with(sim)
            finally:
                await sim.stop()
            await asyncio.sleep(QUIET_S)
            assert agent.messages == []  # no call.started, nothing from the refused stream's media
        assert code == 1008 and reason
        assert not twilio_of(gw).streams


async def test_media_before_start_is_ignored_and_the_stream_must_bring_a_token(
    keys: Keys,  # noqa: F811
) -> None:
    auth, _, _ = keys
    with run_gateway(FakeEngine(), auth=auth) as gw:
        ws: ClientConnection = await websockets.connect(stream_url(gw))
        await ws.send('{"event": "connected", "protocol": "Call", "version": "1.0.0"}')
        await ws.send('{"event": "media", "media": {"payload": "//8="}}')
        await asyncio.sleep(0.2)
        assert ws.close_code is None  # still waiting for `start`
        await ws.send('{"event": "start", "start": {"callSid": "CA1", "customParameters": {}}}')
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == 1008 and "token" in (ws.close_reason or "")


async def test_an_upgrade_credential_still_authenticates_a_stream(keys: Keys) -> None:  # noqa: F811
    auth, key, _ = keys
    with run_gateway(FakeEngine(), auth=auth) as gw:
        call_sid = new_call_sid()
        async with TwilioSimulator(f"{stream_url(gw)}?token={key}", call_sid=call_sid) as sim:
            async with agent_for(gw, call_sid, key) as agent:
                await agent.until("call.started")
                await speaks(agent, sim)


async def unknown_call_answer(gw: RunningGateway, credential: str, call_sid: str) -> list[str]:
    """What an agent hears in QUIET_S after saying one utterance on `call_sid`."""
    async with agent_for(gw, call_sid, credential) as agent:
        await agent.say("u1", "Hello there.")
        await asyncio.sleep(QUIET_S)
        assert agent.ws.close_code is None
        return sorted({m["type"] for m in agent.messages})


async def test_another_keys_agent_is_answered_as_for_an_unknown_call(keys: Keys) -> None:  # noqa: F811
    auth, key_a, key_b = keys
    with run_gateway(FakeEngine(), auth=auth) as gw:
        call_sid = new_call_sid()
        params = {"token": await mint(gw, key_a)}
        async with TwilioSimulator(stream_url(gw), call_sid=call_sid, custom_parameters=params) as sim:
            foreign = await unknown_call_answer(gw, key_b, call_sid)
            unknown = await unknown_call_answer(gw, key_b, new_call_sid())
            assert foreign == unknown and "call.started" not in foreign
            assert not sim.log.media_in  # key b's text never reached the line
            async with agent_for(gw, call_sid, await mint(gw, key_a)) as owner:  # a token of key a
                await owner.until("call.started")
                await speaks(owner, sim)


async def test_another_keys_waiting_agent_does_not_get_the_call(keys: Keys) -> None:  # noqa: F811
    auth, key_a, key_b = keys
    with run_gateway(FakeEngine(), auth=auth) as gw:
        call_sid = new_call_sid()
        async with agent_for(gw, call_sid, key_b) as squatter, agent_for(gw, call_sid, key_a) as owner:
            await asyncio.sleep(0.1)  # both wait for the stream
            params = {"token": key_a}
            async with TwilioSimulator(stream_url(gw), call_sid=call_sid, custom_parameters=params) as sim:
                await owner.until("call.started")
                await speaks(owner, sim)
                await asyncio.sleep(0.2)
            assert "call.started" not in {m["type"] for m in squatter.messages}


def test_the_token_parameter_is_stripped_from_what_the_call_keeps() -> None:
    from gateway.twilio.endpoints import without_token

    start: dict[str, Any] = {
        "event": "start",
        "start": {"callSid": "CA1", "customParameters": {"token": "secret", "voice": "alice"}},
    }
    assert without_token(start)["start"]["customParameters"] == {"voice": "alice"}
    assert start["start"]["customParameters"]["token"] == "secret"  # the message itself is left alone
