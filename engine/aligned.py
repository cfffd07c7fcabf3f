"""`AlignedEngine`: any engine.api.Engine plus a forced aligner, giving words with `source: "aligner"`.

The aligner runs in its own thread (`AlignerWorker`). Each utterance's audio reaches it segment by
segment as the wrapped engine produces it (see engine.alignment_track); the worker sleeps on a
condition until jobs are queued, then takes every queued job (sync-mode jobs first, up to
`max_batch`) as one batch, so concurrent utterances share aligner passes without any polling. An idle
worker starts on a job the moment it is queued (no batching window); jobs that arrive during a call
form the next batch. An aligner with a `warm_up(max_batch)` method has it run once at `start()`, off
the event loop, so the first requests do not pay its kernels' first-use costs.

Per stream the mode is "async" by default (audio passes at once, words follow when known), "sync"
(audio held until its words are known, released word by word as probes of the segment being made
time them; the added time to first audio is measured and reported in `load().extra`), or "off"
(the wrapped engine's own words). The gateway may choose it per session
through the stream's optional `set_word_alignment(mode)`, called right after `open()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from aligner.api import AlignedWord, Aligner
from engine.alignment_track import ALIGNMENT_MODES, AlignJob, AlignmentMode, AlignmentTracker
from engine.api import (
    AudioChunk,
    ChunkListener,
    Engine,
    EngineError,
    EngineInfo,
    EngineLoad,
    QueuePosition,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    WordTiming,
)
from engine.bridge import ChunkChannel

JobDone = Callable[[AlignJob, tuple[WordTiming, ...]], None]


@dataclass(slots=True)
class AlignerStats:
    jobs: int = 0
    probes: int = 0  # sync probes of segments still being made (engine.alignment_track)
    batches: int = 0
    failures: int = 0  # jobs answered with the engine's own words
    audio_s: float = 0.0
    busy_s: float = 0.0
    largest_batch: int = 0


class AlignerWorker:
    """Batches alignment jobs from every stream on one thread."""

    def __init__(self, aligner: Aligner, max_batch: int = 32) -> None:
        self.aligner = aligner
        self.max_batch = max_batch
        self.stats = AlignerStats()
        self._cond = threading.Condition()
        self._urgent: deque[tuple[AlignJob, JobDone]] = deque()
        self._later: deque[tuple[AlignJob, JobDone]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._serve, name="aligner", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def warm_up(self) -> None:
        warm_up = getattr(self.aligner, "warm_up", None)
        if callable(warm_up):
            warm_up(self.max_batch)

    def submit(self, job: AlignJob, done: JobDone) -> None:
        with self._cond:
            (self._urgent if job.urgent else self._later).append((job, done))
            self._cond.notify()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._later)

    def _take_batch(self) -> list[tuple[AlignJob, JobDone]] | None:
        with self._cond:
            while not (self._urgent or self._later) and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            batch: list[tuple[AlignJob, JobDone]] = []
            for queue in (self._urgent, self._later):
                while queue and len(batch) < self.max_batch:
                    item = queue.popleft()
                    if not item[0].cancelled:
                        batch.append(item)
            return batch

    def _serve(self) -> None:
        while (batch := self._take_batch()) is not None:
            if batch:
                self._run(batch)

    def _run(self, batch: list[tuple[AlignJob, JobDone]]) -> None:
        jobs = [job for job, _ in batch]
        began = time.perf_counter()
        try:
            results: list[list[AlignedWord] | None] = list(self._align(jobs))
        except Exception:
            results = [self._align_alone(job) for job in jobs]  # one bad input must not sink the rest
        self.stats.busy_s += time.perf_counter() - began
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(jobs))
        for (job, done), aligned in zip(batch, results, strict=True):
            self.stats.audio_s += job.audio_s
            if job.probe:
                self.stats.probes += 1
            else:
                self.stats.jobs += 1
            if aligned is None:
                self.stats.failures += 0 if job.probe else 1
                words = job.fallback
            else:
                words = job.words_from(aligned)
            done(job, words)

    def _align(self, jobs: list[AlignJob]) -> list[list[AlignedWord]]:
        return self.aligner.align([(job.audio, job.sample_rate, job.text, job.language) for job in jobs])

    def _align_alone(self, job: AlignJob) -> list[AlignedWord] | None:
        try:
            return self._align([job])[0]
        except Exception:
            return None


class AlignedStream(SynthesisStream):
    """engine.api.SynthesisStream over the wrapped engine's stream, words from the aligner."""

    def __init__(
        self, engine: AlignedEngine, inner: SynthesisStream, request: SynthesisRequest, mode: AlignmentMode
    ) -> None:
        self.request_id = request.request_id
        self.inner = inner
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._tracker = AlignmentTracker(
            request.request_id,
            request.language or "Auto",
            engine.info.sample_rate,
            engine.worker.aligner.max_audio_s,
            mode,
        )
        self._channel = ChunkChannel(self._loop)
        self._jobs: list[AlignJob] = []
        self._cancelled = False
        self._inner_audio_at: float | None = None  # when the wrapped engine's first audio came
        self._audio_out = False
        self._pump = self._loop.create_task(self._run())

    @property
    def mode(self) -> AlignmentMode:
        return self._tracker.mode

    def set_word_alignment(self, mode: str) -> None:
        """ "sync", "async" or "off"; effective when called before the first chunk arrives."""
        if mode not in ALIGNMENT_MODES:
            raise ValueError(f"alignment mode must be one of {', '.join(ALIGNMENT_MODES)}")
        self._tracker.set_mode(mode)

    # -- SynthesisStream --------------------------------------------------------------------
    def push(self, segment: TextSegment) -> None:
        self._tracker.push(segment)
        self.inner.push(segment)

    def close_text(self) -> None:
        self.inner.close_text()

    def cancel(self) -> None:
        self._cancelled = True
        self.inner.cancel()
        for job in self._jobs:
            job.cancelled = True
        self._channel.close()
        self._pump.cancel()

    def listen(self, listener: ChunkListener) -> bool:
        self._channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._channel.__aiter__()

    def queue_position(self) -> QueuePosition | None:
        return self.inner.queue_position()

    def queue_wait_s(self) -> float:
        return self.inner.queue_wait_s()

    # -- the pump (event loop) --------------------------------------------------------------
    async def _run(self) -> None:
        try:
            async for chunk in self.inner:
                if self._cancelled:
                    return
                if self._inner_audio_at is None and len(chunk.samples):
                    self._inner_audio_at = self._loop.time()
                out, jobs = self._tracker.on_chunk(chunk)
                self._emit(out)
                for job in jobs:
                    self._submit(job)
            if not self._tracker.inner_final:
                self._channel.finish()  # ended without a final chunk (a stopped engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._channel.fail(exc if isinstance(exc, EngineError) else EngineError(str(exc)))

    def _submit(self, job: AlignJob) -> None:
        self._jobs.append(job)
        if self._tracker.window_too_long(job):
            self._on_aligned(job, job.fallback)
        else:
            self._engine.worker.submit(job, self._done_in_worker)

    def _done_in_worker(self, job: AlignJob, words: tuple[WordTiming, ...]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be closed at shutdown
            self._loop.call_soon_threadsafe(self._on_aligned, job, words)

    def _on_aligned(self, job: AlignJob, words: tuple[WordTiming, ...]) -> None:
        if self._cancelled:
            return
        self._emit(self._tracker.on_aligned(job, words))

    def _emit(self, chunks: list[AudioChunk]) -> None:
        for chunk in chunks:
            if not self._audio_out and len(chunk.samples):
                self._audio_out = True
                if self.mode == "sync" and self._inner_audio_at is not None:
                    self._engine.note_sync_delay(self._loop.time() - self._inner_audio_at)
            self._channel.put(chunk)


class AlignedEngine:
    """engine.api.Engine: `inner` with its words replaced by forced-aligned ones."""

    def __init__(
        self,
        inner: Engine,
        aligner: Aligner | Callable[[], Aligner],
        *,
        default_mode: AlignmentMode = "async",
        max_batch: int = 32,
    ) -> None:
        if default_mode not in ALIGNMENT_MODES:
            raise ValueError(f"alignment mode must be one of {', '.join(ALIGNMENT_MODES)}")
        self.inner = inner
        self.default_mode: AlignmentMode = default_mode
        self._aligner_factory: Callable[[], Aligner] | None = None
        self._worker: AlignerWorker | None = None
        if isinstance(aligner, Aligner) and not isinstance(aligner, type):
            self._worker = AlignerWorker(aligner, max_batch)
        else:
            self._aligner_factory = aligner
        self.max_batch = max_batch
        self._sync_delays: deque[float] = deque(maxlen=1000)

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    @property
    def worker(self) -> AlignerWorker:
        if self._worker is None:
            raise EngineError("the aligned engine is not started")
        return self._worker

    async def start(self) -> None:
        if self._worker is None:
            assert self._aligner_factory is not None
            self._worker = AlignerWorker(await asyncio.to_thread(self._aligner_factory), self.max_batch)
        await asyncio.to_thread(self._worker.warm_up)
        await self.inner.start()
        self._worker.start()

    async def stop(self) -> None:
        await self.inner.stop()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)

    def open(self, request: SynthesisRequest) -> AlignedStream:
        return AlignedStream(self, self.inner.open(request), request, self.default_mode)

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        await self.inner.register_voice(voice_id, audio, sample_rate, text)

    def note_sync_delay(self, seconds: float) -> None:
        self._sync_delays.append(seconds)

    def sync_delays_ms(self) -> list[float]:
        return [1000 * s for s in self._sync_delays]

    def load(self) -> EngineLoad:
        load = self.inner.load()
        extra = dict(load.extra)
        if self._worker is not None:
            stats = self._worker.stats
            extra.update(
                {
                    "aligner_jobs": float(stats.jobs),
                    "aligner_probes": float(stats.probes),
                    "aligner_batches": float(stats.batches),
                    "aligner_failures": float(stats.failures),
                    "aligner_queued": float(self._worker.queued),
                    "aligner_largest_batch": float(stats.largest_batch),
                    "aligner_audio_s_per_s": stats.audio_s / stats.busy_s if stats.busy_s else 0.0,
                }
            )
        delays = sorted(self.sync_delays_ms())
        if delays:
            extra["aligner_sync_added_ttfa_ms_p50"] = delays[len(delays) // 2]
            extra["aligner_sync_added_ttfa_ms_p95"] = delays[min(len(delays) - 1, int(0.95 * len(delays)))]
        return dataclasses.replace(load, ready=load.ready and (self._worker is not None), extra=extra)
