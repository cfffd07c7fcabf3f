"""speak.pause / speak.unpause on a phone call: `WS /v1/twilio` against the Twilio simulator, eSpeak
on real uvicorn, the agent on the control channel. A pause clears Twilio's buffer; the unpause sends
the audio again from the fence (the position the marks give), sample for sample what the call
would have sent without the pause; a pause that is not undone becomes an interruption."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from engine.espeak.engine import EspeakEngine
from tests.gateway.twilio.conftest import agent_for, twilio_url
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.gateway.twilio.test_twilio import LONG, _speak_and_wait_for_audio, _word_marks
from tests.integration.conftest import RunningGateway, run_gateway
from tests.integration.recording_engine import RecordingEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def recorded_gateway() -> Iterator[RunningGateway]:
    with run_gateway(RecordingEngine(EspeakEngine())) as running:
        yield running


def reference(gateway: RunningGateway, call_sid: str, uid: str) -> bytes:
    engine = gateway.engine
    assert isinstance(engine, RecordingEngine)
    return engine.expected_payload(f"twilio/{call_sid}/{uid}", "mulaw", 8000)


async def test_pause_clears_the_line_and_unpause_sends_again_from_the_fence(
    recorded_gateway: RunningGateway,
) -> None:
    sid = "CA-pause"
    async with TwilioSimulator(twilio_url(recorded_gateway), call_sid=sid) as sim:
        async with agent_for(recorded_gateway, sid) as agent:
            await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.2)
            await agent.send(type="speak.pause", utterance_id="u1")
            paused = await agent.until("utterance.paused", utterance_id="u1")
            await asyncio.sleep(0.6)
            silent_until = sim.now()
            await agent.send(type="speak.unpause", utterance_id="u1")
            await agent.until("utterance.unpaused", utterance_id="u1")
            await agent.until("utterance.played", utterance_id="u1", timeout_s=30)
    [clear_at] = sim.log.clears
    assert paused["by"] == "agent" and paused["position_source"] == "marks"
    # the last word heard: from the marks back before the clear, as for an interruption
    back = _word_marks([e.name for e in sim.log.echoes if not e.after_clear and e.at < clear_at], "u1")
    last = paused["last_word"]
    assert last is not None and back and last["index"] <= back[-1]
    assert last["end_ms"] <= paused["played_ms"]
    assert paused["spoken_text"] + paused["unspoken_text"] == LONG
    # no media between the clear and the unpause; then the audio from the fence on, exactly
    assert not [t for t, _ in sim.log.media_in if clear_at < t < silent_until]
    assert not [p for p in sim.log.played if clear_at + 0.021 < p.at < silent_until]  # the caller heard none
    before = b"".join(a for t, a in sim.log.media_in if t <= clear_at)
    after = b"".join(a for t, a in sim.log.media_in if t > clear_at)
    whole = reference(recorded_gateway, sid, "u1")
    fence = paused["played_ms"] * 8
    assert before == whole[: len(before)] and fence < len(before)
    assert after == whole[fence:]
    # every word is marked again after the fence, and the utterance ends once
    names = [n for t, n in sim.log.marks_in if t > clear_at]
    assert names[-1] == "u1/end" and _word_marks(names, "u1")[0] == paused["last_word"]["index"] + 1
    assert len(agent.of_type("utterance.done")) == 1 and not agent.of_type("utterance.interrupted")


async def test_a_pause_not_undone_on_a_call_becomes_an_interruption(recorded_gateway: RunningGateway) -> None:
    sid = "CA-pause-timeout"
    async with TwilioSimulator(twilio_url(recorded_gateway), call_sid=sid) as sim:
        async with agent_for(recorded_gateway, sid) as agent:
            await agent.until("call.started")
            await agent.send(type="session.start", language="English", pause_timeout_ms=500)
            await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.0)
            await agent.send(type="speak.pause", utterance_id="u1")
            paused = await agent.until("utterance.paused", utterance_id="u1")
            interrupted = await agent.until("utterance.interrupted", utterance_id="u1", timeout_s=5)
            await agent.send(type="speak.unpause", utterance_id="u1")
            error = await agent.until("error", code="not_paused")
            await asyncio.sleep(0.2)
    assert interrupted == {**paused, "type": "utterance.interrupted"}
    assert error["utterance_id"] == "u1" and len(sim.log.clears) == 1
    [clear_at] = sim.log.clears
    assert not [t for t, _ in sim.log.media_in if t > clear_at]


async def test_a_pause_of_an_utterance_not_yet_on_the_line_needs_no_clear(
    recorded_gateway: RunningGateway,
) -> None:
    sid = "CA-pause-queued"
    async with agent_for(recorded_gateway, sid) as agent:
        await agent.send(type="session.start", language="English")
        await agent.say("u1", "Wait for it.")  # before Twilio's stream: nothing on the line yet
        await agent.until("utterance.started", utterance_id="u1")
        await agent.send(type="speak.pause", utterance_id="u1")
        paused = await agent.until("utterance.paused", utterance_id="u1")
        async with TwilioSimulator(twilio_url(recorded_gateway), call_sid=sid) as sim:
            await agent.until("call.started")
            await asyncio.sleep(0.3)
            assert sim.log.media_in == []  # the line waits behind the paused utterance
            await agent.send(type="speak.unpause", utterance_id="u1")
            await agent.until("utterance.played", utterance_id="u1")
    assert paused["played_ms"] == 0 and paused["last_word"] is None and not sim.log.clears
    assert b"".join(a for _, a in sim.log.media_in) == reference(recorded_gateway, sid, "u1")
