"""The null engine: real-time tone, 20 ms chunks, estimated words, one ticker for every stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.api import AudioChunk, Engine, Overloaded, SynthesisRequest, TextSegment, float_samples
from engine.null import CHUNK_SAMPLES, SAMPLE_RATE, NullEngine, estimate_words


@pytest.fixture
async def engine() -> AsyncIterator[NullEngine]:
    eng = NullEngine(max_streams=2000)
    await eng.start()
    yield eng
    await eng.stop()


async def run(eng: NullEngine, text: str, **request: object) -> tuple[list[AudioChunk], list[float]]:
    stream = eng.open(SynthesisRequest("r", **request))  # type: ignore[arg-type]
    stream.push(TextSegment(text, 0))
    stream.close_text()
    chunks, times = [], []
    async for chunk in stream:
        chunks.append(chunk)
        times.append(time.perf_counter())
    return chunks, times


async def test_ahead_of_real_time_in_larger_chunks() -> None:
    """chunk_ms=80, speed=4: 80 ms chunks every 20 ms; the words and the end are unchanged."""
    eng = NullEngine(chunk_ms=80, speed=4.0)
    await eng.start()
    try:
        chunks, times = await run(eng, "a b c d", forced_frames=4)  # 320 ms of audio
    finally:
        await eng.stop()
    audio = [c for c in chunks if len(c.samples)]
    assert [len(c.samples) for c in audio] == [1920] * 4
    assert [c.sample_offset for c in audio] == [0, 1920, 3840, 5760] and chunks[-1].final
    assert 0.04 < times[-1] - times[0] < 0.15  # 3 intervals of 20 ms, not 240 ms of real time
    assert [w.text for c in chunks for w in c.words] == ["a", "b", "c"]


@pytest.mark.parametrize("options", [{"chunk_ms": 30}, {"chunk_ms": 0}, {"speed": 0.0}])
def test_bad_chunk_or_speed_is_refused(options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        NullEngine(**options)  # type: ignore[arg-type]


def test_estimated_words_point_into_client_text() -> None:
    client = "Intro. Hello big world 你好"
    words, length = estimate_words(TextSegment(client[7:], char_start=7), start_sample=100)
    assert [client[w.char_start : w.char_end] for w in words] == ["Hello", "big", "world", "你", "好"]
    assert words[0].start_sample == 100 and words[-1].end_sample == 100 + length
    assert all(a.end_sample == b.start_sample for a, b in zip(words, words[1:], strict=False))
    assert all(w.source == "estimate" for w in words)


async def test_real_time_20ms_chunks_with_words(engine: NullEngine) -> None:
    assert isinstance(engine, Engine)
    chunks, times = await run(engine, "a b c d", forced_frames=4)  # 320 ms: "d" is cut, "c" clipped
    audio = [c for c in chunks if len(c.samples)]
    assert all(len(c.samples) == CHUNK_SAMPLES for c in audio)
    assert sum(len(c.samples) for c in audio) == 4 * 1920
    assert chunks[-1].final and [c.sample_offset for c in audio] == [i * CHUNK_SAMPLES for i in range(16)]
    elapsed = times[-1] - times[0]
    assert 0.25 < elapsed < 0.45  # 15 chunk intervals of 20 ms
    sent = 0
    for chunk in chunks:  # each word arrives with the chunk holding its start
        for word in chunk.words:
            assert sent <= word.start_sample < sent + max(len(chunk.samples), 1)
        sent += len(chunk.samples)
    words = [w for c in chunks for w in c.words]
    assert [w.text for w in words] == ["a", "b", "c"] and words[-1].end_sample == 4 * 1920


async def test_audio_is_int16_pcm_as_the_workers_hand_it(engine: NullEngine) -> None:
    """The real engines' form (engine.api.pcm16), so a load test measures their path: a 200 Hz
    tone at a tenth of full scale, every chunk the same whole periods."""
    chunks, _ = await run(engine, "a b", forced_frames=1)
    assert all(c.samples.dtype == np.int16 for c in chunks)
    audio = [c for c in chunks if len(c.samples)]
    tone = float_samples(audio[0].samples)
    assert abs(float(np.max(np.abs(tone))) - 0.1) < 1e-3
    assert all(np.array_equal(c.samples, audio[0].samples) for c in audio)


async def test_estimated_length_without_forcing(engine: NullEngine) -> None:
    chunks, _ = await run(engine, "abcdefghijklm")  # 13 chars + space = 1 s at 14 chars/s
    total = sum(len(c.samples) for c in chunks)
    assert total == SAMPLE_RATE


async def test_many_streams_share_one_ticker(engine: NullEngine) -> None:
    tasks_before = len(asyncio.all_tasks())
    began = time.perf_counter()
    streams = [engine.open(SynthesisRequest(f"s{i}", forced_frames=3)) for i in range(1000)]
    assert len(asyncio.all_tasks()) == tasks_before  # nothing per stream
    for stream in streams:
        stream.push(TextSegment("hello there", 0))
        stream.close_text()

    async def drain(stream: object) -> int:
        return sum([len(c.samples) async for c in stream])  # type: ignore[attr-defined]

    totals = await asyncio.gather(*(drain(s) for s in streams))
    assert set(totals) == {3 * 1920}
    assert time.perf_counter() - began < 1.5  # 240 ms of audio each, in real time, all together
    assert engine.load().active == 0


async def test_cancel_ends_iteration_and_frees_the_slot(engine: NullEngine) -> None:
    stream = engine.open(SynthesisRequest("c", forced_frames=100))
    stream.push(TextSegment("a long one", 0))
    received = 0
    async for chunk in stream:
        received += len(chunk.samples)
        if received >= 3 * CHUNK_SAMPLES:
            stream.cancel()
    assert received == 3 * CHUNK_SAMPLES
    assert engine.load().active == 0


async def test_starved_stream_waits_for_text_then_resumes_in_real_time(engine: NullEngine) -> None:
    stream = engine.open(SynthesisRequest("s"))
    stream.push(TextSegment("hi ", 0))  # 3 chars ~ 214 ms
    iterator = aiter(stream)
    first = await anext(iterator)
    await asyncio.sleep(0.4)  # the text ran out; nothing more arrives meanwhile
    stream.push(TextSegment("again", 3))
    stream.close_text()
    rest = [c async for c in iterator]
    offsets = [first.sample_offset] + [c.sample_offset for c in rest]
    assert offsets == sorted(offsets) and rest[-1].final
    assert [w.char_start for c in [first, *rest] for w in c.words] == [0, 3]


async def test_overloaded_beyond_capacity() -> None:
    eng = NullEngine(max_streams=1)
    await eng.start()
    eng.open(SynthesisRequest("a"))
    with pytest.raises(Overloaded):
        eng.open(SynthesisRequest("b"))
    await eng.stop()
