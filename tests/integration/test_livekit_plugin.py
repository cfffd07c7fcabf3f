"""The LiveKit Agents plugin for Cadence's native protocol (clients.livekit_plugin), driven as
LiveKit drives a TTS, against a running Cadence (loopback uvicorn): streamed audio, an aligned
transcript on the engine's timeline, and an interruption that stops the engine and reports the
last word heard."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("livekit.agents")

from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402

from clients.livekit_plugin import CadenceTTS  # noqa: E402
from tests.fakes import FakeEngine, word_ms  # noqa: E402
from tests.integration.conftest import GatewayFactory, RunningGateway  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello there. This is Cadence speaking to LiveKit."
GAP_MS = 40


async def test_streams_audio_with_an_aligned_transcript(gateway: RunningGateway) -> None:
    tts = CadenceTTS(url=gateway.ws, voice="bob", pacing="asap")
    assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
    try:
        stream = tts.stream()
        for piece in ("Hello there. ", "This is Cadence ", "speaking to LiveKit."):  # as an LLM would
            stream.push_text(piece)
        stream.end_input()
        seconds, timed = 0.0, []
        async for event in stream:
            seconds += event.frame.samples_per_channel / event.frame.sample_rate
            timed += event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
        await stream.aclose()
    finally:
        await tts.aclose()
    assert abs(seconds * 1000 - sum(word_ms(w) + GAP_MS for w in TEXT.split())) <= 2
    assert [str(t).strip() for t in timed] == TEXT.split()
    assert "".join(timed) == TEXT  # the pieces cover the text
    at = 0
    for piece, word in zip(timed, TEXT.split(), strict=True):
        assert piece.start_time == pytest.approx(at / 1000) and piece.end_time == pytest.approx(
            (at + word_ms(word)) / 1000
        )
        at += word_ms(word) + GAP_MS
    assert gateway.engine.streams[0].request.voice == "bob"  # type: ignore[attr-defined]


async def test_synthesize_and_turns_share_one_socket(gateway: RunningGateway) -> None:
    tts = CadenceTTS(url=gateway.ws, pacing="asap")
    try:
        for _ in range(2):
            seconds = 0.0
            async with tts.synthesize("One more turn.") as stream:
                async for event in stream:
                    seconds += event.frame.samples_per_channel / event.frame.sample_rate
            # LiveKit's chunked emitter may end on one more 10 ms frame
            assert 0 <= seconds * 1000 - sum(word_ms(w) + GAP_MS for w in "One more turn.".split()) <= 12
    finally:
        await tts.aclose()
    assert len({s.request.request_id.split("/")[0] for s in gateway.engine.streams}) == 1  # type: ignore[attr-defined]


async def test_an_interruption_stops_the_engine_and_reports_the_last_word_heard(
    gateway_factory: GatewayFactory,
) -> None:
    engine = FakeEngine(step_s=0.01)
    g = gateway_factory(engine)
    reports: list[object] = []
    tts = CadenceTTS(url=g.ws, on_interrupt=reports.append)  # realtime pacing: heard ~ sent - lead
    text = " ".join(f"word{i}" for i in range(40))
    try:
        stream = tts.stream()
        stream.push_text(text)
        stream.flush()
        played = 0.0
        async for event in stream:
            played += event.frame.samples_per_channel / event.frame.sample_rate
            if played >= 1.5:
                break
        await stream.aclose()  # what LiveKit does when the user barges in
        for _ in range(100):
            if tts.interruptions:
                break
            await asyncio.sleep(0.02)
    finally:
        await tts.aclose()
    [report] = tts.interruptions
    assert reports == [report] and engine.streams[0].cancelled and engine.words_spoken < 40
    assert report.last_word is not None and report.spoken_text.endswith(report.last_word.text)
    assert report.spoken_text + report.unspoken_text == text and report.unspoken_text.strip()
    heard = len(report.spoken_text.split())
    assert 0 < heard < 40 and report.played_ms < 4000


async def test_a_false_interruption_pauses_the_turn_and_unpause_goes_on_from_the_fence(
    gateway_factory: GatewayFactory,
) -> None:
    engine = FakeEngine(step_s=0.005)
    g = gateway_factory(engine)
    pauses: list[object] = []
    tts = CadenceTTS(url=g.ws, on_pause=pauses.append)
    text = " ".join(f"word{i}" for i in range(12))
    total_ms = sum(word_ms(w) + GAP_MS for w in text.split())
    try:
        stream = tts.stream()
        stream.push_text(text)
        stream.end_input()
        seconds = 0.0
        paused_at: float | None = None
        async for event in stream:
            seconds += event.frame.samples_per_channel / event.frame.sample_rate
            if paused_at is None and seconds >= 0.8:
                assert await tts.pause()
                for _ in range(100):
                    if tts.pauses:
                        break
                    await asyncio.sleep(0.02)
                paused_at = seconds
                assert await tts.unpause()
        await stream.aclose()
        assert not await tts.pause()  # the turn is over: nothing to pause
    finally:
        await tts.aclose()
    [report] = tts.pauses
    assert pauses == [report] and not tts.interruptions and not engine.streams[0].cancelled
    assert report.spoken_text + report.unspoken_text == text
    # every sample once: what came before the fence, then (after the unpause) the rest from it
    assert paused_at is not None and report.played_ms <= paused_at * 1000
    assert 0 <= seconds * 1000 - total_ms <= 12  # LiveKit's emitter may end on one more 10 ms frame
