"""Faults where a stream's work crosses a boundary: the step thread's output sink and its between-step
work, a consumer that leaves a worker's stream early, a pool that stops with requests queued, and a
dispatch that fails while the pool admits from its queue."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

from engine.api import AudioChunk, EngineError, EngineLoad, Overloaded, SynthesisRequest
from engine.qwen3.core import EngineCore
from engine.qwen3.plan import RequestOutput, StepOutput, StepPlan
from engine.qwen3.request import RequestStatus
from engine.workers import WorkerPoolEngine, WorkerSpec, WorkerStream, _Worker
from tests.engine.qwen3.utils import create_requests, create_scheduler, fake_output

pytestmark = pytest.mark.timeout(30)


# -- the step thread ------------------------------------------------------------------------------
class _Runner:
    def __init__(self) -> None:
        self.plans = 0

    def execute(self, plan: StepPlan, while_waiting: Any = None) -> StepOutput:
        self.plans += 1
        if while_waiting is not None:
            while_waiting()
        return fake_output(plan)


class _Ends:
    """A sink that records each request's end; raises on the calls numbered in `fail_on`."""

    def __init__(self, fail_on: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail_on = fail_on
        self.calls = 0
        self.ended: dict[str, RequestOutput] = {}
        self.changed = threading.Condition()

    def __call__(self, outs: list[RequestOutput]) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("sink fault")
        with self.changed:
            self.ended.update({o.request_id: o for o in outs if o.finished})
            self.changed.notify_all()

    def wait_end(self, request_id: str, timeout_s: float = 5.0) -> RequestOutput:
        with self.changed:
            assert self.changed.wait_for(lambda: request_id in self.ended, timeout_s), f"{request_id} stalled"
            return self.ended[request_id]


def test_a_sink_fault_fails_its_steps_requests_and_the_step_thread_serves_on() -> None:
    sink = _Ends(fail_on={1})
    core = EngineCore(create_scheduler(), _Runner(), sink)
    core.start()
    try:
        (a,) = create_requests(1, prompt_len=2, max_frames=500)
        core.add_request(a)
        out = sink.wait_end("r0")  # not a stream left waiting for chunks the failed call lost
        assert out.status == RequestStatus.FINISHED_ERROR and "sink fault" in (out.error or "")
        assert core.running
        (b,) = create_requests(1, prompt_len=2, max_frames=3, prefix="b")
        core.add_request(b)
        assert sink.wait_end("b0").status == RequestStatus.FINISHED_STOPPED
    finally:
        core.stop()


def test_a_sink_fault_on_a_requests_last_output_still_tells_it_ended() -> None:
    # the step that finishes the request is the one whose sink call fails: the scheduler has let it
    # go, so its end (an error) is told from the outputs the sink failed on
    sink = _Ends(fail_on={3})
    core = EngineCore(create_scheduler(), _Runner(), sink)
    core.start()
    try:
        (a,) = create_requests(1, prompt_len=2, max_frames=3)
        core.add_request(a)
        out = sink.wait_end("r0")
        assert sink.calls >= 3 and out.status == RequestStatus.FINISHED_ERROR
        assert "sink fault" in (out.error or "")
    finally:
        core.stop()


def test_a_fault_processing_aborts_fails_every_request_and_the_step_thread_serves_on() -> None:
    sink = _Ends()
    sched = create_scheduler()
    abort = sched.abort

    def faulty_abort(ids: Any) -> list[RequestOutput]:
        sched.abort = abort  # type: ignore[method-assign]
        raise RuntimeError("abort fault")

    sched.abort = faulty_abort  # type: ignore[method-assign,assignment]
    core = EngineCore(sched, _Runner(), sink)
    core.start()
    try:
        a, b = create_requests(2, prompt_len=2, max_frames=5000)
        core.add_request(a)
        core.add_request(b)
        core.abort("r0")
        # which request the fault hit cannot be told: both end, with an error, not a stall
        for rid in ("r0", "r1"):
            out = sink.wait_end(rid)
            assert out.status == RequestStatus.FINISHED_ERROR and "abort fault" in (out.error or "")
        assert core.running
        (c,) = create_requests(1, prompt_len=2, max_frames=3, prefix="c")
        core.add_request(c)
        assert sink.wait_end("c0").status == RequestStatus.FINISHED_STOPPED
    finally:
        core.stop()


def test_a_fault_that_persists_after_failing_every_request_does_not_spin_the_step_thread() -> None:
    sink = _Ends()
    sched = create_scheduler()
    calls = 0

    def faulty_expire() -> list[RequestOutput]:
        nonlocal calls
        calls += 1
        raise RuntimeError("expiry fault")

    sched.expire = faulty_expire  # type: ignore[method-assign]
    sched.until_expiry = lambda: 0.0  # type: ignore[method-assign]  # an expiry always due
    core = EngineCore(sched, _Runner(), sink)
    core.start()
    try:
        (a,) = create_requests(1, prompt_len=2, max_frames=5000)
        core.add_request(a)
        assert sink.wait_end("r0").status == RequestStatus.FINISHED_ERROR
        start = calls
        time.sleep(0.3)
        assert core.running
        assert calls - start <= 0.3 / 0.05 + 3, calls - start  # one try per back-off, not a busy loop
    finally:
        core.stop()


# -- the worker pool, with workers that only record what they are sent --------------------------------
class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.broken = False

    def send(self, message: tuple[Any, ...]) -> None:
        if self.broken:
            raise BrokenPipeError("worker gone")
        self.sent.append(message)


class _Process:
    pid = 0

    def __init__(self) -> None:
        self.joining = threading.Event()
        self.exit = threading.Event()
        self.exit.set()

    def join(self, timeout: float | None = None) -> None:
        self.joining.set()
        self.exit.wait(timeout)

    def is_alive(self) -> bool:
        return False

    def kill(self) -> None:
        pass


def _load(capacity: int) -> EngineLoad:
    return EngineLoad(active=0, queued=0, capacity=capacity, queue_limit=0)


def fake_pool(capacities: list[int], queue_limit: int = 8) -> WorkerPoolEngine:
    pool = WorkerPoolEngine([WorkerSpec(lambda: None)] * len(capacities), queue_limit=queue_limit)  # type: ignore[arg-type,return-value]
    pool._loop = asyncio.get_running_loop()
    for i, capacity in enumerate(capacities):
        pool.workers[i] = _Worker(i, _Process(), _Conn(), i + 1, alive=True, load=_load(capacity))  # type: ignore[arg-type]
    pool._bounds()
    return pool


def sent(pool: WorkerPoolEngine, op: str, rid: int) -> list[int]:
    """The workers that were sent (op, rid)."""
    return [w.index for w in pool.workers if w is not None for m in w.conn.sent if m[:2] == (op, rid)]  # type: ignore[attr-defined]


def chunk(stream: WorkerStream, offset: int, final: bool = False) -> tuple[Any, ...]:
    return ("chunk", stream.rid, AudioChunk(stream.request_id, np.zeros(8, np.int16), offset, final=final))


async def read_one(stream: WorkerStream) -> AudioChunk:
    return await anext(aiter(stream))


async def settle() -> None:
    for _ in range(5):  # a left iterator's finally runs in a task of its own (the loop's aclose)
        await asyncio.sleep(0)


async def test_a_consumer_that_breaks_out_early_cancels_the_stream_in_its_worker() -> None:
    pool = fake_pool([2])
    worker = pool.workers[0]
    assert worker is not None
    stream = pool.open(SynthesisRequest("u"))
    pool._on_message(worker, chunk(stream, 0))
    async for _ in stream:
        break
    await settle()
    assert sent(pool, "cancel", stream.rid) == [0]  # the worker stops generating it
    assert not worker.in_flight and pool.admission.figures().admitted == 0


async def test_a_consumer_whose_task_is_cancelled_cancels_the_stream_in_its_worker() -> None:
    pool = fake_pool([2])
    stream = pool.open(SynthesisRequest("u"))

    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    await settle()  # waiting for its first chunk
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await settle()
    assert sent(pool, "cancel", stream.rid) == [0]


async def test_a_stream_read_to_its_final_chunk_is_not_cancelled() -> None:
    pool = fake_pool([2])
    worker = pool.workers[0]
    assert worker is not None
    stream = pool.open(SynthesisRequest("u"))
    pool._on_message(worker, chunk(stream, 0))
    pool._on_message(worker, chunk(stream, 8, final=True))
    assert [c.final async for c in stream] == [False, True]
    await settle()
    assert sent(pool, "cancel", stream.rid) == [] and not worker.in_flight


async def test_stop_refuses_the_requests_queued_in_the_pool() -> None:
    pool = fake_pool([1], queue_limit=2)
    held = pool.open(SynthesisRequest("held"))
    queued = pool.open(SynthesisRequest("queued"))
    assert held.worker is not None and queued.worker is None
    reading = asyncio.create_task(read_one(queued))
    await pool.stop()
    with pytest.raises(Overloaded):  # a typed refusal, not a stream left waiting for ever
        await asyncio.wait_for(reading, 2.0)
    assert sent(pool, "open", queued.rid) == [] and pool.admission.queued == 0


async def test_stop_dispatches_no_queued_request_to_a_worker_told_to_stop() -> None:
    pool = fake_pool([1, 1], queue_limit=2)
    a, b = pool.open(SynthesisRequest("a")), pool.open(SynthesisRequest("b"))
    queued = pool.open(SynthesisRequest("queued"))
    assert a.worker is not None and b.worker is not None and queued.worker is None
    reading = asyncio.create_task(read_one(queued))
    await pool.stop()
    # the first worker's end freed a place: the queued request must not go to the other, stopping one
    assert sent(pool, "open", queued.rid) == []
    with pytest.raises(EngineError):
        await asyncio.wait_for(reading, 2.0)


async def test_a_request_opened_while_the_pool_stops_is_refused() -> None:
    pool = fake_pool([2])
    worker = pool.workers[0]
    assert worker is not None
    worker.process.exit.clear()  # the worker takes its time to exit
    stopping = asyncio.create_task(pool.stop())
    await asyncio.to_thread(worker.process.joining.wait, 2.0)
    try:
        with pytest.raises(Overloaded):
            pool.open(SynthesisRequest("late"))
        assert not any(m[0] == "open" for m in worker.conn.sent)  # type: ignore[attr-defined]
    finally:
        worker.process.exit.set()
        await stopping


async def test_a_dispatch_that_fails_while_the_pool_admits_from_its_queue_never_over_admits() -> None:
    # worker 0's pipe breaks with room on it; a load report gives worker 1 more room, so the pool
    # admits several queued requests at once: each one sent to worker 0 fails, and its leaving admits
    # again from inside the outer admission's dispatch loop
    pool = fake_pool([1, 1], queue_limit=8)
    w0, w1 = pool.workers
    assert w0 is not None and w1 is not None
    first = [pool.open(SynthesisRequest(f"s{i}")) for i in range(2)]
    queued = [pool.open(SynthesisRequest(f"q{i}")) for i in range(5)]
    assert all(s.worker is not None for s in first) and all(q.worker is None for q in queued)
    w0.load = _load(2)
    w0.conn.broken = True  # type: ignore[attr-defined]
    pool._on_message(w1, ("load", _load(4)))
    capacity = {0: 2, 1: 4}
    for worker in (w0, w1):
        assert len(worker.in_flight) <= capacity[worker.index]
    dispatched = w0.in_flight | w1.in_flight
    figures = pool.admission.figures()
    assert figures.admitted == len(dispatched) <= figures.capacity
    # every request the pool admitted is on a worker or failed: none admitted and left undispatched
    for q in queued:
        assert q.rid in dispatched or q.rid not in pool._streams or q.worker is None
        if q.rid not in dispatched and q.worker is not None:
            with pytest.raises(Overloaded):
                await asyncio.wait_for(anext(aiter(q)), 1.0)


async def test_a_long_queue_meeting_a_broken_worker_pipe_ends_every_request_without_recursion() -> None:
    """Each dispatch to a worker whose pipe broke fails and frees its place, which admits the next
    queued request at once: the pool admits in a loop, so a queue of any length is answered."""
    pool = fake_pool([1, 1], queue_limit=600)
    first = [pool.open(SynthesisRequest(f"s{i}")) for i in range(2)]
    queued = [pool.open(SynthesisRequest(f"q{i}")) for i in range(600)]
    pool.workers[0].conn.broken = True
    pool._on_message(pool.workers[0], ("end", first[0].rid))  # its place admits the queue's head
    figures = pool.admission.figures()
    assert figures.queued == 0 and figures.admitted == 1  # worker 1's stream alone is in flight
    for stream in queued:
        with pytest.raises(Overloaded, match="unreachable"):
            await read_one(stream)
