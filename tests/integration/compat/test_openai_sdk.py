"""The official `openai` SDK against the real gateway under uvicorn, called as OpenAI documents it:
every response format decodes to the speech the engine made, audio streams as it is made,
OpenAI's voice names and models are taken, and errors arrive as the SDK's typed exceptions."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import soundfile as sf

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import GatewayFactory, RunningGateway

pytestmark = pytest.mark.timeout(60)
Clients = Callable[[RunningGateway], openai.AsyncOpenAI]

TEXT = "Hello there. This is a test of the speech endpoint."
GAP_MS = 40


def expected_ms(text: str, speed: float = 1.0) -> int:
    return sum(word_ms(w, speed) + GAP_MS for w in text.split())


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[RunningGateway], openai.AsyncOpenAI]]:
    """SDK clients on a gateway's base URL, closed after the test."""
    made: list[openai.AsyncOpenAI] = []

    def make(g: RunningGateway) -> openai.AsyncOpenAI:
        made.append(
            openai.AsyncOpenAI(base_url=f"{g.http}/v1", api_key="not-needed-on-loopback", max_retries=0)
        )
        return made[-1]

    yield make
    for api in made:
        await api.close()


def decoded_ms(data: bytes) -> float:
    """The length of an encoded file, decoded by FFmpeg (PyAV)."""
    with av.open(io.BytesIO(data)) as container:
        samples, rate = 0, 0
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate
    return samples * 1000 / rate


async def test_the_documented_call_gives_mp3(gateway: RunningGateway, clients: Clients) -> None:
    response = await clients(gateway).audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
    data = response.read()
    assert response.response.headers["content-type"] == "audio/mpeg"
    # LAME adds its encoder delay and pads the last frame: up to two 24 kHz MP3 frames longer
    assert expected_ms(TEXT) - 2 <= decoded_ms(data) <= expected_ms(TEXT) + 2 * 1152 / 24 + 2


@pytest.mark.parametrize(
    ("fmt", "media_type", "slack_ms"),
    [("opus", "audio/ogg", 30), ("aac", "audio/aac", 2 * 1024 / 24 + 2), ("wav", "audio/wav", 0)],
)
async def test_every_format_decodes(
    gateway: RunningGateway, fmt: str, media_type: str, slack_ms: float, clients: Clients
) -> None:
    response = await clients(gateway).audio.speech.create(
        model="gpt-4o-mini-tts",
        voice="nova",
        input=TEXT,
        response_format=fmt,  # type: ignore[arg-type]
    )
    data = response.read()
    assert response.response.headers["content-type"] == media_type
    assert abs(decoded_ms(data) - expected_ms(TEXT)) <= slack_ms + 2


async def test_wav_streams_with_open_sizes_and_reads_back(gateway: RunningGateway, clients: Clients) -> None:
    data = (
        await clients(gateway).audio.speech.create(
            model="tts-1", voice="echo", input=TEXT, response_format="wav"
        )
    ).read()
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"  # streamed: the size is not known
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    engine = gateway.engine
    assert isinstance(engine, FakeEngine) and rate == 24000
    first = engine.tone("Hello")
    assert np.allclose(audio[: len(first)], first, atol=2 / 32768)


async def test_flac_and_pcm(gateway: RunningGateway, clients: Clients) -> None:
    flac = (
        await clients(gateway).audio.speech.create(
            model="tts-1", voice="echo", input=TEXT, response_format="flac"
        )
    ).read()
    audio, rate = sf.read(io.BytesIO(flac), dtype="float32")
    assert rate == 24000 and abs(len(audio) / 24 - expected_ms(TEXT)) <= 2
    pcm = (
        await clients(gateway).audio.speech.create(
            model="tts-1", voice="echo", input=TEXT, response_format="pcm"
        )
    ).read()
    assert abs(len(pcm) / 2 / 24 - expected_ms(TEXT)) <= 2


async def test_audio_streams_while_the_engine_is_still_speaking(
    gateway_factory: GatewayFactory, clients: Clients
) -> None:
    engine = FakeEngine(step_s=0.02)
    g = gateway_factory(engine)
    speech = clients(g).audio.speech.with_streaming_response
    async with speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="mp3") as response:
        chunks = response.iter_bytes()
        first = await chunks.__anext__()
        assert first and engine.words_spoken < len(TEXT.split())  # bytes before the speech was done
        rest = b"".join([c async for c in chunks])
    assert engine.words_spoken == len(TEXT.split()) and decoded_ms(first + rest) >= expected_ms(TEXT) - 2


async def test_openai_voice_names_follow_the_alias_table(
    gateway_factory: GatewayFactory, tmp_path: Path, clients: Clients
) -> None:
    aliases = tmp_path / "voices.json"
    aliases.write_text(json.dumps({"alloy": "bob", "21m00Tcm4TlvDq8ikWAM": "alice"}))
    engine = FakeEngine()
    g = gateway_factory(engine, GatewayConfig(voice_aliases_file=str(aliases)))
    api = clients(g)
    for voice in ("alloy", "shimmer", "21m00Tcm4TlvDq8ikWAM", "Bob"):
        (await api.audio.speech.create(model="tts-1", voice=voice, input="Hi.", response_format="pcm")).read()
    # alloy -> bob (the file), shimmer -> the engine's default (its default target is not a fake
    # voice), the ElevenLabs id -> alice (the file), Bob -> the preset bob
    assert [s.request.voice for s in engine.streams] == ["bob", None, "alice", "bob"]
    await api.audio.speech.create(model="tts-1", voice={"id": "alice"}, input="Hi.", response_format="pcm")
    assert engine.streams[-1].request.voice == "alice"


async def test_instructions_and_speed(gateway: RunningGateway, clients: Clients) -> None:
    engine = gateway.engine
    assert isinstance(engine, FakeEngine)
    api = clients(gateway)
    pcm = (
        await api.audio.speech.create(
            model="gpt-4o-mini-tts",
            voice="coral",
            input=TEXT,
            instructions="Speak cheerfully.",
            speed=2.0,
            response_format="pcm",
        )
    ).read()
    assert engine.streams[-1].request.instructions == "Speak cheerfully."
    assert abs(len(pcm) / 2 / 24 - expected_ms(TEXT, 2.0)) <= 2
    await api.audio.speech.create(model="tts-1", voice="coral", input="Hi.", instructions="Whisper.")
    assert engine.streams[-1].request.instructions is None  # tts-1 takes no instructions (OpenAI's docs)


async def test_sse_stream_format(gateway: RunningGateway, clients: Clients) -> None:
    speech = clients(gateway).audio.speech.with_streaming_response
    async with speech.create(
        model="gpt-4o-mini-tts", voice="alloy", input=TEXT, stream_format="sse", response_format="mp3"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) async for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1  # pieces as they are made
    mp3 = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert decoded_ms(mp3) >= expected_ms(TEXT) - 2


async def test_errors_are_the_sdks_exceptions(gateway: RunningGateway, clients: Clients) -> None:
    api = clients(gateway)
    with pytest.raises(openai.BadRequestError) as bad_voice:
        await api.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    assert bad_voice.value.code == "unknown_voice"
    with pytest.raises(openai.BadRequestError) as bad_model:
        await api.audio.speech.create(model="whisper-1", voice="alloy", input="Hi.")
    assert bad_model.value.code == "invalid_request" and "tts-1" in bad_model.value.message
    with pytest.raises(openai.BadRequestError) as bad_format:
        await api.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="ogg")  # type: ignore[arg-type]
    assert bad_format.value.code == "unsupported_output"


async def test_overload_is_a_rate_limit_error(gateway_factory: GatewayFactory, clients: Clients) -> None:
    g = gateway_factory(FakeEngine(capacity=0))
    with pytest.raises(openai.RateLimitError) as busy:
        await clients(g).audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
    assert busy.value.code == "overloaded" and busy.value.response.headers["retry-after"] == "2"
