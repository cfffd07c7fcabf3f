"""LiveKit Agents' own TTS plugins pointed at the gateway on loopback: livekit-plugins-elevenlabs
(multi-stream-input), -cartesia (/tts/websocket), -openai (/v1/audio/speech, mp3 over SSE) and
-baseten (its Qwen3-TTS client: vLLM-Omni's streaming WebSocket). The audio the engine made
arrives, the plugins' timed transcripts put each word where the engine did, and an interrupted
stream stops: its audio no longer reaches the agent, and where the plugin tells the server (the
OpenAI request aborted, the Baseten socket closed) the engine stops too."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest

pytest.importorskip("livekit.agents")

import aiohttp  # noqa: E402
from livekit.agents import tts as lk_tts  # noqa: E402
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402
from livekit.plugins import baseten, cartesia, elevenlabs  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402

from tests.fakes import FakeEngine, FakeStream, word_ms  # noqa: E402
from tests.integration.conftest import GatewayFactory, RunningGateway  # noqa: E402

pytestmark = pytest.mark.timeout(90)

TEXT = "Hello there. This is a test of the word times."
GAP_MS = 40
Make = Callable[[RunningGateway, aiohttp.ClientSession], lk_tts.TTS]


def engine_words_ms(text: str) -> list[tuple[int, int]]:
    """(start, end) of each word as the fake engine makes it: a tone, then 40 ms of pause."""
    words, at = [], 0
    for word in text.split():
        words.append((at, at + word_ms(word)))
        at += word_ms(word) + GAP_MS
    return words


def total_ms(text: str) -> int:
    return engine_words_ms(text)[-1][1] + GAP_MS


def make_elevenlabs(g: RunningGateway, session: aiohttp.ClientSession, **options: object) -> lk_tts.TTS:
    return elevenlabs.TTS(
        voice_id="alice", api_key="unused", base_url=f"{g.http}/v1", http_session=session, **options
    )  # type: ignore[arg-type]


def make_cartesia(g: RunningGateway, session: aiohttp.ClientSession) -> lk_tts.TTS:
    return cartesia.TTS(
        voice="bob", api_key="unused", base_url=g.http, http_session=session, sample_rate=24000
    )


def make_baseten(g: RunningGateway, session: aiohttp.ClientSession) -> lk_tts.TTS:
    return baseten.TTS(
        model="qwen3-tts",
        voice="alice",
        task_type="CustomVoice",
        api_key="unused",
        model_endpoint=f"ws://127.0.0.1:{g.port}/v1/audio/speech/stream",
        word_timestamps=True,
        http_session=session,
    )


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


async def speak(tts: lk_tts.TTS, text: str) -> tuple[float, list[tuple[str, float, float]]]:
    """Stream `text` through the plugin; the audio's length (ms) and its timed words."""
    stream = tts.stream()
    stream.push_text(text)
    stream.flush()
    stream.end_input()
    samples, timed = 0.0, []
    async for event in stream:
        samples += event.frame.samples_per_channel / event.frame.sample_rate
        timed += event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
    await stream.aclose()
    return samples * 1000, [(str(t).strip(), t.start_time * 1000, t.end_time * 1000) for t in timed]


@pytest.mark.parametrize(
    ("make", "exact_ends"),
    [
        pytest.param(lambda g, s: make_elevenlabs(g, s, encoding="pcm_24000"), False, id="elevenlabs"),
        pytest.param(make_cartesia, True, id="cartesia"),
        pytest.param(make_baseten, True, id="baseten"),
    ],
)
async def test_streamed_audio_and_word_times(
    gateway: RunningGateway, session: aiohttp.ClientSession, make: Make, exact_ends: bool
) -> None:
    tts = make(gateway, session)
    try:
        duration, timed = await speak(tts, TEXT)
    finally:
        await tts.aclose()
    assert abs(duration - total_ms(TEXT)) <= 2
    assert [w for w, _, _ in timed] == TEXT.split()
    expected = engine_words_ms(TEXT)
    assert [s for _, s, _ in timed] == pytest.approx([s for s, _ in expected], abs=2)
    if exact_ends:  # word times; ElevenLabs' are per character: a word ends where the next begins
        assert [e for _, _, e in timed] == pytest.approx([e for _, e in expected], abs=2)


async def test_elevenlabs_default_mp3(gateway: RunningGateway, session: aiohttp.ClientSession) -> None:
    tts = make_elevenlabs(gateway, session)  # the plugin's default output_format: mp3_22050_32
    try:
        duration, timed = await speak(tts, TEXT)
    finally:
        await tts.aclose()
    assert total_ms(TEXT) - 2 <= duration <= total_ms(TEXT) + 2 * 1152 / 22.05 + 2  # LAME's delay and padding
    assert [w for w, _, _ in timed] == TEXT.split()


async def test_openai_plugin(gateway: RunningGateway) -> None:
    tts = lk_openai.TTS(
        voice="alloy", api_key="unused", base_url=f"{gateway.http}/v1"
    )  # gpt-4o-mini-tts: mp3 in SSE
    try:
        samples = 0.0
        async with tts.synthesize(TEXT) as stream:
            async for event in stream:
                samples += event.frame.samples_per_channel / event.frame.sample_rate
    finally:
        await tts.aclose()
    assert total_ms(TEXT) - 2 <= samples * 1000 <= total_ms(TEXT) + 2 * 1152 / 24 + 2


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda g, s: make_elevenlabs(g, s, encoding="pcm_24000"), id="elevenlabs"),
        pytest.param(make_cartesia, id="cartesia"),
        pytest.param(make_baseten, id="baseten"),
    ],
)
async def test_an_interrupted_stream_leaves_nothing_behind(
    gateway_factory: GatewayFactory, session: aiohttp.ClientSession, make: Make
) -> None:
    """A stream closed after its first audio (the agent's barge-in), then the next turn on the same
    plugin: the next turn hears its own audio alone, nothing left over from the first."""
    g = gateway_factory(FakeEngine(step_s=0.01))
    tts = make(g, session)
    try:
        stream = tts.stream()
        stream.push_text(" ".join(f"word{i}." for i in range(30)))
        stream.flush()
        async for _ in stream:
            break
        await stream.aclose()
        duration, timed = await speak(tts, TEXT)
    finally:
        await tts.aclose()
    assert abs(duration - total_ms(TEXT)) <= 2
    assert [w for w, _, _ in timed] == TEXT.split()


@pytest.mark.parametrize("plugin", ["openai", "baseten"])
async def test_closing_the_stream_stops_the_engine(
    gateway_factory: GatewayFactory,
    session: aiohttp.ClientSession,
    plugin: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """These plugins tell the server when the agent stops listening (the HTTP response or the
    socket is closed): the engine's stream is cancelled then, long before its text is spoken."""
    cancelled_at: list[float] = []
    cancelled = threading.Event()  # set on the gateway's thread
    cancel = FakeStream.cancel

    def timed_cancel(stream: FakeStream) -> None:
        cancelled_at.append(time.monotonic())
        cancelled.set()
        cancel(stream)

    monkeypatch.setattr(FakeStream, "cancel", timed_cancel)
    engine = FakeEngine(step_s=0.02)
    g = gateway_factory(engine)
    text = " ".join(f"word{i}." for i in range(40))
    tts = (
        lk_openai.TTS(voice="alloy", api_key="unused", base_url=f"{g.http}/v1")
        if plugin == "openai"
        else make_baseten(g, session)
    )
    try:
        stream: lk_tts.ChunkedStream | lk_tts.SynthesizeStream
        if plugin == "openai":
            stream = tts.synthesize(text)
        else:
            stream = tts.stream()
            stream.push_text(text)
            stream.flush()
        async for _ in stream:
            break
        closed_at = time.monotonic()
        await stream.aclose()
        await asyncio.to_thread(cancelled.wait, 5)
    finally:
        await tts.aclose()
    assert cancelled_at and cancelled_at[0] >= closed_at - 0.05
    assert engine.words_spoken < 40
