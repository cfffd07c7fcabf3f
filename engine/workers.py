"""One engine per worker process (one per GPU), behind the ordinary Engine contract.

`WorkerPoolEngine` starts N processes (spawn), each building its own engine from a picklable
factory (with its own environment, e.g. CUDA_VISIBLE_DEVICES=i), and routes every new request to
the least-loaded live worker. Admission holds per worker (per GPU): each worker reports the
capacity its measured cost admits, and the pool sends a worker no more requests than that; the
rest wait in the pool's queue (engine.admission: FIFO within priority, bounded) and go to the first
worker with room, or are refused. The pipe carries only what the contract carries: requests, text
segments, close/cancel, and audio chunks back; the engine's steps stay inside the worker.

A worker that dies fails only the requests it held (their iteration raises EngineError); the pool
starts a replacement, registers the known voices with it, and keeps serving on the others
meanwhile (load().ready stays true while any worker lives).

Audio crosses the pipe out of band: a "batch" message carries its chunks' fields (sizes
included), and their samples follow it raw, in order, written straight from the arrays and read
straight into each chunk's own array; sample arrays are never pickled. Each stream's first chunk
leaves in a batch of its own, ahead of the other messages of its loop pass.

In the worker, a step's chunks go from the engine thread that hands them out (on it, through
engine.bridge.deliver_on_producer_thread) to a writer thread of their own, not through the event
loop: waking the loop writes to its self-pipe, a system call that handed the GIL to the loop, which
then held it while the step thread waited. The writer is woken without giving the GIL up; it takes
it when the step thread next waits (for the GPU) and writes the batch meanwhile. Streams' first
chunks leave at once, from the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.admission import Admission, Ticket
from engine.api import (
    AudioChunk,
    ChunkListener,
    Engine,
    EngineError,
    EngineInfo,
    EngineLoad,
    InvalidAudio,
    InvalidRequest,
    Overloaded,
    QueuePosition,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    UnknownVoice,
    pcm16,
)
from engine.bridge import LoopChunkChannel, deliver_on_producer_thread

log = logging.getLogger("cadence.workers")

LOAD_PERIOD_S = 0.2  # how often a worker reports its EngineLoad
# net container allocations between two collections of the youngest generation (CPython: 700). A
# step makes and drops thousands (a plan's rows, the outputs): at 700 the collector runs several
# times a step and promotes enough to run frequent full collections, each a pause of the step
# thread; at 7000 most of a step's objects are gone before it runs
YOUNG_GC_THRESHOLD = 7000
_ERRORS: dict[str, type[EngineError]] = {
    "overloaded": Overloaded,
    "unknown_voice": UnknownVoice,
    "invalid_request": InvalidRequest,
    "invalid_audio": InvalidAudio,
}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to build one worker's engine: a picklable factory and environment set before it runs."""

    factory: Callable[[], Engine]
    env: dict[str, str] = field(default_factory=dict)
    name: str = "worker"


def error_to_wire(exc: BaseException) -> tuple[str, str, float]:
    return getattr(exc, "code", "internal"), str(exc), float(getattr(exc, "retry_after_s", 1.0))


def error_from_wire(code: str, message: str, retry_after_s: float) -> EngineError:
    if code == "overloaded":
        return Overloaded(message, retry_after_s)
    return _ERRORS.get(code, EngineError)(message)


# -- audio on the wire --------------------------------------------------------------------------
_IOV_MAX = 1024  # buffers per writev call (Linux's IOV_MAX)


def to_wire(messages: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], list[memoryview]]:
    """A batch's messages with each chunk's samples taken out, and those samples' bytes in order:
    int16 PCM (`pcm16`), made here in the worker's process unless the engine made it. The gateway's
    default output is that PCM as it is, so its one core neither converts it nor reads twice the
    bytes."""
    wire: list[tuple[Any, ...]] = []
    audio: list[memoryview] = []
    for message in messages:
        if message[0] != "chunk":
            wire.append(message)
            continue
        _, rid, chunk = message
        samples = (
            np.ascontiguousarray(chunk.samples) if chunk.samples.dtype == np.int16 else pcm16(chunk.samples)
        )
        wire.append(
            ("chunk", rid, chunk.request_id, samples.size, chunk.sample_offset, chunk.words, chunk.final)
        )
        if samples.size:
            audio.append(samples.data.cast("B"))
    return wire, audio


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """Write the buffers in order (blocking fd), as few system calls as the pipe allows."""
    _transfer(os.writev, fd, buffers)


def read_all(fd: int, buffers: list[memoryview]) -> None:
    """Fill the buffers in order from a blocking fd (EOFError when it closes first)."""
    _transfer(os.readv, fd, buffers)


def _transfer(call: Callable[[int, list[memoryview]], int], fd: int, buffers: list[memoryview]) -> None:
    start = 0
    while start < len(buffers):
        done = call(fd, buffers[start : start + _IOV_MAX])
        if not done:
            raise EOFError
        while done:
            head = buffers[start]
            if done < len(head):
                buffers[start] = head[done:]
                break
            done -= len(head)
            start += 1


PIPE_BUFFER_BYTES = 8 << 20  # a step's audio in one or two writes (the kernel may allow less)


def widen(conn: Connection) -> None:
    """Let a step's batch pass in few system calls: each call of a large blocking transfer takes
    the GIL back when it returns, and waits for it while another thread holds it."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIPE_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PIPE_BUFFER_BYTES)


def read_chunks(fd: int, wire: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A batch's messages with its chunks rebuilt, their samples read from the fd straight into
    arrays of their own (one scattered read, no copy after it)."""
    messages: list[tuple[Any, ...]] = []
    buffers: list[memoryview] = []
    for message in wire:
        if message[0] == "chunk":
            _, rid, request_id, size, offset, words, final = message
            samples = np.empty(size, np.int16)
            if size:
                buffers.append(samples.data.cast("B"))
            message = ("chunk", rid, AudioChunk(request_id, samples, offset, words, final))
        messages.append(message)
    read_all(fd, buffers)
    return messages


def receive(conn: Connection) -> tuple[Any, ...]:
    """The next message from a worker, a batch's chunks with their audio."""
    message = conn.recv()
    if message[0] == "batch":
        return ("batch", read_chunks(conn.fileno(), message[1]))
    return tuple(message)


# -- the worker process -------------------------------------------------------------------------
def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    os.environ.update(spec.env)
    asyncio.run(_WorkerLoop(conn, spec).run())


class _WorkerLoop:
    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        self.conn = conn
        self.spec = spec
        self.streams: dict[int, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopped = asyncio.Event()
        self.outbox: list[tuple[object, ...]] = []  # messages of this loop pass, sent as one batch
        self.firsts: list[tuple[object, ...]] = []  # this pass's first chunks, sent ahead of the outbox
        self.flush_pending = False
        self.outbox_lock = threading.Lock()  # messages come from the loop and from the engine's threads
        self.send_lock = threading.Lock()  # one writer at a time: a batch's message and its audio together
        self.loop_thread = threading.get_ident()
        self.engine_batches = threading.Event()  # an engine thread posted a batch for the writer
        self.frozen_objects = 0.0  # objects gc.freeze() moved out of the collector's sight at start-up

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deliver_on_producer_thread(loop, self._flush_posted_batch)
        self.engine = self.spec.factory()
        await self.engine.start()
        # what start-up made (modules, weights, graphs) moves where the cyclic collector never looks
        # again: its full collections while streams run scan only what the streams made, instead of
        # pausing the step thread for every object the model and its graphs hold
        gc.collect()
        gc.freeze()
        # counted once: get_freeze_count() walks the whole frozen list (hundreds of thousands of
        # objects) with the GIL held, which every load report would pay and every engine thread wait for
        self.frozen_objects = float(gc.get_freeze_count())
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
        self.send("ready", self.engine.info)
        threading.Thread(target=self._read, args=(loop,), daemon=True).start()
        threading.Thread(target=self._write_engine_batches, daemon=True, name="cadence-write").start()
        reporter = asyncio.create_task(self._report_load())
        await self.stopped.wait()
        reporter.cancel()
        await self.engine.stop()
        self._flush()
        with contextlib.suppress(OSError):
            self.send("stopped")

    def post(self, *message: object, first: bool = False) -> None:
        """Send with the other messages of this loop pass or engine step (any thread): a step's
        chunks for many streams cross the pipe as one batch, in the order they were posted; `first`
        chunks in a batch before it. An engine thread's posts go when its step's batch is handed
        out (`_flush_posted_batch`), the loop's at the end of its pass."""
        with self.outbox_lock:
            (self.firsts if first else self.outbox).append(message)
        if not self.flush_pending and threading.get_ident() == self.loop_thread:
            self.flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush_pass)

    def _flush_posted_batch(self) -> None:
        """An engine thread handed out a batch of chunks (a step's): its streams' first chunks go
        now, from that thread (a listener waits for them; they are few and short), the writer
        sends the rest."""
        if threading.get_ident() == self.loop_thread:  # the loop's posts go at the end of its pass
            return
        if self.firsts:
            self._flush(firsts_only=True)
        if self.outbox:
            self.engine_batches.set()

    def _write_engine_batches(self) -> None:
        while True:
            self.engine_batches.wait()
            self.engine_batches.clear()
            self._flush()

    def _flush_pass(self) -> None:
        self.flush_pending = False
        self._flush()

    def _flush(self, firsts_only: bool = False) -> None:
        """Send what was posted, first chunks first (whichever thread calls: the sends hold the send
        lock, so batches leave in the order they were taken)."""
        with self.send_lock:
            with self.outbox_lock:
                batches = [self.firsts] if firsts_only else [self.firsts, self.outbox]
                self.firsts = []
                if not firsts_only:
                    self.outbox = []
            for batch in batches:
                if batch:
                    self._send_batch(batch)

    def _send_batch(self, batch: list[tuple[object, ...]]) -> None:
        wire, audio = to_wire(batch)
        self._send(("batch", wire))
        try:
            write_all(self.conn.fileno(), audio)
        except (OSError, ValueError):
            os._exit(0)

    def send(self, *message: object) -> None:
        with self.send_lock:
            self._send(message)

    def _send(self, message: tuple[object, ...]) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # the parent went away: nothing left to serve
            os._exit(0)

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # parent gone
            loop.call_soon_threadsafe(self._handle, message)

    async def _report_load(self) -> None:
        while True:
            load = self.engine.load()
            # this worker process's CPU time (all its threads): the load test turns it into a share of a core
            load.extra["worker_cpu_seconds"] = time.process_time()
            load.extra["worker_gc_frozen_objects"] = (
                self.frozen_objects
            )  # start-up's, kept from the collector
            self.post("load", load)
            await asyncio.sleep(LOAD_PERIOD_S)

    def _handle(self, message: tuple[Any, ...]) -> None:
        op, *args = message
        if op == "open":
            rid, request = args
            try:
                stream = self.engine.open(request)
            except Exception as exc:
                self.post("fail", rid, *error_to_wire(exc))
                return
            self.streams[rid] = stream
            out = _StreamOut(self, rid)
            if not stream.listen(out):  # a stream that only iterates: a task forwards it
                self._spawn(self._pump(out, aiter(stream)))
        elif op in ("push", "close_text", "cancel", "word_alignment"):
            stream = self.streams.get(args[0])
            if stream is None:
                return
            try:
                if op == "push":
                    stream.push(args[1])
                elif op == "close_text":
                    stream.close_text()
                elif op == "word_alignment":
                    stream.set_word_alignment(args[1])
                else:
                    stream.cancel()
            except Exception as exc:
                self.post("fail", args[0], *error_to_wire(exc))
        elif op == "voice":
            call_id, voice_id, audio, rate, text = args
            self._spawn(self._answer(call_id, self.engine.register_voice(voice_id, audio, rate, text)))
        elif op == "unvoice":
            call_id, voice_id = args
            self._spawn(self._answer(call_id, self.engine.unregister_voice(voice_id)))
        elif op == "stop":
            self.stopped.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _pump(out: _StreamOut, chunks: AsyncIterator[AudioChunk]) -> None:
        """For a stream that is not one of engine.bridge's channels."""
        try:
            async for chunk in chunks:
                out.chunk(chunk)
            out.end()
        except Exception as exc:
            out.fail(exc)

    async def _answer(self, call_id: int, call: Awaitable[None]) -> None:
        """Run one of the pool's calls and reply with its refusal (None: done)."""
        try:
            await call
            self.post("reply", call_id, None)
        except Exception as exc:
            self.post("reply", call_id, error_to_wire(exc))


class _StreamOut:
    """Posts one stream's chunks as its channel hands them over, on the worker's loop."""

    __slots__ = ("worker", "rid", "first")

    def __init__(self, worker: _WorkerLoop, rid: int) -> None:
        self.worker, self.rid, self.first = worker, rid, True

    def chunk(self, chunk: AudioChunk) -> None:
        self.worker.post("chunk", self.rid, chunk, first=self.first)
        self.first = False

    def end(self) -> None:
        self.worker.post("end", self.rid)
        self.worker.streams.pop(self.rid, None)

    def fail(self, error: BaseException) -> None:
        self.worker.post("fail", self.rid, *error_to_wire(error))
        self.worker.streams.pop(self.rid, None)


# -- the gateway side ---------------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    index: int
    process: Any
    conn: Connection
    generation: int
    alive: bool = False
    load: EngineLoad | None = None
    in_flight: set[int] = field(default_factory=set)
    calls: set[int] = field(default_factory=set)  # register_voice calls awaiting its reply
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, *message: object) -> None:
        with self.send_lock:
            self.conn.send(message)


class WorkerStream(SynthesisStream):
    def __init__(self, pool: WorkerPoolEngine, rid: int, request: SynthesisRequest) -> None:
        self.pool = pool
        self.worker: _Worker | None = None  # set once admitted and sent to a worker
        self.rid = rid
        self.request = request
        self.request_id = request.request_id
        self.channel = LoopChunkChannel()  # fed on the loop, by the pool's message handler
        self.ticket: Ticket[WorkerStream] | None = None  # its admission in the pool
        self.held: list[tuple[object, ...]] = []  # text and close, while it waits for admission

    def push(self, segment: TextSegment) -> None:
        self._send("push", self.rid, segment)

    def close_text(self) -> None:
        self._send("close_text", self.rid)

    def cancel(self) -> None:
        if self.worker is not None:
            self._send("cancel", self.rid)
        self.channel.close()
        self.pool._forget(self.rid)

    def queue_position(self) -> QueuePosition | None:
        return None if self.ticket is None else self.pool.admission.position(self.ticket)

    def queue_wait_s(self) -> float:
        return 0.0 if self.ticket is None else self.ticket.waited_s

    def _send(self, *message: object) -> None:
        if self.worker is None:
            self.held.append(message)
            return
        if not self.worker.alive:
            return  # its failure is already queued on the channel
        with contextlib.suppress(OSError, ValueError):
            self.worker.send(*message)

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            async for chunk in self.channel:
                yield chunk
        finally:
            # still the pool's: the consumer left before the stream's end (it broke out, or its task
            # was cancelled), and the worker would otherwise go on generating what nobody reads
            if self.rid in self.pool._streams:
                self.cancel()

    def listen(self, listener: ChunkListener) -> bool:
        """The channel hands the chunks over. The pool forgets the request at its final chunk, end
        or failure, as it does for an iterated stream; a cancel forgets it too."""
        self.channel.listen(listener)
        return True

    def set_word_alignment(self, mode: str) -> None:
        """Given to the worker's stream (an aligned engine there takes it; others keep their words)."""
        self._send("word_alignment", self.rid, mode)


_MEAN_FIGURES = (
    "step_ms_",
    "batch_",
    "ttfa_p",
    "lead_",
    "kv_utilisation",
    "prefill_tokens",
    "codec_frames",
    "codec_launches",
    "admission_step_",
    "admission_curve_reach",
    "aligner_share",  # each worker's aligner shares its own GPU
    "aligner_throughput_",
    "aligner_stream_rate",
    "aligner_backlog_s",
    "aligner_sync_added_ttfa_ms_",
    "aligner_call_ms_",
    "aligner_prepare_ms",
    "aligner_wait_ms",
    "aligner_finish_ms",
)


def merge_worker_figures(figures: list[dict[str, float]]) -> dict[str, float]:
    """The workers' engine figures as one engine's: per-step times, batch sizes, TTFA and
    utilisation averaged over the workers that report them; counts and bytes summed."""
    merged: dict[str, list[float]] = {}
    for extra in figures:
        for name, value in extra.items():
            merged.setdefault(name, []).append(float(value))
    return {
        name: sum(values) / len(values) if name.startswith(_MEAN_FIGURES) else sum(values)
        for name, values in merged.items()
    }


class WorkerPoolEngine:
    """An Engine that runs one engine per worker process and routes requests to the least loaded."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        start_timeout_s: float = 600.0,
        restart: bool = True,
        queue_limit: int | None = None,
    ) -> None:
        """`queue_limit`: requests the pool holds for admission (None: the workers' queues summed)."""
        if not specs:
            raise ValueError("a worker pool needs at least one worker")
        self.specs = list(specs)
        self.start_timeout_s = start_timeout_s
        self.restart = restart
        self.info = EngineInfo(name="workers", model="", sample_rate=24_000)
        self.workers: list[_Worker | None] = [None] * len(self.specs)
        self.restarts = 0
        self._context = mp.get_context("spawn")
        self._rids = itertools.count(1)
        self._calls = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, WorkerStream] = {}
        self._queue_bound = queue_limit
        self.admission: Admission[WorkerStream] = Admission(
            1, queue_limit or 0, capacity=self._capacity, starts=self._room
        )
        self._voices: dict[str, tuple[npt.NDArray[np.float32], int, str | None]] = {}
        self._ready: dict[int, asyncio.Future[EngineInfo]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._promoting = False  # `_promote` is admitting from the queue
        self._promote_again = False  # room freed meanwhile: it admits once more
        self._generations = itertools.count(1)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        infos = await asyncio.gather(*(self._start_worker(i) for i in range(len(self.specs))))
        self.info = infos[0]

    async def stop(self) -> None:
        self._stopping = True  # from here on nothing is admitted or dispatched (`_promote`, `open`)
        for ticket in self.admission.queued_tickets():  # never to be admitted: refused now
            ticket.item.channel.fail(Overloaded("engine stopping", retry_after_s=1.0))
            self._forget(ticket.item.rid)
        for worker in self.workers:
            if worker is not None and worker.alive:
                with contextlib.suppress(OSError, ValueError):
                    worker.send("stop")
        for worker in self.workers:
            if worker is None:
                continue
            await asyncio.to_thread(worker.process.join, 10.0)
            if worker.process.is_alive():
                worker.process.kill()
            self._worker_gone(worker, "engine stopped")
        self.workers = [None] * len(self.specs)

    async def _start_worker(self, index: int) -> EngineInfo:
        assert self._loop is not None
        parent, child = self._context.Pipe(duplex=True)
        widen(parent)
        widen(child)
        process = self._context.Process(
            target=worker_main,
            args=(child, self.specs[index]),
            name=f"cadence-{self.specs[index].name}",
            daemon=True,
        )
        process.start()
        child.close()
        worker = _Worker(index, process, parent, next(self._generations))
        self.workers[index] = worker
        ready: asyncio.Future[EngineInfo] = self._loop.create_future()
        self._ready[worker.generation] = ready
        threading.Thread(target=self._read, args=(worker,), daemon=True, name=f"cadence-read-{index}").start()
        try:
            info = await asyncio.wait_for(ready, self.start_timeout_s)
        finally:
            self._ready.pop(worker.generation, None)
        for voice_id, (audio, rate, text) in list(self._voices.items()):
            with contextlib.suppress(EngineError):
                await self._call(worker, "voice", voice_id, audio, rate, text)
        worker.alive = True
        self._bounds()  # its load may have come before it was live, and so not counted yet
        self._promote()
        log.info("engine worker %d (pid %s) ready: %s", index, process.pid, info.name)
        return info

    # -- the pipe's reader thread -------------------------------------------------------------
    def _read(self, worker: _Worker) -> None:
        assert self._loop is not None
        while True:
            try:
                message = receive(worker.conn)
            except (EOFError, OSError):
                break
            except Exception:  # a message that cannot be unpickled: treat the worker as broken
                log.exception("bad message from engine worker %d", worker.index)
                break
            self._loop.call_soon_threadsafe(self._on_message, worker, message)
        with contextlib.suppress(RuntimeError):  # the loop may be closed at exit
            self._loop.call_soon_threadsafe(self._on_exit, worker)

    def _on_message(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        op, *args = message
        if op == "batch":
            for item in args[0]:
                self._on_message(worker, item)
        elif op == "chunk":
            stream = self._streams.get(args[0])
            if stream is not None:
                stream.channel.put(args[1])
                if args[1].final:
                    self._forget(args[0])
        elif op == "end":
            stream = self._streams.get(args[0])
            if stream is not None:
                stream.channel.finish()
            self._forget(args[0])
        elif op == "fail":
            stream = self._streams.get(args[0])
            if stream is not None:
                stream.channel.fail(error_from_wire(*args[1:]))
            self._forget(args[0])
        elif op == "load":
            worker.load = args[0]
            self._bounds()
            self._promote()  # a worker's measured capacity may have grown
        elif op == "reply":
            future = self._replies.pop(args[0], None)
            if future is not None and not future.done():
                future.set_result(args[1])
        elif op == "ready":
            future = self._ready.get(worker.generation)
            if future is not None and not future.done():
                future.set_result(args[0])

    def _on_exit(self, worker: _Worker) -> None:
        ready = self._ready.get(worker.generation)
        if ready is not None and not ready.done():
            ready.set_exception(EngineError(f"engine worker {worker.index} exited while starting"))
        was_alive = worker.alive
        self._worker_gone(worker, f"engine worker {worker.index} died")
        if was_alive and not self._stopping and self.restart and self.workers[worker.index] is worker:
            log.error("engine worker %d died; starting a new one", worker.index)
            self.restarts += 1
            assert self._loop is not None
            self._loop.create_task(self._restart(worker.index))

    async def _restart(self, index: int) -> None:
        try:
            await self._start_worker(index)
        except Exception:
            log.exception("engine worker %d could not be restarted", index)

    def _worker_gone(self, worker: _Worker, why: str) -> None:
        """Fail exactly the requests this worker held."""
        worker.alive = False
        self._bounds()  # the pool's bound and queue are those of the workers still live
        for rid in list(worker.in_flight):
            stream = self._streams.get(rid)
            if stream is not None:
                stream.channel.fail(EngineError(why))
            self._forget(rid)
        worker.in_flight.clear()
        for call_id in list(worker.calls):
            future = self._replies.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(("internal", why, 1.0))
        worker.calls.clear()

    # -- the contract -------------------------------------------------------------------------
    def live_workers(self) -> list[_Worker]:
        return [w for w in self.workers if w is not None and w.alive]

    def load(self) -> EngineLoad:
        live = self.live_workers()
        loads = [w.load for w in live if w.load is not None]
        extra = merge_worker_figures([x.extra for x in loads])
        extra.update(
            {
                "workers_alive": float(len(live)),
                "workers": float(len(self.specs)),
                "worker_restarts": float(self.restarts),
            }
        )
        figures = self.admission.figures()
        return EngineLoad(
            active=sum(x.active for x in loads),
            queued=figures.queued + sum(x.queued for x in loads),
            capacity=figures.capacity,
            queue_limit=figures.queue_limit,
            ready=bool(live) and all(x.ready for x in loads),
            extra=extra,
            admission=figures,
        )

    # -- admission across the workers ------------------------------------------------------------
    @staticmethod
    def _worker_capacity(worker: _Worker) -> int:
        """Streams the worker's measured cost admits (one until it has reported)."""
        return max(1, worker.load.capacity) if worker.load is not None else 1

    def _capacity(self) -> int:
        return sum(self._worker_capacity(w) for w in self.live_workers())

    def _room(self) -> int:
        """Streams that may start now: each worker's capacity less what the pool sent it."""
        return sum(max(0, self._worker_capacity(w) - len(w.in_flight)) for w in self.live_workers())

    def _bounds(self) -> None:
        """The pool's upper bound and queue from what the workers report."""
        loads = [w.load for w in self.live_workers() if w.load is not None]
        if not loads:
            return
        self.admission.max_streams = sum(
            x.admission.max_streams if x.admission is not None else x.capacity for x in loads
        )
        if self._queue_bound is None:
            self.admission.queue_limit = sum(x.queue_limit for x in loads)

    def _pick(self) -> _Worker | None:
        """The live worker with the smallest share of its capacity in flight, one with room
        first (ties: lowest index)."""
        best: tuple[bool, float, int] | None = None
        chosen: _Worker | None = None
        for worker in self.live_workers():
            size = self._worker_capacity(worker)
            score = (len(worker.in_flight) >= size, len(worker.in_flight) / size, worker.index)
            if best is None or score < best:
                best, chosen = score, worker
        return chosen

    def _dispatch(self, stream: WorkerStream) -> None:
        """Send an admitted request to a worker, with the text it held while queued."""
        worker = self._pick()
        if worker is None:
            stream.channel.fail(Overloaded("every engine worker is restarting", retry_after_s=1.0))
            self._forget(stream.rid)
            return
        stream.worker = worker
        worker.in_flight.add(stream.rid)
        try:
            worker.send("open", stream.rid, stream.request)
            for message in stream.held:
                worker.send(*message)
        except (OSError, ValueError) as exc:
            stream.channel.fail(Overloaded(f"engine worker {worker.index} unreachable: {exc}"))
            self._forget(stream.rid)
        stream.held = []

    def _promote(self) -> None:
        if self._stopping:  # every worker has been told to stop, or soon is
            return
        if self._promoting:  # a dispatch that failed freed its place: the loop below admits again
            self._promote_again = True
            return
        self._promoting = True
        try:
            self._promote_again = True
            while self._promote_again:  # a loop, not a recursion, however long the queue
                self._promote_again = False
                for ticket in self.admission.admit_waiting():
                    self._dispatch(ticket.item)
        finally:
            self._promoting = False

    def _expire(self) -> None:
        for ticket in self.admission.expire():
            ticket.item.channel.fail(self.admission.expired_error(ticket))
            self._forget(ticket.item.rid)
        self.admission.arm_expiry(self._loop, self._expire)

    def open(self, request: SynthesisRequest) -> WorkerStream:
        voice = request.voice
        if voice is not None and voice not in self.info.voices and voice not in self._voices:
            raise UnknownVoice(f"unknown voice {voice!r}")
        if self._stopping or not self.live_workers():
            raise Overloaded("every engine worker is busy or restarting", retry_after_s=1.0)
        stream = WorkerStream(self, next(self._rids), request)
        stream.ticket = self.admission.arrive(stream, request.priority, request.max_wait_s)  # or Overloaded
        self._streams[stream.rid] = stream
        if stream.ticket.admitted_at is None:
            if request.max_wait_s is not None:
                self.admission.arm_expiry(self._loop, self._expire)
            return stream
        self._dispatch(stream)
        if stream.worker is None:  # no worker took it: refused as the engine is
            raise Overloaded("every engine worker is busy or restarting", retry_after_s=1.0)
        return stream

    def _forget(self, rid: int) -> None:
        """A request ended (or was refused): its place in the pool goes to the next one queued."""
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        if stream.worker is not None:
            stream.worker.in_flight.discard(rid)
        if stream.ticket is not None:
            self.admission.leave(stream.ticket)
        self._promote()

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        """Registered on every live worker (and on each one started later); the first refusal wins."""
        live = self.live_workers()
        if not live:
            raise Overloaded("no engine worker is running")
        await asyncio.gather(*(self._call(w, "voice", voice_id, audio, sample_rate, text) for w in live))
        self._voices[voice_id] = (audio, sample_rate, text)

    async def unregister_voice(self, voice_id: str) -> None:
        """Released on every live worker; a worker started later is not given it."""
        self._voices.pop(voice_id, None)
        await asyncio.gather(*(self._call(w, "unvoice", voice_id) for w in self.live_workers()))

    async def _call(self, worker: _Worker, op: str, *args: object) -> None:
        assert self._loop is not None
        call_id = next(self._calls)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._replies[call_id] = future
        worker.calls.add(call_id)
        try:
            worker.send(op, call_id, *args)
            error = await asyncio.wait_for(future, 120.0)
        finally:
            self._replies.pop(call_id, None)
            worker.calls.discard(call_id)
        if error is not None:
            raise error_from_wire(*error)
