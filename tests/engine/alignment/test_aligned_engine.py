"""AlignedEngine over the fake tone engine: modes, batching across streams, cancel, failures."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import numpy as np
import pytest

from engine.alignment.engine import AlignedEngine
from engine.api import AudioChunk, SynthesisRequest, TextSegment
from tests.engine.alignment.fakes import SpreadAligner
from tests.fakes import FakeEngine

TEXT = ("Hello there. ", "How are you today? ", "Fine, thanks.")


async def speak(engine: AlignedEngine, rid: str, texts=TEXT, mode: str | None = None):
    stream = engine.open(SynthesisRequest(request_id=rid, language="English"))
    if mode is not None:
        stream.set_word_alignment(mode)
    at = 0
    for text in texts:
        stream.push(TextSegment(text, at))
        at += len(text)
    stream.close_text()
    return stream


async def collect(stream) -> list[AudioChunk]:
    return [c async for c in stream]


async def until_queued(engine: AlignedEngine, jobs: int) -> None:
    for _ in range(1000):  # the worker's queue is filled by the streams' pump tasks
        if engine.worker.queued >= jobs:
            return
        await asyncio.sleep(0.005)  # noqa: ASYNC110 (a test probe of another thread's queue)
    raise AssertionError(f"{jobs} jobs never queued")


def check_timeline(chunks: list[AudioChunk], text: str) -> None:
    """Contiguous audio, one final chunk at the end, words in order, inside the audio, from the aligner."""
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset
        offset += len(c.samples)
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    words = [w for c in chunks for w in c.words]
    assert words and all(w.source == "aligner" for w in words)
    assert all(a.end_sample <= b.start_sample for a, b in zip(words, words[1:], strict=False))
    assert all(0 <= w.start_sample <= w.end_sample <= offset for w in words)
    assert all(text[w.char_start : w.char_end] == w.text for w in words)


@pytest.fixture
def started(engines):
    """start(aligner=None, **options): an AlignedEngine over the tone engine (engines: conftest)."""

    def start(aligner=None, **options):
        return engines(FakeEngine(chunk_ms=40), aligner or SpreadAligner(), **options)

    return start


async def test_async_mode_passes_audio_first_and_words_follow(started):
    engine = await started()
    plain = FakeEngine(chunk_ms=40)
    await plain.start()
    reference = await collect(await speak(plain, "ref"))  # type: ignore[arg-type]
    chunks = await collect(await speak(engine, "a"))
    check_timeline(chunks, "".join(TEXT))
    audio = np.concatenate([c.samples for c in chunks])
    assert np.array_equal(audio, np.concatenate([c.samples for c in reference]))
    assert [
        w.text for c in chunks for w in c.words
    ] == "Hello there. How are you today? Fine, thanks.".split()
    # async: words come in words-only chunks, after the audio they describe
    sent = 0
    for c in chunks:
        sent += len(c.samples)
        if c.words:
            assert len(c.samples) == 0 and c.words[-1].end_sample <= sent


async def test_sync_mode_every_word_arrives_with_or_before_its_audio(started):
    engine = await started(default_mode="sync")
    chunks = await collect(await speak(engine, "s"))
    check_timeline(chunks, "".join(TEXT))
    sent = 0
    for c in chunks:
        sent += len(c.samples)
        assert all(w.end_sample <= sent for w in c.words)
    assert len(engine.sync_delays_ms()) == 1 and engine.sync_delays_ms()[0] >= 0
    extra = engine.load().extra
    assert extra["aligner_sync_added_ttfa_ms_p50"] == engine.sync_delays_ms()[0]
    assert extra["aligner_jobs"] == 3


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_an_answered_jobs_audio_is_not_kept_while_the_stream_lives(started, mode):
    """A long utterance holds no more than its outstanding jobs' windows, however many it had."""
    engine = await started(default_mode=mode)
    windows: list[weakref.ref[np.ndarray]] = []
    submit = engine.worker.submit

    def noting(job, done):
        windows.append(weakref.ref(job.audio))
        submit(job, done)

    engine.worker.submit = noting  # type: ignore[method-assign]
    texts = tuple(f"Sentence number {i} goes here. " for i in range(12))
    stream = await speak(engine, "long", texts)
    check_timeline(await collect(stream), "".join(texts))
    assert len(windows) >= 12

    def kept() -> list[weakref.ref[np.ndarray]]:
        gc.collect()
        return [ref for ref in windows if ref() is not None]

    # the aligner's thread may still be leaving its last call when the final chunk arrives: what
    # it let go of is gone within moments (longer on a loaded machine), while a window the stream
    # kept would stay for good, however long the wait
    for _ in range(500):
        if not kept():
            break
        await asyncio.sleep(0.02)
    assert kept() == []  # `stream` still lives


async def test_mode_per_stream_and_off_keeps_engine_words(started):
    engine = await started(default_mode="sync")
    off = await collect(await speak(engine, "o", mode="off"))
    assert {w.source for c in off for w in c.words} == {"engine"}
    asynced = await collect(await speak(engine, "a", mode="async"))
    assert {w.source for c in asynced for w in c.words} == {"aligner"}
    assert len(engine.sync_delays_ms()) == 0


async def test_ready_jobs_of_many_streams_share_one_batch(started):
    gate = threading.Event()
    aligner = SpreadAligner(gate=gate)
    engine = await started(aligner)
    first = await speak(engine, "first", texts=("One. ",))
    first_task = asyncio.create_task(collect(first))
    await asyncio.to_thread(aligner.entered.wait, 5)  # the first batch is in the aligner, held
    streams = [await speak(engine, f"s{i}", texts=("Two words. ",)) for i in range(6)]
    tasks = [asyncio.create_task(collect(s)) for s in streams]
    await until_queued(engine, 6)
    gate.set()
    check_timeline(await first_task, "One. ")
    for chunks in await asyncio.gather(*tasks):
        check_timeline(chunks, "Two words. ")
    assert [len(b) for b in aligner.batches] == [1, 6]
    assert engine.load().extra["aligner_largest_batch"] == 6


async def test_sync_jobs_go_before_async_ones(started):
    gate = threading.Event()
    aligner = SpreadAligner(gate=gate)
    engine = await started(aligner, max_batch=1)
    held = asyncio.create_task(collect(await speak(engine, "held", texts=("Zero. ",))))
    await asyncio.to_thread(aligner.entered.wait, 5)
    later = asyncio.create_task(collect(await speak(engine, "later", texts=("Later words. ",), mode="async")))
    await until_queued(engine, 1)
    urgent = asyncio.create_task(
        collect(await speak(engine, "urgent", texts=("Urgent words. ",), mode="sync"))
    )
    await until_queued(engine, 2)
    gate.set()
    await asyncio.gather(held, later, urgent)
    assert [b[0] for b in aligner.batches] == ["Zero. ", "Urgent words. ", "Later words. "]


async def test_a_failing_input_falls_back_to_the_engine_words_alone(started):
    aligner = SpreadAligner(fail_on="today")
    engine = await started(aligner)
    chunks = await collect(await speak(engine, "f"))
    sources = [(w.text, w.source) for c in chunks for w in c.words]
    assert (
        ("today?", "engine") in sources
        and ("Hello", "aligner") in sources
        and ("Fine,", "aligner") in sources
    )
    assert engine.load().extra["aligner_failures"] == 1


async def test_windows_longer_than_the_aligner_takes_keep_the_engine_words(started):
    engine = await started(SpreadAligner(max_audio_s=0.6))
    chunks = await collect(await speak(engine, "long"))
    sources = {w.text: w.source for c in chunks for w in c.words}
    assert sources["Hello"] == "aligner" and sources["today?"] == "engine"


async def test_cancel_stops_the_stream_and_the_wrapped_one(started):
    gate = threading.Event()
    aligner = SpreadAligner(gate=gate)
    engine = await started(aligner, default_mode="sync")
    stream = await speak(engine, "c")
    await asyncio.to_thread(aligner.entered.wait, 5)
    stream.cancel()
    gate.set()
    assert await asyncio.wait_for(collect(stream), 2) == []  # sync: nothing was released before the words
    assert stream.inner.cancelled  # type: ignore[attr-defined]
    assert engine.inner.load().active == 0


async def test_open_before_start_is_refused():
    engine = AlignedEngine(FakeEngine(), SpreadAligner)
    with pytest.raises(Exception, match="not started"):
        engine.open(SynthesisRequest(request_id="x"))
    await engine.start()  # the factory is called here
    assert engine.load().ready
    await engine.stop()


async def test_sync_streams_ask_the_engine_for_chunks_of_at_most_eight_frames(engines):
    from engine.alignment.engine import SYNC_SCHEDULE
    from engine.api import ChunkSchedule

    inner = FakeEngine(chunk_ms=40)
    engine = await engines(inner, SpreadAligner())
    own = ChunkSchedule(first=2, largest=16)
    asked = {
        "sync": SynthesisRequest(request_id="s", word_alignment="sync"),
        "async": SynthesisRequest(request_id="a", word_alignment="async"),
        "own": SynthesisRequest(request_id="o", word_alignment="sync", schedule=own),
    }
    streams = [engine.open(request) for request in asked.values()]
    got = {s.request.request_id: s.request.schedule for s in inner.streams}
    assert SYNC_SCHEDULE == ChunkSchedule(largest=8)
    assert got == {"s": SYNC_SCHEDULE, "a": ChunkSchedule(), "o": own}  # a schedule asked for is kept
    for stream in streams:
        stream.cancel()
