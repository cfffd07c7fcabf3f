"""A phone call speaks for the key of its agent (the control channel's credentials), over loopback
against real uvicorn: that key's registered voices speak, another key's voice answers on the
control channel exactly as a voice that does not exist does (`error` `unknown_voice`), whether the
voice comes from the stream's `<Parameter name="voice">` or from the agent's `session.start`, and
a voice-scoped token on the control channel speaks only its voices, as on `/v1/stream`."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.test_voice_ownership import NO_SUCH_VOICE, Keys, bearer, keys, register  # noqa: F401
from tests.gateway.twilio.conftest import Agent, agent_for
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)


def new_call_sid() -> str:
    return f"CA{uuid.uuid4().hex}"


async def outcome(agent: Agent, timeout_s: float = 15.0) -> dict[str, Any]:
    """Say utterance u1; its first `error` or `utterance.started`."""
    await agent.say("u1", "Hello there.")
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for message in agent.messages:
            if message.get("utterance_id") == "u1" and message["type"] in ("error", "utterance.started"):
                return message
        await asyncio.sleep(0.02)
    raise AssertionError(f"no answer for u1: {agent.messages}")


async def call_outcome(
    gw: RunningGateway, stream_key: str, agent_credential: str, *, parameter: str | None, start: str | None
) -> dict[str, Any]:
    """Start a call (the stream authenticated with `stream_key`, its voice `parameter`), attach an
    agent with `agent_credential` (its session.start voice `start`) and say one utterance."""
    call_sid = new_call_sid()
    params = {"voice": parameter} if parameter is not None else {}
    url = f"ws://127.0.0.1:{gw.port}/v1/twilio?token={stream_key}"
    async with TwilioSimulator(url, call_sid=call_sid, custom_parameters=params):
        async with agent_for(gw, call_sid, agent_credential) as agent:
            await agent.until("call.started")
            if start is not None:
                await agent.send(type="session.start", voice=start)
            return await outcome(agent)


def refusal(error: dict[str, Any], voice: str) -> tuple[str, str]:
    assert error["type"] == "error", error
    return str(error["code"]), str(error["message"]).replace(voice, "<id>")


@pytest.mark.parametrize("where", ["parameter", "session.start"])
async def test_a_call_speaks_only_its_agents_registered_voices(keys: Keys, where: str) -> None:  # noqa: F811
    auth, key_a, key_b = keys
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            voice = await register(http, key_a)

        def voice_at(chosen: str) -> dict[str, str | None]:
            return (
                {"parameter": chosen, "start": None}
                if where == "parameter"
                else {"parameter": None, "start": chosen}
            )

        own = await call_outcome(gw, key_a, key_a, **voice_at(voice))
        assert own["type"] == "utterance.started", own
        streams_before = len(engine.streams)
        # key b's agent, on its own key's stream (a stream of key a's is not key b's to control,
        # tests/gateway/twilio/test_stream_authentication.py): what a missing voice gets
        foreign = await call_outcome(gw, key_b, key_b, **voice_at(voice))
        missing = await call_outcome(gw, key_b, key_b, **voice_at(NO_SUCH_VOICE))
        assert refusal(foreign, voice) == refusal(missing, NO_SUCH_VOICE)
        assert refusal(foreign, voice)[0] == "unknown_voice"
        assert len(engine.streams) == streams_before  # the engine never spoke it for key b


async def test_a_voice_scoped_token_speaks_only_its_voices_on_a_call(keys: Keys) -> None:  # noqa: F811
    auth, key, _ = keys
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            r = await http.post("/v1/tokens", json={"voices": ["alice"]}, headers=bearer(key))
            token = r.json()["token"]
        allowed = await call_outcome(gw, key, token, parameter=None, start="alice")
        assert allowed["type"] == "utterance.started", allowed
        refused = await call_outcome(gw, key, token, parameter="bob", start=None)
        assert (refused["type"], refused.get("code")) == ("error", "unauthorized"), refused
