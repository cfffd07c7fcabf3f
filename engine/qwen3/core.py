"""The engine step: plan = scheduler.schedule() -> out = runner.execute(plan) -> scheduler.update().

Inputs (new requests, text, cancels) may come from any thread. New requests and text go straight
to the scheduler under a lock (admission must answer at once); cancels go to a queue drained once
at the start of each step, so a cancel takes effect at the next step. A step readies the text that
came since the last one (`prepare` or, all in one batch, `prepare_batch`: e.g. prompt embeddings)
before it plans; text that comes while a step runs is readied while the runner waits for the GPU
(`while_waiting`), so the next step only hands it to the scheduler and the host's work between
two steps' GPU launches stays short. The step loop runs in its own thread and sleeps on a
condition when there is nothing to do.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from engine.qwen3.plan import RequestOutput, StepOutput, StepPlan
from engine.qwen3.request import Request, RequestStatus, Segment
from engine.qwen3.scheduler import Scheduler

log = logging.getLogger(__name__)

# after a fault that failed every request, the loop waits this long (or for an input) before it
# steps again: a fault that outlives the requests it failed must not spin the step thread
FAULT_BACKOFF_S = 0.05


class StepRunner(Protocol):
    def execute(self, plan: StepPlan, while_waiting: Callable[[], None] | None = None) -> StepOutput:
        """Run the plan; call `while_waiting` (once, if given) where the host would otherwise wait for
        the device."""
        ...


OutputSink = Callable[[list[RequestOutput]], None]


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        sink: OutputSink | None = None,
        prepare: Callable[[Segment], None] | None = None,
        prepare_batch: Callable[[list[Segment]], list[str | None]] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sink = sink  # receives each step's outputs (from the step thread)
        self.prepare = prepare  # readies a segment on the step thread; raises to fail its request
        self.prepare_batch = prepare_batch  # or readies many at once -> each one's error, or None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._aborts: deque[str] = deque()
        self._text: deque[tuple[str, Segment | None]] = deque()  # (id, segment) or (id, None) = close
        # text readied during the last step (`_ready_text`) that the scheduler has not yet taken
        self._readied: list[tuple[str, Segment | None, str | None]] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._inputs = 0  # bumped by every input, so the loop never sleeps through one
        self.steps = 0
        self.faults = 0  # faults outside the runner that failed every request (`_fail_all`)

    # -- inputs (any thread) -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Admit a request (raises Overloaded at capacity)."""
        with self._wake:
            self.scheduler.add_request(request)
            self._inputs += 1
            self._wake.notify()

    def add_segment(self, request_id: str, segment: Segment) -> None:
        """Queue text; it joins the request at the next step (after `prepare`)."""
        with self._wake:
            self._text.append((request_id, segment))
            self._inputs += 1
            self._wake.notify()

    def close_text(self, request_id: str) -> None:
        with self._wake:
            self._text.append((request_id, None))
            self._inputs += 1
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        """Cancel; applied at the start of the next step."""
        with self._wake:
            self._aborts.append(request_id)
            self._inputs += 1
            self._wake.notify()

    def run_locked(self, fn: Callable[[Scheduler], object]) -> object:
        """Read scheduler state consistently from another thread."""
        with self._lock:
            return fn(self.scheduler)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        try:
            with self._lock:
                outs += self._process_aborts()
                outs += self.scheduler.expire()
            outs += self._process_text()
            with self._lock:
                plan = self.scheduler.schedule()
        except Exception as exc:  # nothing tells which requests it hit: all fail, the outputs so far go out
            return outs + self._fail_all(exc)
        if plan.is_empty and not plan.freed_kv_slots:
            return outs
        try:
            result = self.runner.execute(plan, self._ready_text)
            with self._lock:  # an output that does not fit the plan is the step's failure too
                done = self.scheduler.update(plan, result)
        except Exception as exc:  # a failed step ends its requests, never the engine
            ids = {r.request_id for r in plan.decode} | {c.request_id for c in plan.prefill}
            ids |= {c.request_id for c in plan.codec}
            with self._lock:
                # a request admitted in this plan without a row in it owns a codec reset or a
                # prefix copy that may never have run: its rows' state is not what it assumes
                s = self.scheduler
                owners = [s.codec_pool.owner(slot) for slot in plan.codec_resets]
                owners += [s.kv.pool.owner(c.kv_slot) for c in plan.prefix_copies]
                ids |= {rid for rid in owners if rid is not None}
                # audio launched in an earlier step comes back with a later step's output (a runner
                # that defers Code2Wav): the failed step may have taken it, and nothing sends it again
                ids |= {rid for rid, r in s.requests.items() if r.frames_launched != r.frames_decoded}
                outs += self.scheduler.fail(sorted(ids), f"{type(exc).__name__}: {exc}")
            return outs
        outs += done
        self.steps += 1
        return outs

    def _process_aborts(self) -> list[RequestOutput]:
        ids = list(self._aborts)
        self._aborts.clear()
        return self.scheduler.abort(ids) if ids else []

    def _take_text(self) -> list[tuple[str, Segment | None]]:
        with self._lock:
            items = list(self._text)
            self._text.clear()
        return items

    def _ready_text(self) -> None:
        """Prepare the text that came since the step began (no lock held) while the device works; the
        next step hands it to the scheduler, ahead of anything that comes later."""
        items = self._take_text()
        if items:
            self._readied += self._prepare_all(items)

    def _process_text(self) -> list[RequestOutput]:
        """Prepare the queued text (no lock held), then hand it all, after the text readied during the
        last step, to the scheduler in one go."""
        items = self._take_text()
        prepared, self._readied = self._readied, []
        if items:
            prepared += self._prepare_all(items)
        if not prepared:
            return []
        outs: list[RequestOutput] = []
        with self._lock:
            for request_id, segment, error in prepared:
                if error is not None:
                    outs += self.scheduler.fail([request_id], error)
                elif segment is None:
                    outs += self.scheduler.close_text(request_id)
                else:
                    try:
                        self.scheduler.add_segment(request_id, segment)
                    except ValueError as exc:
                        outs += self.scheduler.fail([request_id], str(exc))
        return outs

    def _prepare_all(
        self, items: list[tuple[str, Segment | None]]
    ) -> list[tuple[str, Segment | None, str | None]]:
        """Each item with the error that fails its request, or None."""
        if self.prepare_batch is None:
            return [(request_id, segment, self._prepare_error(segment)) for request_id, segment in items]
        segments = [segment for _, segment in items if segment is not None]
        try:
            errors = iter(self.prepare_batch(segments) if segments else [])
        except Exception as exc:  # never the step's end: the batch's requests fail instead
            errors = iter([f"{type(exc).__name__}: {exc}"] * len(segments))
        return [
            (request_id, segment, None if segment is None else next(errors)) for request_id, segment in items
        ]

    def _prepare_error(self, segment: Segment | None) -> str | None:
        """Run `prepare` on a segment; the error that fails its request, if any."""
        if segment is None or self.prepare is None:
            return None
        try:
            self.prepare(segment)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _emit(self, outs: list[RequestOutput]) -> None:
        if outs and self.sink is not None:
            self.sink(outs)

    def _fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Fail every live request with the fault's message (a fault outside the runner's step)."""
        log.error("engine step fault: failing every request", exc_info=exc)
        self.faults += 1
        try:
            with self._lock:
                return self.scheduler.fail(list(self.scheduler.requests), f"{type(exc).__name__}: {exc}")
        except Exception:  # the scheduler cannot fail them either: the thread still serves new ones
            log.exception("engine requests could not be failed after a fault")
            return []

    def _sink_failed(self, outs: list[RequestOutput], exc: BaseException) -> None:
        """The sink raised on a step's outputs: any of them may be lost, so each of their requests
        fails, told one by one so that one request's fault in the sink does not hide the others'."""
        log.error("engine output sink fault: failing its step's requests", exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        ids = list(dict.fromkeys(o.request_id for o in outs))
        try:
            with self._lock:
                fails = self.scheduler.fail(ids, error)
        except Exception:  # the scheduler cannot fail them: their ends are still told below
            log.exception("engine requests could not be failed after a sink fault")
            fails = []
        # a request that finished in this step is no longer the scheduler's: its end is told here
        told = {o.request_id for o in fails}
        fails += [
            RequestOutput(rid, finished=True, status=RequestStatus.FINISHED_ERROR, error=error)
            for rid in ids
            if rid not in told
        ]
        for out in fails:
            try:
                self._emit([out])
            except Exception:
                log.exception("engine output sink could not take request %s's failure", out.request_id)

    # -- the loop thread -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._inputs += 1
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def has_work(self) -> bool:
        """Something for a step to do: a cancel, text not yet the scheduler's, or requests to run."""
        return bool(self._aborts or self._text or self._readied or self.scheduler.has_work())

    def _idle(self) -> bool:
        return not (self._stopping or self.has_work() or self._expiry_due())

    def _expiry_due(self) -> bool:
        """A request queued for admission has waited its max wait: a step refuses it."""
        return self.scheduler.until_expiry() == 0.0

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._idle():
                    self._wake.wait(self.scheduler.until_expiry())
                if self._stopping:
                    return
                inputs, steps, faults = self._inputs, self.steps, self.faults
            # the thread outlives any fault: the requests a fault may have hit fail, the rest go on
            try:
                outs = self.step()
            except Exception as exc:
                outs = self._fail_all(exc)
            try:
                self._emit(outs)
            except Exception as exc:
                self._sink_failed(outs, exc)
            if self.faults != faults:
                with self._wake:  # every input and stop notifies: the wait ends early for them
                    if not self._stopping and self._inputs == inputs:
                        self._wake.wait(FAULT_BACKOFF_S)
                continue
            if self.steps == steps and not outs:
                # nothing could run (e.g. every Code2Wav row is held): sleep until an input arrives
                with self._wake:
                    while not self._stopping and self._inputs == inputs and not self._expiry_due():
                        self._wake.wait(self.scheduler.until_expiry())
