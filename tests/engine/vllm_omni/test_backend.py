"""The vllm-omni engine backend against the vLLM-Omni simulator on loopback."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from dataclasses import replace

import numpy as np
import pytest
import soundfile

from engine.api import (
    AudioChunk,
    EngineError,
    InvalidAudio,
    InvalidRequest,
    Overloaded,
    SynthesisRequest,
    TextSegment,
    UnknownVoice,
    WordTiming,
)
from engine.vllm_omni.engine import (
    SAMPLE_RATE,
    UpstreamCrashed,
    VllmOmniConfig,
    VllmOmniEngine,
    aligned_words,
    estimate_words,
    upstream_error,
)
from tests.engine.vllm_omni.conftest import FAST, engine_for
from tests.engine.vllm_omni.simulator import RunningSimulator, sentence_pcm, sentence_samples

pytestmark = pytest.mark.timeout(30)

TEXT = ("Hello there, my friend. ", "How are you today?")


def segments(parts: tuple[str, ...] = TEXT) -> list[TextSegment]:
    out, at = [], 0
    for part in parts:
        out.append(TextSegment(part, at))
        at += len(part)
    return out


async def collect(stream, limit_s: float = 10.0) -> list[AudioChunk]:  # type: ignore[no-untyped-def]
    async def run() -> list[AudioChunk]:
        return [chunk async for chunk in stream]

    return await asyncio.wait_for(run(), limit_s)


async def speak(engine: VllmOmniEngine, parts: tuple[str, ...] = TEXT, **request: object) -> list[AudioChunk]:
    stream = engine.open(SynthesisRequest(request_id="r", **request))  # type: ignore[arg-type]
    for segment in segments(parts):
        stream.push(segment)
    stream.close_text()
    return await collect(stream)


def audio_of(chunks: list[AudioChunk]) -> np.ndarray:
    return np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)


def words_of(chunks: list[AudioChunk]) -> list[WordTiming]:
    return [w for c in chunks for w in c.words]


async def until(predicate, limit_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- streaming over the WebSocket -------------------------------------------------------------------


async def test_websocket_stream_delivers_the_upstream_pcm_in_order(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    chunks = await speak(engine, voice="ryan", language="English", instructions="Warmly.", seed=7)
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    offsets = [c.sample_offset for c in chunks]
    assert offsets == sorted(offsets)
    audio = audio_of(chunks)
    expected = b"".join(sentence_pcm(p.strip(), sim.options.ms_per_char) for p in TEXT)
    np.testing.assert_array_equal(audio, np.frombuffer(expected, "<i2").astype(np.float32) / 32768.0)
    assert sim.stats.ws_connections == 1 and sim.stats.http_requests == 0
    assert sim.stats.texts == [p.strip() for p in TEXT]
    config = sim.stats.configs[0]
    assert (
        config["voice"] == "ryan" and config["language"] == "English" and config["instructions"] == "Warmly."
    )
    assert config["seed"] == 7 and config["stream_audio"] is True and config["response_format"] == "pcm"
    assert engine.load().active == 0 and engine.load().extra["open_streams"] == 0


async def test_estimated_words_point_into_the_client_text(engine: VllmOmniEngine) -> None:
    chunks = await speak(engine)
    words = words_of(chunks)
    full = "".join(TEXT)
    assert [w.text for w in words] == full.split()
    assert all(full[w.char_start : w.char_end] == w.text for w in words)
    assert all(w.source == "estimate" for w in words)
    first_len = sentence_samples(TEXT[0].strip(), 40.0)
    second = [w for w in words if w.char_start >= len(TEXT[0])]
    assert second[0].start_sample == first_len  # on the utterance timeline, after the first segment
    assert words[-1].end_sample == len(audio_of(chunks))


async def test_aligner_word_timestamps_when_the_upstream_has_one(sim: RunningSimulator) -> None:
    sim.options.forced_aligner = True
    engine = engine_for(sim, word_timestamps=True)
    await engine.start()
    try:
        chunks = await speak(engine)
    finally:
        await engine.stop()
    assert sim.stats.configs[0]["word_timestamps"] is True
    words = words_of(chunks)
    assert words and all(w.source == "aligner" for w in words)
    full = "".join(TEXT)
    assert [w.text for w in words] == [w.strip(".,!?") for w in full.split()]
    assert all(full[w.char_start : w.char_end] == w.text for w in words)
    assert len(audio_of(chunks)) == sum(sentence_samples(p.strip(), 40.0) for p in TEXT)


async def test_without_an_aligner_word_times_fall_back_to_estimates(sim: RunningSimulator) -> None:
    engine = engine_for(sim, word_timestamps=True)
    await engine.start()
    try:
        chunks = await speak(engine)
        assert chunks[-1].final and not engine.word_timestamps
        assert [c["word_timestamps"] for c in sim.stats.configs] == [True, False]
        words = words_of(chunks)
        assert [w.text for w in words] == "".join(TEXT).split() and all(w.source == "estimate" for w in words)
        await speak(engine, ("Once more.",))
        assert len(sim.stats.configs) == 3 and sim.stats.configs[-1]["word_timestamps"] is False
    finally:
        await engine.stop()


async def test_a_segment_language_replaces_the_session_config(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    stream = engine.open(SynthesisRequest("r", language="English"))
    stream.push(TextSegment("Good morning. ", 0))
    stream.push(TextSegment("Bonjour à tous.", 14, language="French"))
    stream.close_text()
    await collect(stream)
    assert [c["language"] for c in sim.stats.configs] == ["English", "French"]
    assert sim.stats.ws_connections == 1


async def test_slow_start_and_audio_speed(sim: RunningSimulator, engine: VllmOmniEngine) -> None:
    sim.options.first_audio_delay_s = 0.3
    sim.options.speed = 4.0
    stream = engine.open(SynthesisRequest("r"))
    stream.push(TextSegment("One two three four five six.", 0))
    stream.close_text()
    began = time.monotonic()
    first_at = None
    total = 0
    async for chunk in stream:
        if len(chunk.samples) and first_at is None:
            first_at = time.monotonic() - began
        total += len(chunk.samples)
    elapsed = time.monotonic() - began
    assert first_at is not None and first_at >= 0.3
    assert elapsed >= 0.3 + total / SAMPLE_RATE / 4.0 * 0.9  # paced at 4x real time


# -- cancel and capacity -------------------------------------------------------------------------------


async def test_cancel_closes_the_upstream_stream_at_once(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    sim.options.speed = 1.0  # real time: the sentence would take seconds
    stream = engine.open(SynthesisRequest("r"))
    stream.push(TextSegment("A long sentence that takes a few seconds to speak out loud at real time.", 0))
    got: list[AudioChunk] = []

    async def read() -> None:
        async for chunk in stream:
            got.append(chunk)

    reader = asyncio.create_task(read())
    await until(lambda: bool(got))
    cancelled_at = time.monotonic()
    stream.cancel()
    await asyncio.wait_for(reader, 1.0)
    await until(lambda: sim.stats.aborted == 1, 1.0)
    assert sim.stats.abort_times[0] - cancelled_at < 0.5
    assert not any(c.final for c in got)
    await until(lambda: engine.load().active == 0 and engine.load().extra["open_streams"] == 0)


async def test_concurrent_upstream_streams_are_bounded_and_queued(sim: RunningSimulator) -> None:
    sim.options.speed = 10.0
    engine = engine_for(sim, max_streams=2, queue_limit=3)
    await engine.start()
    try:
        streams = [engine.open(SynthesisRequest(f"r{i}")) for i in range(5)]
        with pytest.raises(Overloaded):
            engine.open(SynthesisRequest("one too many"))
        for i, stream in enumerate(streams):
            stream.push(TextSegment(f"Stream number {i} speaks a sentence.", 0))
            stream.close_text()
        queued_seen = 0

        async def watch() -> None:
            nonlocal queued_seen
            while True:
                queued_seen = max(queued_seen, engine.load().queued)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(collect(s) for s in streams))
        watcher.cancel()
        assert all(r[-1].final and len(audio_of(r)) > 0 for r in results)
        assert sim.stats.peak_active == 2 and sim.stats.crashes == 0
        assert queued_seen >= 1
        assert engine.load().active == 0 and engine.load().queued == 0
    finally:
        await engine.stop()


# -- errors ------------------------------------------------------------------------------------------


async def test_unknown_voice_is_refused_at_open(engine: VllmOmniEngine) -> None:
    assert "vivian" in engine.info.voices  # discovered from GET /v1/audio/voices
    assert engine.info.model == "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
    with pytest.raises(UnknownVoice):
        engine.open(SynthesisRequest("r", voice="nobody"))
    with pytest.raises(InvalidRequest):
        engine.open(SynthesisRequest("r", language="Klingon"))


async def test_upstream_voice_error_maps_to_unknown_voice(sim: RunningSimulator) -> None:
    engine = engine_for(sim, voices=("ghost",))  # the list we were told is wrong
    await engine.start()
    try:
        with pytest.raises(UnknownVoice, match="ghost"):
            await speak(engine, voice="ghost")
    finally:
        await engine.stop()


async def test_generation_error_after_partial_audio(sim: RunningSimulator, engine: VllmOmniEngine) -> None:
    sim.options.fail_after_chunks = 2
    stream = engine.open(SynthesisRequest("r"))
    stream.push(TextSegment("This sentence will fail half way through its audio.", 0))
    stream.close_text()
    got: list[AudioChunk] = []
    with pytest.raises(EngineError, match="simulated generation failure"):
        async for chunk in stream:
            got.append(chunk)
    assert len(got) == 2 and not any(c.final for c in got)
    assert engine.load().ready  # a failed request is not an outage


async def test_disconnect_before_audio_reconnects(sim: RunningSimulator, engine: VllmOmniEngine) -> None:
    sim.options.disconnect_after_chunks = 0
    sim.options.disconnect_times = 2
    chunks = await speak(engine)
    assert chunks[-1].final
    assert len(audio_of(chunks)) == sum(sentence_samples(p.strip(), 40.0) for p in TEXT)
    assert sim.stats.ws_connections == 3 and engine.reconnects == 2


async def test_disconnect_mid_sentence_fails_the_stream(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    sim.options.disconnect_after_chunks = 2
    with pytest.raises(EngineError, match="mid-sentence"):
        await speak(engine)
    assert sim.stats.ws_connections == 1


async def test_crash_over_max_num_seqs_marks_the_upstream_down_until_restarted(sim: RunningSimulator) -> None:
    sim.options.max_num_seqs = 1  # the engine is misconfigured with more streams than the server takes
    sim.options.speed = 5.0
    engine = engine_for(sim, max_streams=3)
    await engine.start()
    try:
        streams = [engine.open(SynthesisRequest(f"r{i}")) for i in range(2)]
        for stream in streams:
            stream.push(TextSegment("Two requests at once kill this server.", 0))
            stream.close_text()
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert all(isinstance(r, UpstreamCrashed) for r in results), results
        assert sim.stats.crashes == 1
        await until(lambda: not engine.load().ready, 1.0)
        with pytest.raises(Overloaded, match="unavailable"):
            engine.open(SynthesisRequest("while down"))
        sim.simulator.restart()
        await until(lambda: engine.load().ready, 3.0)
        assert engine.health.outages == 1
        chunks = await speak(engine, ("Back again.",))
        assert chunks[-1].final and len(audio_of(chunks)) == sentence_samples("Back again.", 40.0)
    finally:
        await engine.stop()


async def test_unreachable_upstream_starts_not_ready() -> None:
    engine = VllmOmniEngine(
        VllmOmniConfig(
            upstream="http://127.0.0.1:9", connect_timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.1
        )
    )
    await engine.start()
    try:
        load = engine.load()
        assert not load.ready and load.extra["upstream_up"] == 0.0
        await until(lambda: engine.health.probes >= 3, 3.0)  # keeps probing with backoff
        with pytest.raises(Overloaded):
            engine.open(SynthesisRequest("r"))
    finally:
        await engine.stop()


# -- HTTP fallback -------------------------------------------------------------------------------------


async def test_http_fallback_where_the_websocket_is_absent(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    sim.options.websocket = False
    chunks = await speak(engine, voice="vivian", instructions="Calmly.")
    assert chunks[-1].final
    assert len(audio_of(chunks)) == sum(sentence_samples(p.strip(), 40.0) for p in TEXT)
    assert sim.stats.http_requests == 2 and sim.stats.ws_connections == 0
    body = sim.stats.http_bodies[0]
    assert body["stream"] is True and body["stream_format"] == "audio" and body["response_format"] == "pcm"
    assert body["voice"] == "vivian" and body["instructions"] == "Calmly." and body["input"] == TEXT[0]
    assert engine.load().extra["transport_http"] == 1.0
    assert [w.text for w in words_of(chunks)] == "".join(TEXT).split()


async def test_speed_goes_over_http_and_http_errors_are_typed(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    await speak(engine, ("Quickly now.",), speed=1.5)
    assert sim.stats.http_bodies[0]["speed"] == 1.5 and sim.stats.ws_connections == 0
    engine.info = replace(engine.info, voices=())  # as if the server had no voice list
    sim.options.websocket = False
    with pytest.raises(UnknownVoice, match="ghost"):
        await speak(engine, voice="ghost")


async def test_http_cancel_closes_the_response(sim: RunningSimulator) -> None:
    sim.options.websocket = False
    sim.options.speed = 1.0
    engine = engine_for(sim, transport="http")
    await engine.start()
    try:
        stream = engine.open(SynthesisRequest("r"))
        stream.push(
            TextSegment("A long sentence that takes a few seconds to speak out loud at real time.", 0)
        )
        got: list[AudioChunk] = []

        async def read() -> None:
            async for chunk in stream:
                got.append(chunk)

        reader = asyncio.create_task(read())
        await until(lambda: bool(got))
        stream.cancel()
        await asyncio.wait_for(reader, 1.0)
        await until(lambda: sim.stats.aborted == 1, 2.0)
    finally:
        await engine.stop()


# -- voices --------------------------------------------------------------------------------------------


def _clip(seconds: float, rate: int = 16_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.2 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)


async def test_reference_audio_clone_and_registered_voice(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    await speak(engine, ("Cloned.",), ref_audio=(_clip(2.0), 16_000), ref_text="the transcript")
    config = sim.stats.configs[-1]
    assert config["task_type"] == "Base" and config["ref_text"] == "the transcript"
    assert config["ref_audio"].startswith("data:audio/wav;base64,")
    decoded, rate = soundfile.read(io.BytesIO(base64.b64decode(config["ref_audio"].split(",", 1)[1])))
    assert rate == 16_000 and abs(len(decoded) - 32_000) <= 1

    await engine.register_voice("mine", _clip(3.0, 48_000), 48_000, None)
    await speak(engine, ("Registered.",), voice="mine")
    config = sim.stats.configs[-1]
    assert config["task_type"] == "Base" and config["x_vector_only_mode"] is True and "voice" not in config
    _, rate = soundfile.read(io.BytesIO(base64.b64decode(config["ref_audio"].split(",", 1)[1])))
    assert rate == SAMPLE_RATE  # resampled down to keep session.config small

    with pytest.raises(InvalidAudio):
        await engine.register_voice("short", _clip(0.5), 16_000, "hi")
    with pytest.raises(InvalidRequest):
        engine.open(SynthesisRequest("r", instructions="x" * 501))


# -- pure functions --------------------------------------------------------------------------------------


def test_error_mapping() -> None:
    assert isinstance(
        upstream_error("Generation failed for utterance 0, sentence 0: Invalid speaker 'x'."), UnknownVoice
    )
    crash = upstream_error("Generation failed for utterance 1, sentence 0: EngineDeadError: boom")
    assert isinstance(crash, UpstreamCrashed) and "utterance" not in str(crash)
    busy = upstream_error("Too Many Requests", 429, retry_after_s=3.0)
    assert isinstance(busy, Overloaded) and busy.retry_after_s == 3.0
    assert isinstance(upstream_error("Invalid session config: bad", None), InvalidRequest)
    assert isinstance(upstream_error("ref_audio must be 1-30 seconds"), InvalidAudio)
    assert isinstance(upstream_error("something odd", 500), UpstreamCrashed)
    assert type(upstream_error("something odd")) is EngineError


def test_word_mapping_with_an_offset_segment() -> None:
    segment = TextSegment("Hi there, you.", 100)
    stamps = [
        {"word": "Hi", "start_ms": 0, "end_ms": 100},
        {"word": "there", "start_ms": 120, "end_ms": 300},
        {"word": "zzz", "start_ms": 300, "end_ms": 310},
        {"word": "you", "start_ms": 320, "end_ms": 500},
    ]
    words = aligned_words(segment, 2400, stamps)
    assert [(w.text, w.char_start, w.char_end) for w in words] == [
        ("Hi", 100, 102),
        ("there", 103, 108),
        ("you", 110, 113),
    ]
    assert words[1].start_sample == 2400 + 2880 and words[1].end_sample == 2400 + 7200
    estimated = estimate_words(TextSegment("你好 world", 0), 0, 9000)
    assert [w.text for w in estimated] == ["你", "好", "world"]
    assert estimated[-1].end_sample == 9000


def test_ws_url_follows_the_scheme() -> None:
    assert VllmOmniConfig(upstream="http://h:8091/").ws_url == "ws://h:8091/v1/audio/speech/stream"
    assert VllmOmniConfig(upstream="https://h").ws_url == "wss://h/v1/audio/speech/stream"
    assert FAST.upstream.startswith("http://")


async def test_a_slow_upstream_admits_fewer_streams_than_its_slots(sim: RunningSimulator) -> None:
    """Segments measured slower than real time at two generating at once: admission falls below
    `max_streams`, and the next stream waits in the queue (with its position) instead."""
    sim.options.speed = 10.0
    engine = engine_for(sim, max_streams=4, queue_limit=4)
    await engine.start()
    try:
        for _ in range(3):
            engine.measured(2, 2.0, 1.0)  # RTF 2 at two segments upstream
        assert engine.load().capacity < 4
        first = [engine.open(SynthesisRequest(f"r{i}")) for i in range(engine.load().capacity)]
        waiting = engine.open(SynthesisRequest("waits"))
        position = waiting.queue_position()
        assert position is not None and position.position == 1
        assert engine.load().admission.queued == 1  # type: ignore[union-attr]
        for stream in [*first, waiting]:
            stream.push(TextSegment("A sentence for the upstream.", 0))
            stream.close_text()
        results = await asyncio.gather(*(collect(s) for s in [*first, waiting]))
        assert all(r[-1].final for r in results) and waiting.queue_wait_s() > 0
    finally:
        await engine.stop()
