"""A call's `webhook_url` stream parameter is held to the rules of `session.start`'s: an http:// or
https:// URL of at most 2048 characters. One that breaks them is not used, and the agent hears
why as the control channel's `error` `invalid_message`, over real uvicorn on loopback."""

from __future__ import annotations

import asyncio

import pytest

from engine.espeak.engine import EspeakEngine
from gateway.webhooks import SECRET_ENV
from tests.gateway.twilio.conftest import agent_for, twilio_url
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.gateway.twilio.test_twilio import LONG, _speak_and_wait_for_audio
from tests.integration.conftest import run_gateway
from tests.integration.test_webhooks import Receiver, receiver  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("shape", ["too_long", "not_http"])
async def test_a_stream_webhook_url_that_breaks_the_rules_is_refused(
    receiver: Receiver,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "twilio-secret")
    # the long one reaches the receiver all the same (its path is ignored there): were it kept,
    # the interruption would be delivered
    url = receiver.url + "/" + "a" * 2048 if shape == "too_long" else "ftp" + receiver.url[4:]
    sid = f"CA-bad-hook-{shape}"
    with run_gateway(EspeakEngine()) as gateway:
        params = {"webhook_url": url}
        async with TwilioSimulator(twilio_url(gateway), call_sid=sid, custom_parameters=params) as sim:
            async with agent_for(gateway, sid) as agent:
                error = await agent.until("error")
                await _speak_and_wait_for_audio(agent, sim, LONG, after_s=0.6)
                await agent.send(type="speak.cancel", utterance_id="u1")
                await agent.until("utterance.interrupted", utterance_id="u1")
                await asyncio.sleep(0.5)
    assert error["code"] == "invalid_message", error
    assert "webhook_url" in error["message"]
    assert not receiver.got


async def test_a_valid_stream_webhook_url_raises_no_error(
    receiver: Receiver,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "twilio-secret")
    sid = "CA-good-hook"
    with run_gateway(EspeakEngine()) as gateway:
        params = {"webhook_url": receiver.url + "/" + "a" * (2048 - len(receiver.url) - 1)}
        async with TwilioSimulator(twilio_url(gateway), call_sid=sid, custom_parameters=params) as sim:
            async with agent_for(gateway, sid) as agent:
                await _speak_and_wait_for_audio(agent, sim, LONG, after_s=0.6)
                await agent.send(type="speak.cancel", utterance_id="u1")
                await agent.until("utterance.interrupted", utterance_id="u1")
    assert not agent.of_type("error")
    assert len(receiver.wait(1)) == 1
