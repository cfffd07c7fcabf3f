from __future__ import annotations

import threading
import time

from engine.qwen3.core import EngineCore
from engine.qwen3.plan import StepOutput, StepPlan
from engine.qwen3.request import RequestStatus
from tests.engine.qwen3.utils import create_requests, create_scheduler, fake_output, make_segment


class FakeRunner:
    def __init__(self, fail_on_step: int | None = None) -> None:
        self.plans: list[StepPlan] = []
        self.fail_on_step = fail_on_step
        self.during_execute = None

    def execute(self, plan: StepPlan, while_waiting=None) -> StepOutput:
        self.plans.append(plan)
        if self.during_execute is not None:
            self.during_execute()
        if while_waiting is not None:
            while_waiting()
        if self.fail_on_step is not None and len(self.plans) == self.fail_on_step:
            raise RuntimeError("boom")
        return fake_output(plan)


def test_step_is_schedule_execute_update():
    runner = FakeRunner()
    core = EngineCore(create_scheduler(), runner)
    (r,) = create_requests(1, prompt_len=2, max_frames=3)
    core.add_request(r)
    core.step()
    assert runner.plans[0].sampling_rows == ["r0"] and r.frames_generated == 1


def test_abort_applies_at_the_next_step_and_frees_the_slot():
    runner = FakeRunner()
    sched = create_scheduler(num_kv_slots=1)
    core = EngineCore(sched, runner)
    a, b = create_requests(2, prompt_len=2)
    core.add_request(a)
    core.add_request(b)
    core.step()
    core.abort("r0")
    assert a.status == RequestStatus.DECODING  # not yet: between steps nothing changes
    outs = core.step()
    assert a.status == RequestStatus.FINISHED_CANCELLED and a.kv_slot is None
    assert any(o.request_id == "r0" and o.finished for o in outs)
    assert [c.request_id for c in runner.plans[-1].prefill] == ["r1"]


def test_abort_during_execute_waits_for_the_next_step():
    runner = FakeRunner()
    core = EngineCore(create_scheduler(), runner)
    (a,) = create_requests(1, prompt_len=2)
    core.add_request(a)
    runner.during_execute = lambda: core.abort("r0")
    core.step()
    assert a.frames_generated == 1 and a.status == RequestStatus.DECODING
    runner.during_execute = None
    core.step()
    assert a.status == RequestStatus.FINISHED_CANCELLED
    assert all("r0" not in p.sampling_rows for p in runner.plans[1:])


def test_runner_failure_ends_the_step_requests_not_the_engine():
    runner = FakeRunner(fail_on_step=1)
    core = EngineCore(create_scheduler(), runner)
    (a,) = create_requests(1, prompt_len=2)
    core.add_request(a)
    outs = core.step()
    assert a.status == RequestStatus.FINISHED_ERROR and "boom" in (outs[0].error or "")
    (b,) = create_requests(1, prompt_len=2, prefix="b")
    core.add_request(b)
    core.step()
    assert b.frames_generated == 1


def test_loop_thread_runs_requests_to_the_end_then_sleeps():
    done = threading.Event()
    audio = []

    def sink(outs):
        for o in outs:
            if o.audio is not None:
                audio.append(len(o.audio))
            if o.finished:
                done.set()

    runner = FakeRunner()
    core = EngineCore(create_scheduler(), runner, sink)
    core.start()
    try:
        (r,) = create_requests(1, prompt_len=2, max_frames=10)
        core.add_request(r)
        assert done.wait(5)
        assert sum(audio) == 10 * 1920
        steps = core.steps
        time.sleep(0.05)
        assert core.steps == steps  # idle: no polling steps
        done.clear()
        (r2,) = create_requests(1, prompt_len=2, max_frames=3, prefix="again")
        core.add_request(r2)  # wakes the sleeping loop
        assert done.wait(5)
    finally:
        core.stop()
    assert not core.running


def test_loop_sleeps_when_nothing_can_be_admitted_and_wakes_on_close():
    finished = threading.Event()
    core = EngineCore(
        create_scheduler(codec_slots=1),
        FakeRunner(),
        lambda outs: [finished.set() for o in outs if o.request_id == "b0" and o.finished],
    )
    core.start()
    try:
        (a,) = create_requests(1, prompt_len=2, max_frames=2, closed=False, prefix="a")
        (b,) = create_requests(1, prompt_len=2, max_frames=2, prefix="b")
        core.add_request(a)
        core.add_request(b)  # waits: a holds the only Code2Wav row while it waits for text
        time.sleep(0.05)
        steps = core.steps
        time.sleep(0.05)
        assert core.steps == steps and b.codec_slot is None
        core.close_text("a0")
        assert finished.wait(5)
    finally:
        core.stop()


def test_text_is_prepared_on_the_step_and_applied_in_order():
    prepared = []
    core = EngineCore(create_scheduler(), FakeRunner(), prepare=lambda seg: prepared.append(seg))
    (r,) = create_requests(1, prompt_len=2, max_frames=2, segments=0, closed=False)
    core.add_request(r)
    seg = make_segment(prompt_len=2, max_frames=2)
    core.add_segment("r0", seg)
    core.close_text("r0")
    assert not prepared and not r.text_closed  # nothing happens until the step
    core.step()
    assert prepared == [seg] and r.text_closed and r.frames_generated == 1


def test_text_that_comes_during_a_step_is_prepared_while_the_runner_waits_and_applied_next_step():
    prepared = []
    runner = FakeRunner()
    core = EngineCore(create_scheduler(), runner, prepare=lambda seg: prepared.append(seg))
    (r,) = create_requests(1, prompt_len=2, max_frames=4, segments=0, closed=False)
    core.add_request(r)
    first, second = make_segment(prompt_len=2, max_frames=2), make_segment(prompt_len=2, max_frames=2)
    core.add_segment("r0", first)
    runner.during_execute = lambda: (core.add_segment("r0", second), core.close_text("r0"))
    core.step()
    assert prepared == [first, second]  # the second on this step, inside the runner's wait
    assert r.current is first and second not in r.segments and not r.text_closed  # not yet the scheduler's
    runner.during_execute = None
    core.step()
    assert (second in r.segments or r.current is second) and r.text_closed and prepared == [first, second]


def test_text_readied_during_the_last_step_keeps_the_engine_awake():
    runner = FakeRunner()
    core = EngineCore(create_scheduler(), runner, prepare=lambda seg: None)
    (r,) = create_requests(1, prompt_len=2, max_frames=1, segments=1, closed=False)
    core.add_request(r)
    runner.during_execute = lambda: core.close_text("r0")
    core.step()  # the request's only frame; its close readied, not yet applied
    runner.during_execute = None
    assert not r.text_closed and not core._idle()
    core.step()
    assert r.text_closed


def test_a_segment_that_fails_to_prepare_ends_its_request():
    def prepare(seg):
        raise ValueError("bad text")

    core = EngineCore(create_scheduler(), FakeRunner(), prepare=prepare)
    (r,) = create_requests(1, segments=0, closed=False)
    core.add_request(r)
    core.add_segment("r0", make_segment())
    outs = core.step()
    assert r.status == RequestStatus.FINISHED_ERROR and "bad text" in outs[0].error


def test_a_batch_preparer_gets_a_steps_text_in_one_call_and_fails_only_what_it_refuses():
    calls = []

    def prepare_batch(segments):
        calls.append([s.text.text for s in segments])
        return ["ValueError: bad text" if s.text.text == "bad" else None for s in segments]

    core = EngineCore(create_scheduler(), FakeRunner(), prepare_batch=prepare_batch)
    (bad,) = create_requests(1, segments=0, closed=False, prefix="bad")
    (ok,) = create_requests(1, prompt_len=2, max_frames=2, segments=0, closed=False, prefix="ok")
    core.add_request(bad)
    core.add_request(ok)
    core.add_segment("bad0", make_segment(text="bad"))
    core.add_segment("ok0", make_segment(prompt_len=2, max_frames=2, text="fine"))
    core.close_text("ok0")
    outs = core.step()
    assert calls == [["bad", "fine"]]  # one call for the step's text, closes not among it
    assert bad.status == RequestStatus.FINISHED_ERROR and any("bad text" in (o.error or "") for o in outs)
    assert ok.text_closed and ok.frames_generated == 1 and ok.status != RequestStatus.FINISHED_ERROR


def test_a_batch_preparer_that_raises_fails_its_batch_not_the_engine():
    def prepare_batch(segments):
        raise RuntimeError("device lost")

    core = EngineCore(create_scheduler(), FakeRunner(), prepare_batch=prepare_batch)
    (a,) = create_requests(1, segments=0, closed=False, prefix="a")
    (b,) = create_requests(1, prompt_len=2, max_frames=2, prefix="b")
    core.add_request(a)
    core.add_request(b)
    core.add_segment("a0", make_segment())
    core.step()
    assert a.status == RequestStatus.FINISHED_ERROR and "device lost" in (a.error or "")
    assert b.status != RequestStatus.FINISHED_ERROR and b.frames_generated == 1
