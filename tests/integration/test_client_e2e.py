"""The Python client and `cadence say` against the real gateway (uvicorn on loopback) and eSpeak."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from clients.client import (
    Done,
    Event,
    Interrupted,
    Packet,
    Paused,
    PlaybackClock,
    Started,
    Unpaused,
    Words,
    connect,
)
from clients.say import say_main
from engine.espeak.engine import EspeakEngine
from tests.integration.conftest import GatewayFactory, RunningGateway

TEXT = "Hello there, how are you today? The quick brown fox jumps over the lazy dog."
LONG = " ".join(["This sentence keeps going so that there is time to interrupt it."] * 6)


@pytest.fixture
def espeak_gateway(gateway_factory: GatewayFactory) -> RunningGateway:
    return gateway_factory(EspeakEngine())


async def test_speak_streams_packets_words_and_done(espeak_gateway: RunningGateway) -> None:
    async with connect(espeak_gateway.ws, language="English") as session:
        assert session.engine["name"] == "espeak" and session.sample_rate == 24_000
        events = [event async for event in session.speak(TEXT, utterance_id="greeting")]
    assert isinstance(events[0], Started) and isinstance(events[-1], Done)
    packets = [e for e in events if isinstance(e, Packet)]
    words = [w for e in events if isinstance(e, Words) for w in e.words]
    assert [p.seq for p in packets] == list(range(len(packets)))
    offsets = [p.sample_offset for p in packets]
    assert offsets == list(np.cumsum([0] + [p.samples for p in packets[:-1]]))
    assert packets[-1].last and not any(p.last for p in packets[:-1])
    done = events[-1]
    assert isinstance(done, Done) and done.packets == len(packets)
    total_ms = sum(p.samples for p in packets) * 1000 // 24_000
    assert abs(done.duration_ms - total_ms) <= 20
    assert [TEXT[w.char_start : w.char_end] for w in words] == [w.text for w in words]
    assert [w.text for w in words][:3] == ["Hello", "there", "how"]
    assert all(0 <= w.start_ms < w.end_ms <= done.duration_ms for w in words)


async def test_interrupt_is_a_fence_with_the_last_word(espeak_gateway: RunningGateway) -> None:
    interrupts: list[Interrupted] = []
    async with connect(espeak_gateway.ws, on_interrupt=interrupts.append, pacing="realtime") as session:
        clock = PlaybackClock(session.sample_rate, buffer_ms=100)
        uid = "long"
        await session.append(uid, LONG)
        await session.end(uid)
        fence: Interrupted | None = None
        interrupted = False  # once: packets of the same write still come after the cancel went
        async for event in session.events(uid):
            if isinstance(event, Packet):
                clock.on_packet(event.samples, event.received_at)
                if clock.played_ms() >= 1200 and not interrupted:
                    interrupted = True
                    await session.interrupt(uid, played_ms=clock.played_ms())
            elif isinstance(event, Interrupted):
                fence = event
        assert fence is not None and interrupts == [fence]
        assert fence.position_source == "client" and fence.played_ms >= 1200
        assert fence.last_word is not None and fence.last_word.end_ms <= fence.played_ms + 40
        assert LONG.startswith(fence.spoken_text) and fence.spoken_text + fence.unspoken_text == LONG
        # the session is still usable after the barge-in
        events = [e async for e in session.speak("Still here.")]
        assert isinstance(events[-1], Done)
        assert session.stray_packets == 0  # no packet of the interrupted stream followed its fence


async def test_a_false_interruption_pauses_and_goes_on(espeak_gateway: RunningGateway) -> None:
    async with connect(espeak_gateway.ws, pacing="realtime", language="English") as session:
        clock = PlaybackClock(session.sample_rate, buffer_ms=100)
        uid = "paused"
        await session.append(uid, LONG)
        await session.end(uid)
        events: list[Event] = []
        asked = False
        async for event in session.events(uid):
            events.append(event)
            if isinstance(event, Packet):
                clock.on_packet(event.samples, event.received_at)
                if clock.played_ms() >= 800 and not asked:
                    asked = True
                    clock.pause()
                    await session.pause(uid, played_ms=clock.played_ms())
            elif isinstance(event, Paused):
                await asyncio.sleep(0.5)  # a cough, not words: go on
                clock.resume()
                await session.unpause(uid)
    kinds = [type(e) for e in events]
    paused, unpaused = kinds.index(Paused), kinds.index(Unpaused)
    assert Packet not in kinds[paused:unpaused]  # the fence held until the unpause
    report = events[paused]
    assert isinstance(report, Paused) and report.position_source == "client" and report.played_ms >= 800
    assert report.spoken_text + report.unspoken_text == LONG
    packets = [e for e in events if isinstance(e, Packet)]
    assert [p.seq for p in packets] == list(range(len(packets)))
    assert [p.sample_offset for p in packets] == list(np.cumsum([0] + [p.samples for p in packets[:-1]]))
    done = events[-1]
    assert isinstance(done, Done) and done.packets == len(packets) and Interrupted not in kinds


async def test_a_pause_left_too_long_ends_as_an_interruption(espeak_gateway: RunningGateway) -> None:
    async with connect(espeak_gateway.ws, pacing="realtime", pause_timeout_ms=300) as session:
        await session.append("u1", LONG)
        await session.end("u1")
        events: list[Event] = []
        async for event in session.events("u1"):
            events.append(event)
            if isinstance(event, Packet) and event.seq == 20:
                await session.pause("u1")
    paused = next(e for e in events if isinstance(e, Paused))
    interrupted = events[-1]
    assert isinstance(interrupted, Interrupted) and interrupted.played_ms == paused.played_ms
    assert interrupted.spoken_text == paused.spoken_text and paused.position_source == "server"
    assert not [e for e in events[events.index(paused) :] if isinstance(e, Packet)]


def test_say_writes_a_wav_and_prints_word_times(espeak_gateway: RunningGateway, tmp_path: Path) -> None:
    for rate in (None, 16_000):
        out = io.StringIO()
        wav = tmp_path / f"out-{rate}.wav"
        argv = [TEXT, "-o", str(wav), "--words", "--url", espeak_gateway.ws, "--language", "English"]
        if rate:
            argv += ["--sample-rate", str(rate)]
        assert say_main(argv, out=out) == 0
        audio, sample_rate = sf.read(wav)
        assert sample_rate == (rate or 24_000)
        assert 2.0 < len(audio) / sample_rate < 10.0 and np.abs(audio).max() > 0.05
        lines = out.getvalue().splitlines()
        assert lines[0].split()[-1] == "Hello" and len(lines) == 15
        starts = [float(line.split()[0]) for line in lines]
        assert starts == sorted(starts) and starts[-1] < len(audio) / sample_rate


def test_say_reports_a_refused_voice(espeak_gateway: RunningGateway, tmp_path: Path) -> None:
    argv = ["Hi.", "-o", str(tmp_path / "x.wav"), "--url", espeak_gateway.ws, "--voice", "nobody"]
    assert say_main(argv, out=io.StringIO()) != 0
    assert not (tmp_path / "x.wav").exists()


def test_say_reports_no_server(tmp_path: Path) -> None:
    argv = ["Hi.", "-o", str(tmp_path / "x.wav"), "--url", "ws://127.0.0.1:9/v1/stream"]
    assert say_main(argv, out=io.StringIO()) == 2
