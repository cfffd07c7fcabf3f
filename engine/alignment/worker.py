"""`AlignerWorker`: the forced aligner on a thread of its own, batching the jobs of every stream.

The worker sleeps on a condition until jobs are queued, then takes every queued job (sync-mode jobs
first, up to `max_batch`) as one batch, so concurrent utterances share aligner passes without any
polling. Jobs that arrive during a call form the next batch. An idle worker starts on an urgent
(sync-mode) job the moment it is queued; other jobs wait until the oldest has waited `gather_s`
(or a full batch is queued), so that under load a call holds many jobs: most of a call's cost is
fixed, and more jobs per call is more audio aligned per second. Async words may trail their audio,
so they take the wait; sync audio waits for its words, so its jobs do not. Each call's cost goes to `on_batch`
(engine.alignment.engine measures the aligner's throughput for admission from it).

An aligner that splits its calls (engine.alignment.api.SplitAligner, as aligner.qwen3 does) has
each batch submitted as it falls due and collected once its device work is done; a batch that falls
due meanwhile is readied on the host and queued on the device behind the one in flight. A call's
host work (resampling, features, text) and its device work are of a size, so with calls back to
back under load the device no longer waits for the host between them.

While the worker runs, the interpreter's GIL switch interval is `SWITCH_INTERVAL_S` at most: a
call readies its inputs in Python for tens of milliseconds, and every other thread of the process
that wakes meanwhile (the engine's step thread back from its wait on the GPU, the thread that
hands chunks on) waits for the GIL until the interval forces a switch. At CPython's 5 ms those
waits cost the engine's streams much of their audio at load, far less at 0.5 ms; without an
aligner the shorter interval gains nothing (deploy/bench/README.md), so only the worker sets it,
and puts the former one back when it stops."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.alignment.api import AlignedWord, Aligner, AlignerCall, split_calls
from engine.alignment.capacity import MAX_BATCH
from engine.alignment.track import AlignJob
from engine.api import WordTiming

JobDone = Callable[[AlignJob, tuple[WordTiming, ...]], None]


@dataclass(slots=True)
class AlignerStats:
    jobs: int = 0
    probes: int = 0  # sync probes of segments still being made (engine.alignment.track)
    batches: int = 0
    failures: int = 0  # jobs answered with the engine's own words
    audio_s: float = 0.0  # aligned, probes' audio included
    stream_audio_s: float = 0.0  # of it, the streams' own audio, each second once (AlignJob.fresh_s)
    busy_s: float = 0.0
    largest_batch: int = 0


BatchDone = Callable[[float, float, int], None]  # (busy s, audio s, jobs)
GATHER_S = 0.1  # the longest a job without urgency waits for others to share its call
SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval while the worker runs (see the module)


@dataclass(slots=True)
class _Flight:
    """A batch submitted to the aligner and not yet collected."""

    batch: list[tuple[AlignJob, JobDone]]
    call: AlignerCall | None  # None: its submission raised, and each job is aligned alone
    began: float
    landed: bool = False  # its device work is done (set under the worker's condition)


class AlignerWorker:
    """Batches alignment jobs from every stream on one thread; `on_batch` hears what each call cost
    (on this thread)."""

    def __init__(
        self,
        aligner: Aligner,
        max_batch: int = MAX_BATCH,
        on_batch: BatchDone | None = None,
        gather_s: float = GATHER_S,
    ) -> None:
        self.aligner = aligner
        self._calls = split_calls(aligner)  # submit + collect, whichever kind the aligner is
        self.max_batch = max_batch
        self.on_batch = on_batch
        self.gather_s = gather_s
        self.stats = AlignerStats()
        self._cond = threading.Condition()
        self._urgent: deque[tuple[AlignJob, JobDone]] = deque()
        self._later: deque[tuple[AlignJob, JobDone]] = deque()
        self._later_since: deque[float] = deque()  # when each of `_later` was queued
        self._queued_audio_s = 0.0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._switch_before: float | None = None  # the interval the worker replaced
        self._last_collected = 0.0  # when the last batch was collected (perf_counter)

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_before, SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._serve, name="aligner", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None

    def warm_up(self) -> None:
        warm_up = getattr(self.aligner, "warm_up", None)
        if callable(warm_up):
            warm_up(self.max_batch)

    def submit(self, job: AlignJob, done: JobDone) -> None:
        with self._cond:
            if job.urgent:
                self._urgent.append((job, done))
            else:
                self._later.append((job, done))
                self._later_since.append(time.monotonic())
            self._queued_audio_s += job.audio_s
            self._cond.notify()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._later)

    @property
    def queued_audio_s(self) -> float:
        """Audio waiting for the aligner (the backlog)."""
        with self._cond:
            return max(0.0, self._queued_audio_s)

    def _take_batch(self, flight: _Flight | None = None) -> list[tuple[AlignJob, JobDone]] | None:
        """The next batch once it is due; None when stopping. With a call in flight, [] once its
        device work is done with no batch due (it is collected then)."""
        with self._cond:
            while not self._stopping:
                if self._urgent or len(self._later) >= self.max_batch:
                    break
                if flight is not None and flight.landed:
                    return []
                wait: float | None = None
                if self._later:
                    wait = self._later_since[0] + self.gather_s - time.monotonic()
                    if wait <= 0:
                        break
                self._cond.wait(wait)
            if self._stopping:
                return None
            batch: list[tuple[AlignJob, JobDone]] = []
            for queue in (self._urgent, self._later):
                while queue and len(batch) < self.max_batch:
                    if queue is self._later:
                        self._later_since.popleft()
                    item = queue.popleft()
                    self._queued_audio_s -= item[0].audio_s
                    if not item[0].cancelled:
                        batch.append(item)
            return batch

    def _serve(self) -> None:
        """Submit each batch as it falls due; while one is in flight, the next is readied and
        queued behind it before the first is collected."""
        flight: _Flight | None = None
        while True:
            batch = self._take_batch(flight)
            following = self._submit(batch) if batch else None
            if flight is not None:
                self._collect(flight)
            flight = following
            if batch is None:
                return

    def _submit(self, batch: list[tuple[AlignJob, JobDone]]) -> _Flight:
        began = time.perf_counter()
        inputs = [(job.audio, job.sample_rate, job.text, job.language) for job, _ in batch]
        call: AlignerCall | None = None
        with contextlib.suppress(Exception):  # a failed submission is answered job by job
            call = self._calls.submit(inputs)
        flight = _Flight(batch, call, began)
        try:
            landed = call is None or call.ready()
        except Exception:  # a device that reports an error is done with it: collect meets the error
            landed = True
        if landed:
            flight.landed = True
        else:  # a thread waits for the device (the GIL released) and wakes the worker
            threading.Thread(target=self._watch, args=(flight,), name="aligner-call", daemon=True).start()
        return flight

    def _watch(self, flight: _Flight) -> None:
        assert flight.call is not None
        with contextlib.suppress(Exception):  # a failed call is met again when collected
            flight.call.wait()
        with self._cond:
            flight.landed = True
            self._cond.notify_all()

    def _collect(self, flight: _Flight) -> None:
        jobs = [job for job, _ in flight.batch]
        results: list[list[AlignedWord] | None]
        try:
            if flight.call is None:
                raise RuntimeError("the batch's submission failed")
            results = list(self._calls.collect(flight.call))
            if len(results) != len(jobs):
                raise RuntimeError(f"the aligner answered {len(results)} of {len(jobs)} inputs")
        except Exception:
            results = [self._align_alone(job) for job in jobs]  # one bad input must not sink the rest
        finished = time.perf_counter()
        # the aligner's own time: from this batch's submission, or from the previous batch's end
        # where the two overlapped, so that busy time adds up to the wall time the aligner worked
        busy = finished - max(flight.began, self._last_collected)
        self._last_collected = finished
        audio, fresh = sum(job.audio_s for job in jobs), sum(job.fresh_s for job in jobs)
        self.stats.busy_s += busy
        self.stats.audio_s += audio
        self.stats.stream_audio_s += fresh
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(jobs))
        if self.on_batch is not None:
            self.on_batch(busy, audio, len(jobs))
        for (job, done), aligned in zip(flight.batch, results, strict=True):
            if job.probe:
                self.stats.probes += 1
            else:
                self.stats.jobs += 1
            words = None
            if aligned is not None:
                with contextlib.suppress(Exception):  # words it cannot place fall back like a failure
                    words = job.words_from(aligned)
            if words is None:
                self.stats.failures += 0 if job.probe else 1
                words = job.fallback
            done(job, words)

    def _align(self, jobs: list[AlignJob]) -> list[list[AlignedWord]]:
        return self.aligner.align([(job.audio, job.sample_rate, job.text, job.language) for job in jobs])

    def _align_alone(self, job: AlignJob) -> list[AlignedWord] | None:
        try:
            return self._align([job])[0]
        except Exception:
            return None
