"""Pipecat's own ElevenLabsTTSService and CartesiaTTSService, pointed at the gateway on loopback:
the audio the engine made arrives, each word is timed where the engine put it, and an
interruption stops the audio (in the pipeline and in the engine)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (  # noqa: E402
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.services.cartesia.tts import CartesiaTTSService  # noqa: E402
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService  # noqa: E402
from pipecat.services.tts_service import TTSService  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from tests.fakes import FakeEngine, FakeStream, word_ms  # noqa: E402
from tests.integration.conftest import GatewayFactory, RunningGateway  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello there. This is a test of the word times."
GAP_MS = 40


def engine_starts_ms(text: str) -> list[int]:
    """Where the fake engine starts each word: each word's tone and a 40 ms pause before the next."""
    starts, at = [], 0
    for word in text.split():
        starts.append(at)
        at += word_ms(word) + GAP_MS
    return starts


def elevenlabs(g: RunningGateway) -> TTSService:
    return ElevenLabsTTSService(
        api_key="unused-on-loopback",
        url=f"ws://127.0.0.1:{g.port}",
        settings=ElevenLabsTTSService.Settings(voice="alice"),
    )


def cartesia(g: RunningGateway) -> TTSService:
    return CartesiaTTSService(
        api_key="unused-on-loopback",
        url=f"ws://127.0.0.1:{g.port}/tts/websocket",
        settings=CartesiaTTSService.Settings(voice="bob"),
    )


SERVICES = [pytest.param(elevenlabs, id="elevenlabs"), pytest.param(cartesia, id="cartesia")]


@pytest.mark.parametrize("service", SERVICES)
async def test_audio_and_word_times(gateway: RunningGateway, service: object) -> None:
    tts = service(gateway)  # type: ignore[operator]
    down, _ = await run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT), SleepFrame(2.0)])
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    expected_ms = engine_starts_ms(TEXT)[-1] + word_ms(TEXT.split()[-1]) + GAP_MS
    assert abs(len(audio) / 2 / 24 - expected_ms) <= 2  # pcm_24000 / pcm_s16le at 24 kHz
    assert any(isinstance(f, TTSStoppedFrame) for f in down)
    words = [f for f in down if isinstance(f, TTSTextFrame)]
    assert [w.text for w in words] == TEXT.split()
    times = [(w.pts - words[0].pts) / 1e6 for w in words]  # ns on the pipeline clock
    assert times == pytest.approx(engine_starts_ms(TEXT), abs=2)


@pytest.mark.parametrize("service", SERVICES)
async def test_an_interruption_stops_the_audio(
    gateway_factory: GatewayFactory, service: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    cancelled_at: list[float] = []
    cancel = FakeStream.cancel

    def timed_cancel(stream: FakeStream) -> None:
        cancelled_at.append(time.monotonic())
        cancel(stream)

    monkeypatch.setattr(FakeStream, "cancel", timed_cancel)
    engine = FakeEngine(step_s=0.02)
    g = gateway_factory(engine)
    text = " ".join(f"word{i}" for i in range(40))
    tts = service(g)  # type: ignore[operator]
    down, _ = await run_test(
        tts, frames_to_send=[TTSSpeakFrame(text), SleepFrame(1.0), InterruptionFrame(), SleepFrame(1.0)]
    )
    ended_at = time.monotonic()
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert not [f for f in down[cut:] if isinstance(f, TTSAudioRawFrame | TTSTextFrame)]
    heard = [f.text for f in down[:cut] if isinstance(f, TTSTextFrame)]
    assert 0 < len(heard) < 40 and heard == text.split()[: len(heard)]
    # the interruption reached the engine: its stream was cancelled then, not when the pipeline
    # closed its socket a second later
    assert cancelled_at and cancelled_at[0] < ended_at - 0.5 and engine.words_spoken < 40
