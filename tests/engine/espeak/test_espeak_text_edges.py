"""Text a client may send that eSpeak NG reads as something other than text, with the real
libespeak-ng: control characters (U+0001 starts an eSpeak embedded command that changes the
process-wide voice, NUL ends the C string), lone surrogates, and language codes whose data lacks
a dictionary. Through the engine API and over real uvicorn on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.api import InvalidRequest, SynthesisRequest, TextSegment, WordTiming
from engine.espeak.engine import EspeakEngine
from gateway.config import GatewayConfig
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(120)

PLAIN = "Hello there, how are you today?"


@pytest.fixture
async def engine() -> AsyncIterator[EspeakEngine]:
    eng = EspeakEngine(max_streams=4)
    await eng.start()
    yield eng
    await eng.stop()


async def speak(eng: EspeakEngine, text: str, **request: object) -> tuple[np.ndarray, list[WordTiming]]:
    stream = eng.open(SynthesisRequest("r", **request))  # type: ignore[arg-type]
    stream.push(TextSegment(text, 0))
    stream.close_text()
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].final
    audio = np.concatenate([c.samples for c in chunks])
    return audio, [w for c in chunks for w in c.words]


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))


@pytest.mark.parametrize(
    "command",
    ["\x01300A ", "\x0199P "],  # amplitude, pitch
)
async def test_a_control_character_does_not_change_later_utterances(
    engine: EspeakEngine, command: str
) -> None:
    before, _ = await speak(engine, PLAIN)
    await speak(engine, command + "one two three.")
    after, words = await speak(engine, PLAIN)
    assert abs(len(after) - len(before)) < 0.02 * len(before)
    assert 0.8 < rms(after) / rms(before) < 1.25, (rms(before), rms(after))
    assert [w.text for w in words] == ["Hello", "there", "how", "are", "you", "today"]


async def test_text_after_a_nul_is_spoken(engine: EspeakEngine) -> None:
    head, _ = await speak(engine, "Hello.")
    audio, words = await speak(engine, "Hello.\x00 And this part is spoken as well.")
    text = "Hello.\x00 And this part is spoken as well."
    assert len(audio) > 3 * len(head)
    for w in words:
        assert text[w.char_start : w.char_end] == w.text
        assert 0 <= w.start_sample < w.end_sample <= len(audio)


async def test_a_lone_surrogate_is_spoken_around(engine: EspeakEngine) -> None:
    text = "Broken \ud83d pair here."
    audio, words = await speak(engine, text)
    assert len(audio) > 24_000 // 2
    assert [w.text for w in words if w.text.isalpha()] == ["Broken", "pair", "here"]
    for w in words:
        assert text[w.char_start : w.char_end] == w.text


@pytest.mark.parametrize("code", ["fo", "kaa"])  # data files whose dictionaries the wheel lacks
async def test_a_language_without_a_dictionary_is_refused_at_open(engine: EspeakEngine, code: str) -> None:
    with pytest.raises(InvalidRequest):
        engine.open(SynthesisRequest("x", language=code))


async def test_languages_offered_all_speak(engine: EspeakEngine) -> None:
    assert engine._lib is not None
    for code in ("sv", "pt-br", "en-gb-x-rp", "yue"):
        stream = engine.open(SynthesisRequest("x", language=code))
        stream.cancel()
    audio, words = await speak(engine, "Hej, hur mår du idag?", language="sv")
    assert len(audio) > 24_000 // 2 and words


# -- over the gateway ---------------------------------------------------------------------------


async def speak_ws(client: Client, utterance_id: str, text: str) -> np.ndarray:
    await client.send(type="speak.append", utterance_id=utterance_id, text=text)
    await client.send(type="speak.end", utterance_id=utterance_id)
    await client.until("utterance.done", utterance_id, wait_s=30)
    stream = client.got.stream_of(utterance_id)
    payload = b"".join(p for _, p in client.got.packets_of(stream))
    return np.frombuffer(payload, np.float32)


async def test_one_clients_control_characters_leave_another_clients_audio_alone() -> None:
    engine = EspeakEngine(max_streams=4)
    with run_gateway(engine, GatewayConfig()) as gw:
        start = {"type": "session.start", "output": {"encoding": "pcm_f32le", "sample_rate": 24_000}}
        async with connect(gw.ws) as ws_a, connect(gw.ws) as ws_b:
            a, b = Client(ws_a), Client(ws_b)
            await a.send(**start)
            await b.send(**start)
            before = await speak_ws(b, "b1", PLAIN)
            await speak_ws(a, "a1", "\x01300A Turn it up.")
            after = await speak_ws(b, "b2", PLAIN)
    assert len(before) > 24_000 // 2
    assert 0.8 < rms(after) / rms(before) < 1.25, (rms(before), rms(after))
