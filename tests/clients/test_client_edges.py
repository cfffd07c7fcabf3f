"""Client edges against the real gateway (uvicorn on loopback, the fake engine): a refused message
about an utterance under way does not end it, a turn with no text ends, and the playback clock's
underrun count."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from clients.client import Done, Error, Event, Packet, PlaybackClock, Started, connect
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)

RATE = 24_000
PACKET = 480  # 20 ms


@pytest.fixture
def gateway() -> Iterator[RunningGateway]:
    with run_gateway(FakeEngine(step_s=0.002), GatewayConfig(max_text_chars=40)) as running:
        yield running


# -- Session ---------------------------------------------------------------------------------------
async def test_an_append_refused_mid_utterance_does_not_end_it(gateway: RunningGateway) -> None:
    """`text_too_long` on a later append: the utterance goes on without that text (protocol.md), so
    its events go on to its Done and none of its packets is dropped as a stray."""
    async with connect(gateway.ws) as session:
        events: list[Event] = []
        await session.append("u1", "Hello there, how are you. ")
        async for event in session.events("u1"):
            events.append(event)
            if isinstance(event, Started):
                await session.append("u1", "x" * 40)  # past max_text_chars: refused
                await session.end("u1")
        stray = session.stray_packets
    errors = [e for e in events if isinstance(e, Error)]
    assert [e.code for e in errors] == ["text_too_long"]
    done = events[-1]
    packets = [e for e in events if isinstance(e, Packet)]
    assert isinstance(done, Done) and done.packets == len(packets) and packets[-1].last
    assert stray == 0


async def test_an_unpause_of_a_playing_utterance_does_not_end_it(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as session:
        events: list[Event] = []
        await session.append("u1", "One two three four.")
        await session.end("u1")
        async for event in session.events("u1"):
            events.append(event)
            if isinstance(event, Started):
                await session.unpause("u1")  # never paused: `not_paused`, nothing else changes
    assert [e.code for e in events if isinstance(e, Error)] == ["not_paused"]
    assert isinstance(events[-1], Done)
    assert events[-1].packets == sum(isinstance(e, Packet) for e in events)


async def test_a_refused_first_append_still_ends_the_utterance(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as session:
        await session.append("u1", "y" * 41)  # refused at open: no utterance, nothing else comes
        events = await asyncio.wait_for(_collect(session.events("u1")), 5)
    assert [type(e) for e in events] == [Error] and events[0].code == "text_too_long"


async def _collect(events: object) -> list[Event]:
    return [e async for e in events]  # type: ignore[attr-defined]


# -- PlaybackClock ---------------------------------------------------------------------------------
def test_an_empty_last_packet_after_the_audio_played_is_no_underrun() -> None:
    """The last packet is header-only when the audio ended on a packet edge; coming after the
    player played everything, it brings no audio: nothing was missing, nothing stalled."""
    clock = PlaybackClock(RATE, buffer_ms=100)
    for _ in range(10):  # 200 ms, all at once: played by 0.3 s
        clock.on_packet(PACKET, at=0.0)
    clock.on_packet(0, at=0.5)
    assert clock.underruns == 0 and clock.first_underrun_s is None and clock.stall_s == 0.0
    assert clock.played_ms(at=1.0) == 200


# -- the LiveKit plugin ----------------------------------------------------------------------------
async def test_a_livekit_turn_with_no_text_ends(gateway: RunningGateway) -> None:
    """An agent reply with no words (a tool call only) still ends its TTS stream: LiveKit waits for
    the stream before the next turn."""
    pytest.importorskip("livekit.agents")
    from clients.livekit_plugin import CadenceTTS

    tts = CadenceTTS(url=gateway.ws, pacing="asap")
    try:
        stream = tts.stream()
        stream.end_input()
        frames = await asyncio.wait_for(_collect(stream), 5)
        await stream.aclose()
    finally:
        await tts.aclose()
    assert frames == [] and not gateway.engine.streams  # type: ignore[attr-defined]


async def test_a_livekit_unpause_of_a_turn_not_paused_leaves_it_playing(gateway: RunningGateway) -> None:
    pytest.importorskip("livekit.agents")
    from clients.livekit_plugin import CadenceTTS

    tts = CadenceTTS(url=gateway.ws, pacing="asap")
    text = "One two three four five."
    try:
        stream = tts.stream()
        stream.push_text(text)
        stream.end_input()
        seconds = 0.0
        async for event in stream:
            if seconds == 0.0:
                assert await tts.unpause()  # nothing to unpause: Cadence answers `not_paused`
            seconds += event.frame.samples_per_channel / event.frame.sample_rate
        await stream.aclose()
    finally:
        await tts.aclose()
    total_ms = sum(word_ms(w) + 40 for w in text.split())
    assert 0 <= seconds * 1000 - total_ms <= 12  # LiveKit's emitter may end on one more 10 ms frame


# -- the Pipecat adapter ---------------------------------------------------------------------------
async def test_a_pipecat_sentence_refused_mid_turn_leaves_the_turn_playing(gateway: RunningGateway) -> None:
    """A later sentence past `max_text_chars` is refused (`text_too_long`) and the utterance goes on
    with the text it has: its audio still reaches Pipecat, and its TTSStoppedFrame follows it."""
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import (
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
    )
    from pipecat.tests.utils import SleepFrame, run_test

    from clients.pipecat_adapter import CadenceTTSService

    first = "Hello there, how are you. "
    tts = CadenceTTSService(url=gateway.ws, pacing="asap")
    down, _ = await run_test(
        tts,
        frames_to_send=[
            LLMFullResponseStartFrame(),
            LLMTextFrame(first),
            LLMTextFrame("x" * 40 + ". "),
            LLMFullResponseEndFrame(),
            SleepFrame(2.0),
        ],
    )
    kinds = [type(f) for f in down]
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert len(audio) // 2 * 1000 // RATE == sum(word_ms(w) + 40 for w in first.split())
    assert kinds.count(TTSStoppedFrame) == 1
    assert kinds.index(TTSStoppedFrame) > max(i for i, k in enumerate(kinds) if k is TTSAudioRawFrame)
