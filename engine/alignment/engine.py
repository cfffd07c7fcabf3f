"""`AlignedEngine`: any engine.api.Engine plus a forced aligner, giving words with `source: "aligner"`.

The aligner runs in its own thread (engine.alignment.worker), batching the jobs of every stream. Each
utterance's audio reaches it segment by segment as the wrapped engine produces it (see
engine.alignment.track). An aligner with a `warm_up(max_batch)` method has it run once at
`start()`, off the event loop, so the first requests do not pay its kernels' first-use costs.

Per stream the mode is "async" by default (audio passes at once, words follow when known), "sync"
(audio held until its words are known, released word by word as probes of the segment being made
time them; the added time to first audio is measured and reported in `load().extra`), or "off"
(the wrapped engine's own words). The request says it (`SynthesisRequest.word_alignment`, the
gateway's per session), or the stream's optional `set_word_alignment(mode)` before its first chunk.

Admission counts what the aligner keeps up with (engine.alignment.capacity): a stream that wants the aligner's
words is admitted only while the aligner keeps up with one more, and then as the wrapped engine
admits it; beyond that it waits in a bounded queue (`utterance.queued`, through `queue_position`)
or is refused (Overloaded, with a Retry-After), as the wrapped engine's own admission does. "off"
streams do not count: they go to the wrapped engine at once. While a sync stream holds or awaits a
place, aligned streams are also held to what the wrapped engine says its step keeps at the sync
streams' pace (the `admission_sync_streams` figure of its load, engine.qwen3.capacity; the "off"
streams it serves count against it): sync audio goes out word by word, and a listener runs dry
between releases when the engine makes audio much slower than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Callable

import numpy as np
import numpy.typing as npt

from engine.admission import Admission, Ticket, in_series
from engine.alignment.api import Aligner, CallPhases
from engine.alignment.capacity import MAX_BATCH, AlignerCapacity
from engine.alignment.track import ALIGNMENT_MODES, AlignJob, AlignmentMode, AlignmentTracker
from engine.alignment.worker import AlignerWorker
from engine.api import (
    AudioChunk,
    ChunkListener,
    ChunkSchedule,
    Engine,
    EngineError,
    EngineInfo,
    EngineLoad,
    InvalidRequest,
    Overloaded,
    QueuePosition,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    WordTiming,
)
from engine.bridge import ChunkChannel

MAX_ALIGNED_STREAMS = 1 << 16  # admission's upper bound; the measured cost is the real one
SYNC_PACE_FIGURE = "admission_sync_streams"  # the wrapped engine's streams kept at the sync pace
PACE_REFRESH_S = 0.25  # the longest admission goes on one reading of that figure
# Sync streams' audio chunks stop growing at 8 frames: a probe runs when a chunk arrives, and
# releases only what two probes agree on, so 2-second chunks leave a listener with the first words'
# audio and nothing until the next chunk (bench/sync_release_sim.py); the default schedule's larger
# chunks serve the other streams' throughput
SYNC_SCHEDULE = ChunkSchedule(largest=8)


class AlignedStream(SynthesisStream):
    """engine.api.SynthesisStream over the wrapped engine's stream, words from the aligner. An
    aligned stream the aligner has no room for yet waits in the engine's admission queue without a
    wrapped stream; its text is held until it is admitted."""

    def __init__(self, engine: AlignedEngine, request: SynthesisRequest, mode: AlignmentMode) -> None:
        self.request_id = request.request_id
        self.request = request
        self.inner: SynthesisStream | None = None  # the wrapped engine's, once opened
        self.ticket: Ticket[AlignedStream] | None = None  # its place in the aligner's admission
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
        self._held: list[TextSegment | None] = []  # text (None: its end) while no wrapped stream
        self._jobs: list[AlignJob] = []  # submitted, neither answered nor cancelled
        self._aligned_to = 0  # utterance sample where the jobs submitted so far end
        self._cancelled = False
        self._ended = False  # its place in admission is given back
        self._inner_audio_at: float | None = None  # when the wrapped engine's first audio came
        self._audio_out = False
        self._pump: asyncio.Task[None] | None = None

    @property
    def mode(self) -> AlignmentMode:
        return self._tracker.mode

    def set_word_alignment(self, mode: str) -> None:
        """ "sync", "async" or "off"; effective when called before the first chunk arrives."""
        if mode not in ALIGNMENT_MODES:
            raise ValueError(f"alignment mode must be one of {', '.join(ALIGNMENT_MODES)}")
        before = self.mode
        self._tracker.set_mode(mode)
        if (before == "off") != (self.mode == "off"):
            self._engine.alignment_changed(self)
        else:
            self._engine.note_mode(self)

    def attach(self, inner: SynthesisStream) -> None:
        """The wrapped engine's stream: the held text goes to it and its chunks are taken."""
        self.inner = inner
        for segment in self._held:
            if segment is None:
                inner.close_text()
            else:
                inner.push(segment)
        self._held = []
        self._pump = self._loop.create_task(self._run())

    def fail(self, error: BaseException) -> None:
        self._channel.fail(error)
        self._end()

    def refuse(self, error: BaseException) -> None:
        """Fail it now, its wrapped stream cancelled."""
        self._cancelled = True
        if self.inner is not None:
            self.inner.cancel()
        self.fail(error)

    # -- SynthesisStream --------------------------------------------------------------------
    def push(self, segment: TextSegment) -> None:
        self._tracker.push(segment)
        if self.inner is None:
            self._held.append(segment)
        else:
            self.inner.push(segment)

    def close_text(self) -> None:
        if self.inner is None:
            self._held.append(None)
        else:
            self.inner.close_text()

    def cancel(self) -> None:
        self._cancelled = True
        if self.inner is not None:
            self.inner.cancel()
        for job in self._jobs:
            job.cancelled = True
        self._channel.close()
        if self._pump is not None:
            self._pump.cancel()
        self._end()

    def listen(self, listener: ChunkListener) -> bool:
        self._channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._channel.__aiter__()

    def queue_position(self) -> QueuePosition | None:
        if self.ticket is not None and self.ticket.queued:
            return self._engine.admission.position(self.ticket)
        return None if self.inner is None else self.inner.queue_position()

    def queue_wait_s(self) -> float:
        waited = 0.0 if self.ticket is None else self.ticket.waited_s
        return waited + (0.0 if self.inner is None else self.inner.queue_wait_s())

    # -- the pump (event loop) --------------------------------------------------------------
    async def _run(self) -> None:
        assert self.inner is not None
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
                self._end()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(exc if isinstance(exc, EngineError) else EngineError(str(exc)))

    def _submit(self, job: AlignJob) -> None:
        # a cancelled job (a probe whose segment was cut) may be dropped by the worker unanswered:
        # it is let go of here, or its window would stay as long as the stream
        self._jobs = [pending for pending in self._jobs if not pending.cancelled]
        self._jobs.append(job)
        fresh = max(0, job.window_end - max(job.window_start, self._aligned_to))
        self._aligned_to = max(self._aligned_to, job.window_end)
        if self._tracker.window_too_long(job):
            self._on_aligned(job, job.fallback)
        else:
            job.fresh_s = fresh / job.sample_rate
            self._engine.worker.submit(job, self._done_in_worker)

    def _done_in_worker(self, job: AlignJob, words: tuple[WordTiming, ...]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be closed at shutdown
            self._loop.call_soon_threadsafe(self._on_aligned, job, words)

    def _on_aligned(self, job: AlignJob, words: tuple[WordTiming, ...]) -> None:
        # an answered job is done with: its window's audio goes with it, however long the utterance
        self._jobs = [pending for pending in self._jobs if pending is not job and not pending.cancelled]
        if self._cancelled:
            return
        out = self._tracker.on_aligned(job, words)
        if job.probe:
            self._engine.probe_words += sum(len(chunk.words) for chunk in out)
        self._emit(out)

    def _emit(self, chunks: list[AudioChunk]) -> None:
        for chunk in chunks:
            if not self._audio_out and len(chunk.samples):
                self._audio_out = True
                if self.mode == "sync" and self._inner_audio_at is not None:
                    self._engine.note_sync_delay(self._loop.time() - self._inner_audio_at)
            self._channel.put(chunk)
            if chunk.final:
                self._end()  # its last words are out: the aligner owes it nothing more

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            for job in self._jobs:  # words it can no longer send must not hold the aligner
                job.cancelled = True
            self._engine.release(self)


class AlignedEngine:
    """engine.api.Engine: `inner` with its words replaced by forced-aligned ones.

    Admission: a stream whose mode is not "off" is admitted only while the aligner keeps up with
    one more (engine.alignment.capacity, through engine.admission: `queue_limit` streams wait beyond
    that, FIFO within priority, the rest are refused with a Retry-After), and then only as the
    wrapped engine admits it (its own queue and refusals); an "off" stream goes to the wrapped
    engine at once. An aligned stream holds its place from its admission to its last words."""

    def __init__(
        self,
        inner: Engine,
        aligner: Aligner | Callable[[], Aligner],
        *,
        default_mode: AlignmentMode = "async",
        max_batch: int = MAX_BATCH,
        queue_limit: int = 256,
        cost: AlignerCapacity | None = None,
    ) -> None:
        if default_mode not in ALIGNMENT_MODES:
            raise ValueError(f"alignment mode must be one of {', '.join(ALIGNMENT_MODES)}")
        self.inner = inner
        self.default_mode: AlignmentMode = default_mode
        self._aligner_factory: Callable[[], Aligner] | None = None
        self._worker: AlignerWorker | None = None
        if isinstance(aligner, Aligner) and not isinstance(aligner, type):
            self._worker = AlignerWorker(aligner, max_batch, self._batch_in_worker)
        else:
            self._aligner_factory = aligner
        self.max_batch = max_batch
        self.cost = cost or AlignerCapacity(max_batch=max_batch)
        # bounded by the measured cost alone: the wrapped engine has its own bound
        self.admission: Admission[AlignedStream] = Admission(
            MAX_ALIGNED_STREAMS, queue_limit, capacity=self._cost_capacity, starts=self._starts
        )
        self._streams: set[AlignedStream] = set()  # opened, their place not yet given back
        self._sync: set[AlignedStream] = set()  # of them, the sync streams
        self._pace: tuple[float, int | None] = (float("-inf"), None)  # (read at, sync pace streams)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._promoting = False
        self._stopping = False
        self._sync_delays: deque[float] = deque(maxlen=1000)
        # words that sync probes sent ahead of their segment's end: none when the aligner's times
        # move as its window grows (random weights do), and sync audio then waits for whole segments
        self.probe_words = 0

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    @property
    def worker(self) -> AlignerWorker:
        if self._worker is None:
            raise EngineError("the aligned engine is not started")
        return self._worker

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        if self._worker is None:
            assert self._aligner_factory is not None
            aligner = await asyncio.to_thread(self._aligner_factory)
            self._worker = AlignerWorker(aligner, self.max_batch, self._batch_in_worker)
        await asyncio.to_thread(self._worker.warm_up)
        await self.inner.start()
        self._worker.start()

    async def stop(self) -> None:
        self._stopping = True
        for ticket in self.admission.queued_tickets():
            ticket.item.fail(EngineError("engine stopped"))
        await self.inner.stop()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)
        for stream in list(self._streams):  # a restart begins with nothing admitted
            stream.cancel()

    def open(self, request: SynthesisRequest) -> AlignedStream:
        mode = request.word_alignment or self.default_mode
        if mode not in ALIGNMENT_MODES:
            raise InvalidRequest(f"word_alignment must be one of {', '.join(ALIGNMENT_MODES)}")
        if mode == "sync" and request.schedule == ChunkSchedule():
            request = dataclasses.replace(request, schedule=SYNC_SCHEDULE)
        stream = AlignedStream(self, request, mode)
        if mode != "off":
            if mode == "sync":
                self._sync.add(stream)  # it arrives to the pace held for it
            try:
                stream.ticket = self.admission.arrive(
                    stream, request.priority, request.max_wait_s
                )  # or Overloaded
            finally:
                self._sync.discard(stream)  # until it is one of the streams (note_mode)
        if stream.ticket is None or stream.ticket.admitted_at is not None:
            try:
                stream.attach(self.inner.open(request))  # or the wrapped engine's refusal
            except BaseException:
                if stream.ticket is not None:
                    self.admission.leave(stream.ticket)
                    self._promote()
                raise
        elif request.max_wait_s is not None:
            self.admission.arm_expiry(self._loop, self._expire)
        self._streams.add(stream)
        self.note_mode(stream)
        self._count()
        return stream

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        await self.inner.register_voice(voice_id, audio, sample_rate, text)

    async def unregister_voice(self, voice_id: str) -> None:
        await self.inner.unregister_voice(voice_id)

    def note_sync_delay(self, seconds: float) -> None:
        self._sync_delays.append(seconds)

    def sync_delays_ms(self) -> list[float]:
        return [1000 * s for s in self._sync_delays]

    # -- admission (event loop) -------------------------------------------------------------------
    def _cost_capacity(self) -> int:
        capacity = self.cost.capacity(self.admission.max_streams)
        pace = self._sync_pace() if self._sync else None
        return capacity if pace is None else min(capacity, pace)

    def _sync_pace(self) -> int | None:
        """Aligned streams the wrapped engine keeps at the sync pace (at least one, so that a sync
        stream is never held back by nothing; None: the engine does not say)."""
        read_at, pace = self._pace
        if self._now() - read_at >= PACE_REFRESH_S:
            pace = self._note_pace(self.inner.load().extra)
        return pace

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    def _note_pace(self, figures: dict[str, float]) -> int | None:
        """The sync pace from the wrapped engine's figures, kept until PACE_REFRESH_S has passed."""
        figure = figures.get(SYNC_PACE_FIGURE)
        off = sum(1 for stream in self._streams if stream.mode == "off")
        pace = None if figure is None else max(1, int(figure) - off)
        self._pace = (self._now(), pace)
        return pace

    def note_mode(self, stream: AlignedStream) -> None:
        """A stream opened, or its mode changed: whether admission keeps the sync pace for it."""
        if stream.mode == "sync" and stream in self._streams:
            self._sync.add(stream)
        else:
            self._sync.discard(stream)

    def _starts(self) -> int:
        return self.cost.starts(self._worker.queued_audio_s if self._worker is not None else 0.0)

    def _count(self) -> None:
        self.cost.streams(len(self.admission.admitted))

    def _dispatch(self, stream: AlignedStream) -> None:
        """An aligned stream admitted from the queue goes to the wrapped engine, which may queue it
        too for what is left of its max wait, or refuse it."""
        request = stream.request
        if request.max_wait_s is not None and stream.ticket is not None:
            request = dataclasses.replace(
                request, max_wait_s=max(0.0, request.max_wait_s - stream.ticket.waited_s)
            )
        try:
            stream.attach(self.inner.open(request))
        except Exception as exc:
            stream.fail(exc if isinstance(exc, EngineError) else EngineError(str(exc)))

    def _promote(self) -> None:
        """Admit the queued streams the aligner has room for now (in rounds, not recursion: a
        stream the wrapped engine refuses gives its place back at once)."""
        if self._promoting or self._stopping:
            return
        self._promoting = True
        try:
            while admitted := self.admission.admit_waiting():
                for ticket in admitted:
                    self._dispatch(ticket.item)
        finally:
            self._promoting = False
        self._count()

    def _expire(self) -> None:
        for ticket in self.admission.expire():
            ticket.item.fail(self.admission.expired_error(ticket))
        self.admission.arm_expiry(self._loop, self._expire)

    def release(self, stream: AlignedStream) -> None:
        """A stream ended (or was refused, or cancelled): its place goes to the next one queued."""
        self._streams.discard(stream)
        self._sync.discard(stream)
        if stream.ticket is not None:
            self.admission.leave(stream.ticket)
        self._promote()

    def alignment_changed(self, stream: AlignedStream) -> None:
        """A stream's mode went to or from "off" before its first chunk. To "off": it gives its
        place back (one still queued goes to the wrapped engine now). From "off": it joins the
        aligner's admission only if there is room now, its wrapped stream being open already;
        otherwise it fails with the refusal."""
        self.note_mode(stream)
        if stream.mode == "off":
            if stream.ticket is not None:
                self.admission.leave(stream.ticket)
                if stream.inner is None:
                    self._dispatch(stream)
            self._promote()
            return
        try:
            stream.ticket = self.admission.arrive(stream, stream.request.priority, max_wait_s=0.0)
        except Overloaded as exc:
            stream.refuse(exc)
        self.note_mode(stream)
        self._count()

    def _batch_in_worker(self, busy_s: float, audio_s: float, jobs: int) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed at shutdown
                loop.call_soon_threadsafe(self._batch_measured, busy_s, audio_s, jobs)

    def _batch_measured(self, busy_s: float, audio_s: float, jobs: int) -> None:
        self.cost.batch(busy_s, audio_s, jobs)
        self._promote()  # the cost measured, or the backlog drained, may admit more now

    # -- load ---------------------------------------------------------------------------------------
    def _call_figures(self) -> dict[str, float]:
        """What a call costs by its jobs (the admission's curve), and where its time goes."""
        figures = {
            f"aligner_call_ms_{jobs}": 1e3 * (self.cost.calls.predict(jobs) or 0.0) for jobs in (1, 8, 32)
        }
        phases = getattr(self.worker.aligner, "phases", None)
        if isinstance(phases, CallPhases) and phases.calls:
            for name in ("prepare", "wait", "finish"):
                figures[f"aligner_{name}_ms"] = 1e3 * getattr(phases, f"{name}_s") / phases.calls
        return figures

    def load(self) -> EngineLoad:
        load = self.inner.load()
        self._note_pace(load.extra)  # the worker reads load() often: admission need not read it again
        extra = dict(load.extra)
        capacity, figures, queued = load.capacity, load.admission, load.queued
        if self._worker is not None:
            stats = self._worker.stats
            aligner = self.admission.figures()
            off = len(self._streams) - aligner.admitted - aligner.queued
            backlog = self.cost.backlog_s(self._worker.queued_audio_s)
            extra.update(
                {
                    "aligner_jobs": float(stats.jobs),
                    "aligner_probes": float(stats.probes),
                    "aligner_probe_words": float(self.probe_words),
                    "aligner_batches": float(stats.batches),
                    "aligner_failures": float(stats.failures),
                    "aligner_queued": float(self._worker.queued),
                    "aligner_largest_batch": float(stats.largest_batch),
                    "aligner_audio_s_per_s": stats.audio_s / stats.busy_s if stats.busy_s else 0.0,
                    "aligner_busy_s": stats.busy_s,
                    "aligner_audio_s": stats.audio_s,  # probes included
                    "aligner_stream_audio_s": stats.stream_audio_s,  # each second of a stream once
                    # admission by the aligner's measured cost (engine.alignment.capacity)
                    "aligner_capacity": float(aligner.capacity),
                    "aligner_streams": float(aligner.admitted),
                    "aligner_streams_queued": float(aligner.queued),
                    "aligner_share": self.cost.share(aligner.admitted),
                    "aligner_throughput_audio_s_per_s": self.cost.throughput() or 0.0,
                    "aligner_stream_rate": self.cost.rate or 0.0,  # audio a stream makes per second
                    "aligner_backlog_s": backlog,
                }
            )
            extra.update(self._call_figures())
            capacity = min(capacity, aligner.capacity + off)  # what a new aligned stream finds
            both = aligner if figures is None else in_series(aligner, figures)
            figures = dataclasses.replace(both, capacity=capacity)
            queued += aligner.queued
        delays = sorted(self.sync_delays_ms())
        if delays:
            extra["aligner_sync_added_ttfa_ms_p50"] = delays[len(delays) // 2]
            extra["aligner_sync_added_ttfa_ms_p95"] = delays[min(len(delays) - 1, int(0.95 * len(delays)))]
        return dataclasses.replace(
            load,
            queued=queued,
            capacity=capacity,
            ready=load.ready and (self._worker is not None),
            extra=extra,
            admission=figures,
        )
