"""`WS /v1/twilio` against the Twilio simulator (real-time playback, marks, clear), with eSpeak on
real uvicorn, and the agent on `WS /v1/twilio/control/{callSid}`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import numpy as np
import pytest

from gateway.twilio import EnergyVad, TwilioOptions, frame_dbfs
from gateway.webhooks import SECRET_ENV, SIGNATURE_HEADER, verify
from tests.gateway.twilio.conftest import Agent, agent_for, twilio_url
from tests.gateway.twilio.simulator import FRAME, TwilioSimulator, frame_level_dbfs, tone_frame
from tests.integration.conftest import RunningGateway, run_gateway
from tests.integration.test_webhooks import Receiver, receiver  # noqa: F401 (a fixture)

SHORT = "Hello there, how are you today?"
LONG = (
    "This is a long answer from the agent, and it keeps on talking for a while so that the caller "
    "has plenty of time to interrupt it in the middle of a sentence."
)


def _word_marks(names: list[str], uid: str) -> list[int]:
    return [int(n.split("/w", 1)[1]) for n in names if n.startswith(f"{uid}/w")]


async def _speak_and_wait_for_audio(agent: Agent, sim: TwilioSimulator, text: str, after_s: float) -> None:
    await agent.until("call.started")
    await agent.say("u1", text)
    while sim.log.first_audio_at is None:  # noqa: ASYNC110 (the simulator's clock, polled)
        await asyncio.sleep(0.01)
    await asyncio.sleep(after_s - (sim.now() - sim.log.first_audio_at))


def _check_barge_in(sim: TwilioSimulator, agent: Agent, report: dict[str, Any], text: str) -> None:
    [clear_at] = sim.log.clears
    played = [e for e in sim.log.echoes if not e.after_clear]
    before = _word_marks([e.name for e in played if e.at < clear_at], "u1")
    surely_back = _word_marks([e.name for e in played if e.at < clear_at - 0.05], "u1")
    flushed = _word_marks([e.name for e in sim.log.echoes if e.after_clear], "u1")
    assert surely_back and flushed, "the barge-in should fall mid-utterance"
    last = report["last_word"]
    # the last word heard comes from the marks echoed before the clear: every mark back well before
    # it counts; one echoed while the clear was on its way (a race real calls have too) may not
    assert last is not None and surely_back[-1] <= last["index"] <= before[-1]
    assert last["index"] < flushed[0]  # marks flushed by the clear prove nothing
    words = agent.words("u1")
    assert words[last["index"]] == last
    assert report["spoken_text"] == text[: last["char_end"]]
    assert report["spoken_text"] + report["unspoken_text"] == text
    assert report["position_source"] == "marks"
    assert last["end_ms"] <= report["played_ms"]
    assert not [t for t, _ in sim.log.media_in if t > clear_at]  # nothing of it after the clear
    assert not [p for p in sim.log.played if p.at > clear_at + 0.021]  # the buffer was emptied


async def test_speaks_mulaw_frames_with_a_mark_after_each_word(espeak_gateway: RunningGateway) -> None:
    async with agent_for(espeak_gateway, "CA-speak") as agent:  # the agent may come first
        async with TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-speak") as sim:
            started = await agent.until("call.started")
            assert started["stream_sid"] == sim.stream_sid
            await agent.send(type="session.start", language="English")
            await agent.say("u1", SHORT)
            done = await agent.until("utterance.done", utterance_id="u1")
            await agent.until("utterance.played", utterance_id="u1")
    words = agent.words("u1")
    assert [w["text"] for w in words] == [w.strip(",?") for w in SHORT.split()]
    frames = [audio for _, audio in sim.log.media_in]
    assert all(len(f) == FRAME for f in frames[:-1]) and 0 <= len(frames[-1]) <= FRAME
    assert abs(sum(map(len, frames)) / 8 - done["duration_ms"]) <= 1
    assert max(frame_level_dbfs(f) for f in frames) > -30  # speech, not silence
    names = [n for _, n in sim.log.marks_in]
    assert names == [f"u1/w{i}" for i in range(len(words))] + ["u1/end"]
    assert sim.log.played_marks() == names and not sim.log.clears
    # each word's mark follows the media frame in which the word ends, and comes back once played
    sent = np.cumsum([0] + [len(a) for _, a in sim.log.media_in])
    arrival = [t for t, _ in sim.log.media_in]
    echo_at = {e.name: e.at for e in sim.log.echoes}
    assert sim.log.first_audio_at is not None
    for word in words:
        mark_time = dict((n, t) for t, n in sim.log.marks_in)[f"u1/w{word['index']}"]
        frames_before = sum(1 for t in arrival if t <= mark_time)
        assert sent[frames_before] >= word["end_ms"] * 8 - 8  # end_ms is rounded to the millisecond
        played_s = echo_at[f"u1/w{word['index']}"] - sim.log.first_audio_at
        assert played_s >= word["end_ms"] / 1000 - 0.045
    assert sum(len(p.audio) for p in sim.log.played) == sum(map(len, frames))


async def test_caller_speech_barges_in_and_marks_give_the_last_word(espeak_gateway: RunningGateway) -> None:
    async with TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-caller") as sim:
        async with agent_for(espeak_gateway, "CA-caller") as agent:
            await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.3)
            onset = sim.now()
            sim.caller_dbfs = -20.0
            report = await agent.until("utterance.interrupted", utterance_id="u1")
            await agent.until("speech.started")
            await asyncio.sleep(0.15)
    assert report["by"] == "caller"
    [clear_at] = sim.log.clears
    assert 0.035 <= clear_at - onset < 0.5  # three loud frames (the 60 ms attack), then at once
    _check_barge_in(sim, agent, report, LONG)


async def test_the_agent_barges_in(
    espeak_gateway: RunningGateway,
    receiver: Receiver,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "twilio-secret")
    with run_gateway(espeak_gateway.engine.__class__()) as gateway:
        params = {"webhook_url": receiver.url}
        async with TwilioSimulator(twilio_url(gateway), call_sid="CA-agent", custom_parameters=params) as sim:
            async with agent_for(gateway, "CA-agent") as agent:
                assert (await agent.until("call.started"))["custom_parameters"] == params
                await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.1)
                await agent.send(type="speak.cancel", utterance_id="u1")
                report = await agent.until("utterance.interrupted", utterance_id="u1")
                await asyncio.sleep(0.15)
    assert report["by"] == "agent"
    _check_barge_in(sim, agent, report, LONG)
    [delivery] = receiver.wait(1)
    assert verify("twilio-secret", delivery.headers[SIGNATURE_HEADER], delivery.body)
    body = json.loads(delivery.body)
    assert body["call_sid"] == "CA-agent" and body["last_word"] == report["last_word"]


async def test_a_quiet_line_does_not_barge_in(espeak_gateway: RunningGateway) -> None:
    async with TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-quiet") as sim:
        sim.caller_dbfs = -50.0  # line noise, below the -35 dBFS threshold
        async with agent_for(espeak_gateway, "CA-quiet") as agent:
            await agent.until("call.started")
            await agent.say("u1", "Just a moment.")
            await agent.until("utterance.played", utterance_id="u1")
    assert (
        not sim.log.clears
        and not agent.of_type("utterance.interrupted")
        and not agent.of_type("speech.started")
    )


async def test_dtmf_speech_events_and_stop(espeak_gateway: RunningGateway) -> None:
    params = {"vad_threshold_dbfs": "-60", "vad_hang_ms": "200"}
    async with agent_for(espeak_gateway, "CA-events") as agent:
        sim = TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-events", custom_parameters=params)
        async with sim:
            await agent.until("call.started")
            await sim.dtmf("7")
            assert (await agent.until("dtmf"))["digit"] == "7"
            sim.caller_dbfs = -50.0  # above this call's threshold
            await agent.until("speech.started")
            sim.caller_dbfs = None
            await agent.until("speech.stopped")
        ended = await agent.until("call.ended")
    assert ended["call_sid"] == "CA-events" and not sim.log.clears  # nothing was playing


async def test_control_channel_errors(espeak_gateway: RunningGateway) -> None:
    async with agent_for(espeak_gateway, "CA-errors") as agent:
        await agent.send(type="speak.resume", utterance_id="u2", from_utterance="u1")
        assert (await agent.until("error"))["code"] == "unknown_type"
        await agent.send(type="speak.end", utterance_id="nope")
        assert (await agent.until("error", code="unknown_utterance"))["utterance_id"] == "nope"


def test_energy_vad_attack_and_hang() -> None:
    vad = EnergyVad(threshold_dbfs=-35.0, attack_ms=60, hang_ms=100)
    loud = np.frombuffer(tone_frame(-20.0, 0), dtype=np.uint8)
    quiet = np.zeros(FRAME, dtype=np.int16)
    from gateway.packets import mulaw_decode

    loud_pcm = mulaw_decode(loud)
    assert abs(frame_dbfs(loud_pcm) - -20.0) < 1.0
    assert [vad.feed(loud_pcm) for _ in range(3)] == [None, None, "start"]
    assert [vad.feed(quiet) for _ in range(5)] == [None, None, None, None, "stop"]
    assert (
        vad.feed(loud_pcm) is None and vad.feed(quiet) is None and vad.feed(loud_pcm) is None
    )  # attack resets


def test_options_from_stream_parameters() -> None:
    options = TwilioOptions().with_parameters(
        {
            "vad_threshold_dbfs": "-50",
            "vad_hang_ms": "250",
            "barge_in_on_speech": "false",
            "vad_attack_ms": "x",
        }
    )
    assert options.vad_threshold_dbfs == -50.0 and options.vad_hang_ms == 250
    assert options.barge_in_on_speech is False and options.vad_attack_ms == TwilioOptions().vad_attack_ms


async def test_text_before_the_call_and_utterances_in_order(espeak_gateway: RunningGateway) -> None:
    async with agent_for(espeak_gateway, "CA-queue") as agent:
        await agent.send(type="session.start", language="English")
        await agent.say("u1", "First things first.")  # before Twilio's stream starts
        await agent.until("utterance.started", utterance_id="u1")
        async with TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-queue") as sim:
            await agent.until("call.started")
            await agent.say("u2", "Then the second.")
            await agent.send(type="speak.append", utterance_id="u3", text="Never mind this")  # held: no audio
            await agent.send(type="speak.cancel", utterance_id="u3")  # not on the line: no clear
            cancelled = await agent.until("utterance.interrupted", utterance_id="u3")
            await agent.until("utterance.played", utterance_id="u2")
    assert cancelled["played_ms"] == 0 and cancelled["last_word"] is None and not sim.log.clears
    names = sim.log.played_marks()
    assert names == [n for _, n in sim.log.marks_in]
    first = [n for n in names if n.startswith("u1/")]
    second = [n for n in names if n.startswith("u2/")]
    assert names == first + second and first[-1] == "u1/end" and second[-1] == "u2/end"
    assert not [n for n in names if n.startswith("u3/")]
    played = [m["utterance_id"] for m in agent.of_type("utterance.played")]
    assert played == ["u1", "u2"]


async def test_a_second_media_stream_for_a_call_is_refused_and_the_first_goes_on(
    espeak_gateway: RunningGateway,
) -> None:
    import websockets

    async with TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-dup") as sim:
        async with agent_for(espeak_gateway, "CA-dup") as agent:
            await agent.until("call.started")
            intruder = TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-dup", stream_sid="MZ-other")
            await intruder.__aenter__()
            assert intruder._ws is not None
            await asyncio.wait_for(intruder._ws.wait_closed(), 5)
            assert intruder._ws.close_code == 1008
            with contextlib.suppress(websockets.ConnectionClosed):
                await intruder.stop()
            await agent.say("u1", SHORT)
            await agent.until("utterance.played", utterance_id="u1")
    # (before the fix, the refused stream's clean-up ended the first one's call: no utterance.played)
    assert sim.log.played_marks()[-1] == "u1/end"


def _sample(metrics: str, name: str, labels: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_phone_calls_count_in_the_gateways_metrics(espeak_gateway: RunningGateway) -> None:
    """Utterances, errors and time to first audio of phone calls are in /metrics under
    endpoint="twilio". An utterance waiting behind another on the line (here, one held by a pause)
    counts from when the line was free for it: the figure is the engine's and gateway's latency,
    not the wait."""
    async with (
        agent_for(espeak_gateway, "CA-metrics") as agent,
        TwilioSimulator(twilio_url(espeak_gateway), call_sid="CA-metrics") as sim,
    ):
        await _speak_and_wait_for_audio(agent, sim, LONG, after_s=0.3)
        await agent.send(type="speak.pause", utterance_id="u1")
        await agent.until("utterance.paused", utterance_id="u1")
        await agent.say("u2", SHORT)  # behind u1 on the line while it is paused
        await agent.send(type="speak.end", utterance_id="nope")
        await agent.until("error", code="unknown_utterance")
        await asyncio.sleep(1.5)
        await agent.send(type="speak.unpause", utterance_id="u1")
        await agent.until("utterance.played", utterance_id="u2", timeout_s=30)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{espeak_gateway.http}/metrics")).text
    assert _sample(metrics, "cadence_utterances_total", 'endpoint="twilio"') == 2
    assert _sample(metrics, "cadence_errors_total", 'code="unknown_utterance"') == 1
    assert _sample(metrics, "cadence_ttfa_seconds_count", 'endpoint="twilio"') == 2
    assert _sample(metrics, "cadence_ttfa_seconds_sum", 'endpoint="twilio"') < 1.0  # u2 waited 1.5 s
    assert _sample(metrics, "cadence_ttfa_seconds_count", 'endpoint="stream"') == 0
