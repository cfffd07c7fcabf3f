"""The stage under faults: a device call whose readiness check raises still answers its jobs, answers
the aligner gets wrong fall back without stopping its worker, a stream whose wrapped engine fails
takes its queued jobs out of the aligner's queue, and a stream turned from "off" with no room for it
is refused rather than queued behind its open wrapped stream."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from engine.alignment.api import AlignedWord, AlignInput
from engine.alignment.capacity import AlignerCapacity
from engine.alignment.track import AlignJob, JobPiece
from engine.alignment.worker import AlignerWorker
from engine.api import EngineError, Overloaded, SynthesisRequest, TextSegment, WordTiming
from tests.engine.alignment.fakes import HandFedEngine, SpreadAligner
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)


class _BrokenCall:
    """A submitted call whose device reports an error when asked whether it is done."""

    def ready(self) -> bool:
        raise RuntimeError("device error")

    def wait(self) -> None:
        raise RuntimeError("device error")


class BrokenDevice:
    """A split aligner whose device fails after submission; `align` alone still works."""

    max_audio_s = 300.0

    def __init__(self) -> None:
        self.inner = SpreadAligner()

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        return self.inner.align(batch)

    def submit(self, batch: Sequence[AlignInput]) -> _BrokenCall:
        return _BrokenCall()

    def collect(self, call: _BrokenCall) -> list[list[AlignedWord]]:
        call.wait()
        return []


def _job(text: str) -> AlignJob:
    samples = np.zeros(2000, np.float32)
    pieces = (JobPiece(TextSegment(text, char_start=0), 0),)
    return AlignJob("r", 0, samples, 1000, text, "English", pieces, 0, len(samples), (), urgent=True)


def test_a_call_whose_readiness_check_raises_still_answers_its_jobs() -> None:
    answered: list[tuple[WordTiming, ...]] = []
    done = threading.Event()

    def on_done(_: AlignJob, words: tuple[WordTiming, ...]) -> None:
        answered.append(words)
        done.set()

    worker = AlignerWorker(BrokenDevice())
    worker.start()
    try:
        worker.submit(_job("still aligned"), on_done)
        assert done.wait(3), "the worker died on the device error: the job is never answered"
        # and it keeps serving
        done.clear()
        worker.submit(_job("next one"), on_done)
        assert done.wait(3)
    finally:
        worker.stop()
    assert [[w.text for w in words] for words in answered] == [["still", "aligned"], ["next", "one"]]


class WrongAnswers(SpreadAligner):
    """Answers batches of more than one input with one list too few, and times a word "nan"."""

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        out = super().align(batch)
        if any("nan" in text for _, _, text, _ in batch):
            return [[replace(w, start_s=float("nan")) for w in words] for words in out]
        return out[:-1] if len(out) > 1 else out


def test_answers_the_aligner_gets_wrong_fall_back_and_the_worker_goes_on() -> None:
    """Too few answers for a batch: each input is aligned alone; words it cannot place: the
    engine's own; either way every job is answered and later ones are still aligned."""
    answered: dict[str, tuple[WordTiming, ...]] = {}
    gate = threading.Event()
    texts = ["held first", "then these", "two together", "nan here", "after all"]

    def on_done(job: AlignJob, words: tuple[WordTiming, ...]) -> None:
        with landed:
            answered[job.text] = words
            landed.notify_all()

    def until_answered(count: int) -> None:
        with landed:
            assert landed.wait_for(lambda: len(answered) == count, 3), (
                f"unanswered: {set(texts) - set(answered)}"
            )

    landed = threading.Condition()
    aligner = WrongAnswers(gate=gate)
    worker = AlignerWorker(aligner)
    worker.start()
    try:
        worker.submit(_job(texts[0]), on_done)
        assert aligner.entered.wait(3)
        worker.submit(_job(texts[1]), on_done)  # queued behind the held call: one batch of two
        worker.submit(_job(texts[2]), on_done)
        gate.set()
        until_answered(3)
        worker.submit(_job(texts[3]), on_done)
        until_answered(4)
        worker.submit(_job(texts[4]), on_done)
        until_answered(5)
    finally:
        worker.stop()
    assert [w.text for w in answered["then these"]] == ["then", "these"]  # aligned alone
    assert [w.text for w in answered["two together"]] == ["two", "together"]
    assert answered["nan here"] == ()  # the job's fallback: the engine gave no words here
    assert [w.text for w in answered["after all"]] == ["after", "all"]
    assert worker.stats.failures == 1


async def test_a_failed_stream_takes_its_queued_jobs_out_of_the_aligner(engines) -> None:
    gate = threading.Event()
    aligner = SpreadAligner(gate=gate)
    # the stream fails once its first six words (its first two segments) are spoken
    engine = await engines(FakeEngine(chunk_ms=40, fail_after_words=6), aligner)
    blocker = engine.open(SynthesisRequest(request_id="blocker", language="English"))
    blocker.push(TextSegment("One. ", 0))
    blocker.close_text()
    await asyncio.to_thread(aligner.entered.wait, 5)  # the aligner is busy with it, held

    texts = ("Hello there. ", "How are you today? ", "Fine, thanks.")
    failing = engine.open(SynthesisRequest(request_id="failing", language="English"))
    at = 0
    for text in texts:
        failing.push(TextSegment(text, at))
        at += len(text)
    failing.close_text()
    with pytest.raises(EngineError):
        async for _ in failing:
            pass
    assert [job.text for job in failing._jobs] == list(texts[:2])  # queued before the failure
    gate.set()
    async for _ in blocker:
        pass
    for _ in range(20):  # whatever the worker would still take has had its chance
        await asyncio.sleep(0.02)
    aligned = [text for batch in aligner.batches for text in batch]
    assert aligned == ["One. "]  # the failed stream's words go nowhere: none of its jobs ran
    assert engine.worker.queued == 0 and engine.worker.queued_audio_s == 0


async def _drain(stream) -> None:
    async for _ in stream:
        pass


class _SetCapacity(AlignerCapacity):
    """The aligner's capacity as the test sets it."""

    streams_now = 1

    def capacity(self, upper: int) -> int:
        return self.streams_now


async def test_a_stream_turned_from_off_without_room_is_refused_not_queued(engines) -> None:
    inner = HandFedEngine()
    cost = _SetCapacity()
    engine = await engines(inner, SpreadAligner(), cost=cost)
    first = engine.open(SynthesisRequest(request_id="a"))
    engine.open(SynthesisRequest(request_id="b"))
    engine.open(SynthesisRequest(request_id="c"))
    cost.streams_now = 3
    engine._promote()  # b and c are admitted in one round: the queue's measured interval is nil
    assert len(engine.admission.admitted) == 3
    turned = engine.open(SynthesisRequest(request_id="d", word_alignment="off"))
    turned.set_word_alignment("async")  # no room now: refused, not queued
    with pytest.raises(Overloaded):
        await asyncio.wait_for(_drain(turned), 2)
    assert inner.streams[-1].cancelled and engine.admission.queued == 0
    first.cancel()  # a place opens: nothing queued takes it
    assert [s.request_id for s in inner.streams] == ["a", "b", "c", "d"]  # one wrapped stream each
