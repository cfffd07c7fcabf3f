from __future__ import annotations

import threading
import time

from engine.core import EngineCore
from engine.plan import StepOutput, StepPlan
from engine.request import RequestStatus
from tests.engine.utils import create_requests, create_scheduler, fake_output, make_segment


class FakeRunner:
    def __init__(self, fail_on_step: int | None = None) -> None:
        self.plans: list[StepPlan] = []
        self.fail_on_step = fail_on_step
        self.during_execute = None

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        if self.during_execute is not None:
            self.during_execute()
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


def test_a_segment_that_fails_to_prepare_ends_its_request():
    def prepare(seg):
        raise ValueError("bad text")

    core = EngineCore(create_scheduler(), FakeRunner(), prepare=prepare)
    (r,) = create_requests(1, segments=0, closed=False)
    core.add_request(r)
    core.add_segment("r0", make_segment())
    outs = core.step()
    assert r.status == RequestStatus.FINISHED_ERROR and "bad text" in outs[0].error


def test_running_loop_prepares_text_on_its_own_thread_while_a_step_runs():
    """The preparer readies text while the step thread is inside execute (waiting for the GPU):
    a segment queued mid-step is ready for the next one, and closes keep their place behind it."""
    threads, finished = [], threading.Event()
    in_step, release = threading.Event(), threading.Event()
    runner = FakeRunner()

    def hold_first_step():
        if len(runner.plans) == 1:
            in_step.set()
            assert release.wait(5)

    runner.during_execute = hold_first_step

    def prepare(seg):
        threads.append(threading.current_thread().name)

    core = EngineCore(create_scheduler(), runner,
                      lambda outs: [finished.set() for o in outs if o.finished], prepare=prepare)
    core.start()
    try:
        (r,) = create_requests(1, prompt_len=2, max_frames=2, segments=1, closed=False)
        core.add_request(r)
        assert in_step.wait(5)  # the step thread is held inside execute
        core.add_segment("r0", make_segment(prompt_len=2, max_frames=2))
        core.close_text("r0")
        deadline = time.monotonic() + 5
        while not threads and time.monotonic() < deadline:
            time.sleep(0.001)
        assert threads == ["engine-prepare"]  # readied while the step still ran
        release.set()
        assert finished.wait(5)
        assert r.text_closed and r.frames_generated == 4  # both segments, then the close
    finally:
        release.set()
        core.stop()
    assert not core.running


def test_running_loop_fails_only_the_request_whose_text_fails_to_prepare():
    errors, finished = {}, threading.Event()

    def prepare(seg):
        if seg.text.text == "bad":
            raise ValueError("bad text")

    def sink(outs):
        for o in outs:
            if o.error:
                errors[o.request_id] = o.error
            if o.request_id == "ok0" and o.finished:
                finished.set()

    core = EngineCore(create_scheduler(), FakeRunner(), sink, prepare=prepare)
    core.start()
    try:
        (bad,) = create_requests(1, segments=0, closed=False, prefix="bad")
        (ok,) = create_requests(1, prompt_len=2, max_frames=2, segments=0, closed=False, prefix="ok")
        core.add_request(bad)
        core.add_request(ok)
        core.add_segment("bad0", make_segment(text="bad"))
        core.add_segment("ok0", make_segment(prompt_len=2, max_frames=2))
        core.close_text("ok0")
        assert finished.wait(5)
        assert "bad text" in errors["bad0"] and "ok0" not in errors
    finally:
        core.stop()


def test_with_the_preparer_thread_off_the_running_loop_readies_text_on_the_step_thread():
    threads, finished = [], threading.Event()
    core = EngineCore(create_scheduler(), FakeRunner(), lambda outs: [finished.set() for o in outs if o.finished],
                      prepare=lambda seg: threads.append(threading.current_thread().name), prepare_thread=False)
    core.start()
    try:
        (r,) = create_requests(1, prompt_len=2, max_frames=2, segments=0, closed=False)
        core.add_request(r)
        core.add_segment("r0", make_segment(prompt_len=2, max_frames=2))
        core.close_text("r0")
        assert finished.wait(5)
        assert threads == ["engine-step"] and r.frames_generated == 2
    finally:
        core.stop()
