"""The Pipecat adapter inside a real Pipecat pipeline, against a running Cadence (loopback uvicorn)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (  # noqa: E402
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
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


class RecordingTTS(CadenceTTSService):
    """The adapter, keeping every message it sends to Cadence."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sent: list[dict[str, Any]] = []

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        await super()._send(message)


TURN = " ".join(f"word{i}" for i in range(12))  # 300 ms a word with the fake engine


async def test_a_false_interruption_pauses_the_turn_and_it_goes_on(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(FakeEngine(step_s=0.01))
    plain = RecordingTTS(url=gateway.ws)
    reference, _ = await run_test(plain, frames_to_send=[TTSSpeakFrame(TURN), SleepFrame(4.5)])
    tts = RecordingTTS(url=gateway.ws, false_interruption_timeout_s=0.4)
    down, _ = await run_test(
        tts,
        frames_to_send=[
            TTSSpeakFrame(TURN),
            SleepFrame(1.0),
            VADUserStartedSpeakingFrame(),  # a cough
            SleepFrame(0.3),
            VADUserStoppedSpeakingFrame(),
            SleepFrame(5.0),
        ],
    )
    kinds = [m["type"] for m in tts.sent]
    assert (
        kinds.count("speak.pause") == 1 and kinds.count("speak.unpause") == 1 and "speak.cancel" not in kinds
    )
    assert kinds.index("speak.pause") < kinds.index("speak.unpause")
    [paused] = tts.pauses
    assert paused["position_source"] == "server" and 700 <= paused["played_ms"] <= 1300
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert audio == b"".join(
        f.audio for f in reference if isinstance(f, TTSAudioRawFrame)
    )  # no gap, no repeat
    words = [f for f in down if isinstance(f, TTSTextFrame)]
    assert [f.text for f in words] == TURN.split()
    gaps = [(b.pts - a.pts) / 1e9 for a, b in zip(words, words[1:], strict=False)]
    moved = [g for g in gaps if g > 0.5]
    assert len(moved) == 1 and 0.9 < moved[0] < 1.4  # the words after the pause, later by the pause
    assert all(abs(g - 0.3) < 0.05 for g in gaps if g <= 0.5)
    assert not tts.interruptions and TTSStoppedFrame in [type(f) for f in down]


async def test_an_interruption_after_the_pause_cancels_at_the_paused_position(
    gateway_factory: GatewayFactory,
) -> None:
    gateway = gateway_factory(FakeEngine(step_s=0.01))
    tts = RecordingTTS(url=gateway.ws, false_interruption_timeout_s=1.0)
    down, _ = await run_test(
        tts,
        frames_to_send=[
            TTSSpeakFrame(TURN),
            SleepFrame(1.0),
            VADUserStartedSpeakingFrame(),
            SleepFrame(0.3),
            InterruptionFrame(),  # words came: a real interruption
            SleepFrame(0.5),
        ],
    )
    kinds = [m["type"] for m in tts.sent]
    assert kinds.index("speak.pause") < kinds.index("speak.cancel") and "speak.unpause" not in kinds
    [paused], [report] = tts.pauses, tts.interruptions
    assert report["played_ms"] == paused["played_ms"] and report["last_word"] == paused["last_word"]
    words = [f.text for f in down if isinstance(f, TTSTextFrame)]
    assert words == TURN.split()[: len(words)] and len(words) < 12
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert not [f for f in down[cut:] if isinstance(f, TTSAudioRawFrame | TTSTextFrame)]
