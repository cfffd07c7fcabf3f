"""The aligner worker with an aligner that splits its calls: a batch that falls due while another
is on the device is readied and submitted before the first is collected, every job still gets its
own words in order, busy time adds up to no more than the wall time, and a failing submission or
collection falls back to aligning job by job. The real aligner's split (aligner.qwen3) gives the
words its whole call gives, with two batches in flight at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from engine.alignment.api import AlignedWord, AlignInput, SplitAligner
from engine.alignment.forced_times import ForcedTimesAligner
from engine.alignment.track import AlignJob, JobPiece
from engine.alignment.worker import AlignerWorker
from engine.api import TextSegment, WordTiming
from tests.engine.alignment.fakes import SpreadAligner
from tests.engine.alignment.tiny_aligner import tiny_aligner

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Call:
    batch: list[AlignInput]
    device_done: threading.Event = field(default_factory=threading.Event)

    def ready(self) -> bool:
        return self.device_done.is_set()

    def wait(self) -> None:
        self.device_done.wait(5)


class SplitSpread:
    """SpreadAligner's words, split in two: each call's "device work" ends when the test says so
    (`finish`); records the order of submissions and collections."""

    max_audio_s = 300.0

    def __init__(self, fail_submit_on: str | None = None, fail_collect_on: str | None = None) -> None:
        self.inner = SpreadAligner()
        self.events: list[tuple[str, str]] = []  # ("submit" | "collect", first text)
        self.calls: list[_Call] = []
        self.submitted = threading.Condition()
        self.fail_submit_on, self.fail_collect_on = fail_submit_on, fail_collect_on

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        return self.inner.align(batch)

    def submit(self, batch: Sequence[AlignInput]) -> _Call:
        first = batch[0][2]
        if self.fail_submit_on and any(self.fail_submit_on in text for _, _, text, _ in batch):
            raise RuntimeError("submission failed")
        call = _Call(list(batch))
        with self.submitted:
            self.events.append(("submit", first))
            self.calls.append(call)
            self.submitted.notify_all()
        return call

    def collect(self, call: _Call) -> list[list[AlignedWord]]:
        assert call.device_done.wait(5), "the device never finished"  # as the real one waits
        self.events.append(("collect", call.batch[0][2]))
        if self.fail_collect_on and any(self.fail_collect_on in text for _, _, text, _ in call.batch):
            raise RuntimeError("collection failed")
        return self.inner.align(call.batch)

    def wait_for_calls(self, count: int) -> None:
        with self.submitted:
            assert self.submitted.wait_for(lambda: len(self.calls) >= count, 5)


def job(text: str, urgent: bool = True) -> AlignJob:
    samples = np.zeros(2000, np.float32)
    pieces = (JobPiece(TextSegment(text, char_start=0), 0),)
    return AlignJob("r", 0, samples, 1000, text, "English", pieces, 0, len(samples), (), urgent=urgent)


class Answers:
    """Each job's words by its text; `all_in` is set once `expected` jobs are answered."""

    def __init__(self, expected: int) -> None:
        self.words: dict[str, tuple[WordTiming, ...]] = {}
        self.expected = expected
        self.all_in = threading.Event()

    def __call__(self, j: AlignJob, words: tuple[WordTiming, ...]) -> None:
        self.words[j.text] = words
        if len(self.words) == self.expected:
            self.all_in.set()


def test_a_batch_due_while_another_is_on_the_device_is_submitted_before_that_one_is_collected() -> None:
    aligner = SplitSpread()
    assert isinstance(aligner, SplitAligner)
    calls: list[tuple[float, float, int]] = []
    answered = Answers(2)
    answers = answered.words
    done = answered.all_in
    worker = AlignerWorker(aligner, on_batch=lambda *c: calls.append(c))
    worker.start()
    began = time.perf_counter()
    try:
        worker.submit(job("first batch words"), answered)
        aligner.wait_for_calls(1)
        worker.submit(job("second batch here"), answered)
        aligner.wait_for_calls(2)  # submitted while the first is still on the "device"
        assert aligner.events == [("submit", "first batch words"), ("submit", "second batch here")]
        assert not answers
        aligner.calls[0].device_done.set()
        aligner.calls[1].device_done.set()
        assert done.wait(5)
    finally:
        worker.stop()
    wall = time.perf_counter() - began
    assert [e for e in aligner.events if e[0] == "collect"] == [
        ("collect", "first batch words"),
        ("collect", "second batch here"),
    ]
    # each job got the words of its own text
    assert [w.text for w in answers["first batch words"]] == ["first", "batch", "words"]
    assert [w.text for w in answers["second batch here"]] == ["second", "batch", "here"]
    # overlapping calls are not counted twice
    assert len(calls) == 2 and sum(busy for busy, _, _ in calls) <= wall


@pytest.mark.parametrize("where", ["submit", "collect"])
def test_a_failing_call_falls_back_to_its_jobs_one_by_one(where: str) -> None:
    aligner = SplitSpread(**{f"fail_{where}_on": "broken"})
    answered = Answers(2)
    answers = answered.words
    done = answered.all_in
    worker = AlignerWorker(aligner, gather_s=0.2)
    worker.start()
    try:
        worker.submit(job("fine words", urgent=False), answered)
        worker.submit(job("broken words", urgent=False), answered)
        for _ in range(200):
            for call in aligner.calls:
                call.device_done.set()
            if done.wait(0.02):
                break
    finally:
        worker.stop()
    # the batch held both; its failure cost neither job its words (align() alone succeeds)
    assert [w.text for w in answers["fine words"]] == ["fine", "words"]
    assert [w.text for w in answers["broken words"]] == ["broken", "words"]
    assert worker.stats.failures == 0 and worker.stats.jobs == 2


def test_forced_times_split_over_either_kind_of_aligner() -> None:
    batch = [(np.zeros(16_000, np.float32), 16_000, "one two three", "English")]
    for inner in (SplitSpread(), SpreadAligner()):
        forced = ForcedTimesAligner(inner)  # type: ignore[arg-type]
        call = forced.submit(batch)
        if isinstance(inner, SplitSpread):
            inner.calls[0].device_done.set()
        assert call.ready()
        assert forced.collect(call) == forced.align(batch)


def test_the_real_aligners_split_calls_give_its_whole_calls_words(tmp_path: Path) -> None:
    """Two batches in flight at once, collected in order: the words of two plain calls."""
    aligner = tiny_aligner(tmp_path)
    rng = np.random.default_rng(3)
    first = [(rng.standard_normal(24_000).astype(np.float32) * 0.1, 24_000, "hello there world", "English")]
    second = [
        (rng.standard_normal(16_000).astype(np.float32) * 0.1, 16_000, "one more", "English"),
        (rng.standard_normal(30_000).astype(np.float32) * 0.1, 24_000, "and the last one", "English"),
    ]
    whole = aligner.align(first), aligner.align(second)
    a, b = aligner.submit(first), aligner.submit(second)
    assert a.ready() and b.ready()  # on the CPU the work is done when submitted
    assert (aligner.collect(a), aligner.collect(b)) == whole


def test_a_call_whose_device_work_ends_is_collected_at_once_while_the_next_batch_gathers() -> None:
    aligner = SplitSpread()
    answered = threading.Event()
    worker = AlignerWorker(aligner, gather_s=5.0)
    worker.start()
    try:
        worker.submit(job("urgent words"), lambda *_: answered.set())
        aligner.wait_for_calls(1)
        worker.submit(job("gathering words", urgent=False), lambda *_: None)  # due only in 5 s
        time.sleep(0.05)
        assert not answered.is_set()
        landed = time.perf_counter()
        aligner.calls[0].device_done.set()
        assert answered.wait(2)
        assert time.perf_counter() - landed < 1.0  # not held until the next batch is due
    finally:
        worker.stop()
