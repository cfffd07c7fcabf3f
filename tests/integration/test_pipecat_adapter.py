"""The Pipecat adapter inside a real Pipecat pipeline, against a running Cadence (loopback uvicorn)."""

from __future__ import annotations

import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (  # noqa: E402
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from clients.pipecat_adapter import CadenceTTSService  # noqa: E402
from engine.espeak.engine import EspeakEngine  # noqa: E402
from tests.fakes import FakeEngine  # noqa: E402
from tests.integration.conftest import GatewayFactory  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog."


async def test_speaks_with_word_timestamps(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(EspeakEngine())
    tts = CadenceTTSService(url=gateway.ws, language="English", pacing="asap")
    down, _ = await run_test(tts, frames_to_send=[TTSSpeakFrame(SENTENCE), SleepFrame(3.5)])
    kinds = [type(f) for f in down]
    assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame) < kinds.index(TTSStoppedFrame)
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert all(f.sample_rate == 24_000 for f in down if isinstance(f, TTSAudioRawFrame))
    words = [f.text for f in down if isinstance(f, TTSTextFrame)]
    assert words == [w.strip(".") for w in SENTENCE.split()]
    assert 1.5 < len(audio) / 2 / 24_000 < 5.0


async def test_an_interruption_cancels_and_keeps_only_the_words_heard(
    gateway_factory: GatewayFactory,
) -> None:
    engine = FakeEngine(step_s=0.02)
    gateway = gateway_factory(engine)
    text = " ".join(f"word{i}" for i in range(40))
    tts = CadenceTTSService(url=gateway.ws)
    down, _ = await run_test(
        tts, frames_to_send=[TTSSpeakFrame(text), SleepFrame(1.0), InterruptionFrame(), SleepFrame(0.5)]
    )
    assert engine.streams and engine.streams[0].cancelled  # speak.cancel reached the engine
    [report] = tts.interruptions
    words = [f.text for f in down if isinstance(f, TTSTextFrame)]
    assert 0 < len(words) < 40  # only the words whose time had come
    assert words == text.split()[: len(words)]
    assert {f.context_id for f in down if isinstance(f, TTSAudioRawFrame)} == {report["utterance_id"]}
    assert report["unspoken_text"].strip() and report["spoken_text"] + report["unspoken_text"] == text
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert not [f for f in down[cut:] if isinstance(f, TTSAudioRawFrame | TTSTextFrame)]  # nothing after it
