"""AlignedEngine's admission counts the aligner's share: streams past what the aligner keeps in real
time wait in its queue or are refused, "off" streams pass by it, and load() reports its share.

The aligner here is a stand-in whose cost per second of audio is set by the test (the real one
needs GPU weights no machine here has); it spends that cost as real busy time, which the worker
measures as it would the real one's."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from engine.alignment.api import AlignedWord, AlignInput
from engine.alignment.capacity import AlignerCapacity
from engine.alignment.engine import AlignedEngine, AlignedStream
from engine.alignment.track import AlignJob
from engine.alignment.worker import SWITCH_INTERVAL_S, AlignerWorker
from engine.api import AudioChunk, Overloaded, SynthesisRequest, TextSegment
from tests.engine.alignment.fakes import LateWordsEngine, SpreadAligner, ToneAligner
from tests.engine.alignment.test_aligned_engine import check_timeline
from tests.fakes import FakeEngine

TEXT = ("Hello there. ", "How are you?")


class CostlyAligner(SpreadAligner):
    """SpreadAligner that is busy `cost_s` seconds per second of the audio it is given."""

    def __init__(self, cost_s: float) -> None:
        super().__init__()
        self.cost_s = cost_s

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        time.sleep(self.cost_s * sum(len(audio) / rate for audio, rate, _, _ in batch))
        return super().align(batch)


def open_stream(engine: AlignedEngine, rid: str, mode: str | None = None, **request: object) -> AlignedStream:
    stream = engine.open(SynthesisRequest(request_id=rid, language="English", word_alignment=mode, **request))
    at = 0
    for text in TEXT:
        stream.push(TextSegment(text, at))
        at += len(text)
    stream.close_text()
    return stream


async def timed(stream: AlignedStream) -> tuple[list[AudioChunk], float, float]:
    """The chunks, when the last audio came and when the stream ended (its last words with it)."""
    chunks, audio_at = [], 0.0
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunk.samples):
            audio_at = time.monotonic()
    return chunks, audio_at, time.monotonic()


async def test_streams_past_the_aligners_capacity_wait_or_are_refused_and_admitted_words_keep_up(engines):
    # the wrapped engine speaks in real time: 40 ms of audio every 40 ms
    engine = await engines(
        FakeEngine(chunk_ms=40, step_s=0.04),
        CostlyAligner(0.2),
        queue_limit=2,
        cost=AlignerCapacity(headroom=0.7, window_s=0.2),
    )
    await timed(open_stream(engine, "alone"))  # the aligner measures what a second of audio costs it
    load = engine.load()
    assert load.extra["aligner_capacity"] == 3  # 0.2 of real time a stream: three within 0.7
    assert load.extra["aligner_streams"] == 0 and load.extra["aligner_share"] == 0.0

    streams = [open_stream(engine, f"s{i}") for i in range(5)]
    assert [s.queue_position() is None for s in streams] == [True, True, True, False, False]
    assert [p.position for s in streams[3:] if (p := s.queue_position()) is not None] == [1, 2]
    assert all(s.inner is None for s in streams[3:])  # not yet given to the wrapped engine
    with pytest.raises(Overloaded) as refused:
        open_stream(engine, "one too many")
    assert refused.value.retry_after_s >= 0.5

    load = engine.load()
    assert (load.capacity, load.queued) == (3, 2)
    assert load.extra["aligner_streams"] == 3 and load.extra["aligner_streams_queued"] == 2
    assert 0.5 <= load.extra["aligner_share"] <= 0.7
    assert load.admission is not None and load.admission.refused["queue_full"] == 1
    assert (load.admission.queued, load.admission.capacity) == (2, 3)

    most, backlog, done = 0, 0.0, asyncio.Event()

    async def watch() -> None:
        nonlocal most, backlog
        while not done.is_set():
            extra = engine.load().extra
            most = max(most, int(extra["aligner_streams"]))
            backlog = max(backlog, extra["aligner_backlog_s"])
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    results = await asyncio.wait_for(asyncio.gather(*(timed(s) for s in streams)), 30)
    done.set()
    await watcher
    assert most == 3  # never more aligned streams than the aligner keeps in real time
    assert backlog <= engine.cost.backlog_limit_s
    for chunks, audio_at, ended_at in results:
        check_timeline(chunks, "".join(TEXT))
        assert ended_at - audio_at < 2.0  # the words came soon after the audio (generous bound)
    assert all(s.queue_wait_s() > 0 for s in streams[3:])  # admitted as the first ones ended
    assert engine.load().admission.queued_total == 2  # type: ignore[union-attr]


class OpenWatchingEngine(FakeEngine):
    """tests.fakes.FakeEngine that calls `on_open` as each request reaches it."""

    on_open = staticmethod(lambda: None)

    def open(self, request: SynthesisRequest):  # type: ignore[no-untyped-def]
        self.on_open()
        return super().open(request)


async def test_a_backlog_over_its_limit_holds_new_aligned_streams_until_it_drains(engines):
    inner = OpenWatchingEngine(chunk_ms=40)
    engine = await engines(inner, CostlyAligner(0.2), cost=AlignerCapacity(backlog_limit_s=0.1))
    rate, aligned = engine.info.sample_rate, threading.Semaphore(0)
    backlog_at_open: list[float] = []
    inner.on_open = lambda: backlog_at_open.append(engine.cost.backlog_s(engine.worker.queued_audio_s))

    def submit(seconds: float) -> None:
        samples = np.zeros(int(rate * seconds), np.float32)
        job = AlignJob("other", 0, samples, rate, "one two", "English", (), 0, len(samples), ())
        engine.worker.submit(job, lambda *_: aligned.release())

    submit(0.5)  # priced: 0.2 s of aligner a second
    assert await asyncio.to_thread(aligned.acquire, True, 5)
    submit(1.0)
    submit(2.0)  # behind it: 0.4 s of the aligner's work waits
    stream = open_stream(engine, "new")
    assert stream.queue_position() is not None and stream.inner is None  # room, but words would lag
    assert engine.load().extra["aligner_backlog_s"] > 0.1 and backlog_at_open == []
    check_timeline((await asyncio.wait_for(timed(stream), 10))[0], "".join(TEXT))
    assert len(backlog_at_open) == 1 and backlog_at_open[0] <= 0.1  # admitted once it drained
    assert stream.queue_wait_s() > 0


async def test_off_streams_pass_the_aligner_and_a_queued_one_turned_off_goes_at_once(engines):
    gate = threading.Event()
    aligner = SpreadAligner(gate=gate)  # its first batch waits on the gate: the aligner is busy
    engine = await engines(
        FakeEngine(chunk_ms=40),
        aligner,
        queue_limit=4,
        cost=AlignerCapacity(initial_streams=1, window_s=3600.0),  # one aligned stream at a time
    )
    held = open_stream(engine, "held")
    held_task = asyncio.create_task(timed(held))
    await asyncio.to_thread(aligner.entered.wait, 5)
    waiting = open_stream(engine, "waiting", mode="async")
    assert waiting.queue_position() is not None and waiting.inner is None
    with pytest.raises(Overloaded):
        open_stream(engine, "impatient", max_wait_s=0.0)  # its own max wait, at the aligner's queue

    offs = [open_stream(engine, f"off{i}", mode="off") for i in range(3)]
    assert all(s.queue_position() is None for s in offs)
    load = engine.load()
    assert load.extra["aligner_streams"] == 1 and load.extra["aligner_streams_queued"] == 1
    assert load.capacity == 1 + 3  # the aligner's one, and the "off" streams beside it
    for chunks, _, _ in await asyncio.wait_for(asyncio.gather(*(timed(s) for s in offs)), 10):
        assert chunks[-1].final and {w.source for c in chunks for w in c.words} == {"engine"}
    assert not held_task.done()  # the "off" streams ended while the aligner still held the first

    turned = open_stream(engine, "turned off")
    assert turned.queue_position() is not None
    turned.set_word_alignment("off")  # before its first chunk: it leaves the aligner's queue
    assert turned.queue_position() is None and turned.inner is not None
    chunks, _, _ = await asyncio.wait_for(timed(turned), 10)
    assert {w.source for c in chunks for w in c.words} == {"engine"}
    assert engine.load().extra["aligner_streams_queued"] == 1  # "waiting" still waits

    gate.set()
    check_timeline((await asyncio.wait_for(held_task, 10))[0], "".join(TEXT))
    check_timeline((await asyncio.wait_for(timed(waiting), 10))[0], "".join(TEXT))
    assert engine.load().admission.refused["max_wait"] == 1  # type: ignore[union-attr]


async def test_an_off_stream_asking_for_words_joins_the_aligner_only_with_room(engines):
    gate = threading.Event()
    aligner = SpreadAligner(gate=gate)
    engine = await engines(
        FakeEngine(chunk_ms=40),
        aligner,
        default_mode="off",
        cost=AlignerCapacity(initial_streams=1, window_s=3600.0),
    )
    first = engine.open(SynthesisRequest(request_id="first", language="English"))
    first.set_word_alignment("async")
    assert first.ticket is not None and first.ticket.admitted_at is not None
    second = engine.open(SynthesisRequest(request_id="second", language="English"))
    second.set_word_alignment("async")  # no room: refused, its wrapped stream stopped
    with pytest.raises(Overloaded):
        await asyncio.wait_for(timed(second), 5)
    assert second.inner is not None and second.inner.cancelled  # type: ignore[attr-defined]
    gate.set()
    first.cancel()


async def test_the_streams_audio_counts_once_however_often_probes_align_it(engines):
    engine = await engines(LateWordsEngine(chunk_ms=80, step_s=0.004), ToneAligner(), default_mode="sync")
    texts = ("Sure, I can help you with that today. ", "Anything else you need from me?")
    stream = engine.open(SynthesisRequest(request_id="s", language="English"))
    at = 0
    for text in texts:
        stream.push(TextSegment(text, at))
        at += len(text)
    stream.close_text()
    chunks = [c async for c in stream]
    stats = engine.worker.stats
    total_s = sum(len(c.samples) for c in chunks) / engine.info.sample_rate
    assert stats.probes > 0 and stats.audio_s > total_s  # probes aligned some of it again
    assert stats.stream_audio_s == pytest.approx(total_s)
    extra = engine.load().extra
    assert extra["aligner_stream_audio_s"] == pytest.approx(total_s)
    assert extra["aligner_audio_s"] == pytest.approx(stats.audio_s)
    # the stand-in for trained weights keeps a word's times as the window grows: probes send words
    assert extra["aligner_probe_words"] > 0


def test_the_worker_counts_its_backlog_and_reports_each_call() -> None:
    calls: list[tuple[float, float, int]] = []
    gate = threading.Event()
    worker = AlignerWorker(SpreadAligner(gate=gate), on_batch=lambda *call: calls.append(call))

    def job(seconds: float, fresh: float) -> AlignJob:
        samples = np.zeros(int(1000 * seconds), np.float32)
        return AlignJob("r", 0, samples, 1000, "one two", "English", (), 0, len(samples), (), fresh_s=fresh)

    worker.start()
    try:
        worker.submit(job(1.0, 1.0), lambda *_: None)
        assert worker.aligner.entered.wait(5)  # type: ignore[attr-defined]
        cancelled = job(2.0, 2.0)
        worker.submit(cancelled, lambda *_: None)
        worker.submit(job(1.5, 0.5), lambda *_: None)
        assert worker.queued_audio_s == pytest.approx(3.5)
        cancelled.cancelled = True
        gate.set()
        for _ in range(500):
            if len(calls) == 2:
                break
            time.sleep(0.01)
    finally:
        worker.stop()
    assert worker.queued_audio_s == 0.0
    assert [(audio, jobs) for _, audio, jobs in calls] == [(1.0, 1), (1.5, 1)]
    assert worker.stats.stream_audio_s == pytest.approx(1.5)


def test_jobs_without_urgency_wait_to_share_a_call_and_an_urgent_one_goes_at_once() -> None:
    calls: list[tuple[float, float, int]] = []
    worker = AlignerWorker(SpreadAligner(), on_batch=lambda *call: calls.append(call), gather_s=0.3)

    def job(urgent: bool = False) -> AlignJob:
        samples = np.zeros(1000, np.float32)
        return AlignJob("r", 0, samples, 1000, "one two", "English", (), 0, len(samples), (), urgent=urgent)

    def wait_for(count: int) -> None:
        for _ in range(500):
            if len(calls) >= count:
                return
            time.sleep(0.005)

    worker.start()
    try:
        began = time.monotonic()
        for _ in range(3):
            worker.submit(job(), lambda *_: None)
            time.sleep(0.02)
        wait_for(1)
        gathered_after = time.monotonic() - began
        assert [jobs for *_, jobs in calls] == [3]  # one call for all three
        assert gathered_after >= 0.3
        began = time.monotonic()
        worker.submit(job(), lambda *_: None)
        worker.submit(job(urgent=True), lambda *_: None)  # takes the waiting one along
        wait_for(2)
        assert time.monotonic() - began < 0.25
        assert [jobs for *_, jobs in calls] == [3, 2]
    finally:
        worker.stop()


def test_the_worker_shortens_the_gil_switch_interval_while_it_runs_and_puts_it_back() -> None:
    # a call readies its inputs in Python: a thread waking meanwhile (the engine's step thread back
    # from the GPU) must get the interpreter within a fraction of a millisecond, not CPython's 5 ms
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        worker = AlignerWorker(SpreadAligner())
        worker.start()
        try:
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S, rel=0.05)
        finally:
            worker.stop()
        assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
        sys.setswitchinterval(0.0001)  # an interval already shorter is kept
        worker = AlignerWorker(SpreadAligner())
        worker.start()
        try:
            assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)  # kept in whole microseconds
        finally:
            worker.stop()
    finally:
        sys.setswitchinterval(before)
