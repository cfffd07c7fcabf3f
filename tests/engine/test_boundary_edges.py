"""Edges where work crosses a boundary: the step thread's failures, admission's places, timers."""

from __future__ import annotations

from engine.qwen3.core import EngineCore
from engine.qwen3.plan import StepOutput, StepPlan
from engine.qwen3.request import RequestStatus
from tests.engine.qwen3.utils import create_requests, create_scheduler, fake_output


class _Runner:
    """Fails the plans numbered in `fail_on`; remembers what the plans that ran asked for."""

    def __init__(self, fail_on: set[int]) -> None:
        self.fail_on = fail_on
        self.plans = 0
        self.resets: set[int] = set()  # codec rows reset by a plan that ran
        self.copies: set[int] = set()  # talker rows that got a prefix copy in a plan that ran

    def execute(self, plan: StepPlan, while_waiting=None) -> StepOutput:
        self.plans += 1
        if self.plans in self.fail_on:
            raise RuntimeError("device fault")
        self.resets.update(plan.codec_resets)
        self.copies.update(c.kv_slot for c in plan.prefix_copies)
        return fake_output(plan)


def test_a_failed_step_never_leaves_a_request_on_a_codec_row_it_did_not_reset():
    # one sampling row per step: a request admitted while another decodes gets its codec row (and
    # that row's reset in the plan) but no prompt chunk, so the step's rows do not name it
    sched = create_scheduler(num_kv_slots=4, max_batch=1, codec_slots=4)
    runner = _Runner(fail_on={2})
    core = EngineCore(sched, runner)
    a, b = create_requests(2, prompt_len=2, max_frames=50)
    core.add_request(a)
    core.step()
    assert a.status == RequestStatus.DECODING
    core.add_request(b)
    core.step()  # fails: a's row fails with it
    assert a.status == RequestStatus.FINISHED_ERROR
    for _ in range(3):
        core.step()
    # b either fails with the step that lost its reset, or runs on a row that was reset
    assert b.status == RequestStatus.FINISHED_ERROR or b.codec_slot in runner.resets


def test_a_failed_step_never_leaves_a_request_on_a_prefix_it_did_not_copy():
    sched = create_scheduler(num_kv_slots=4, max_batch=1, codec_slots=4)
    sched.prefix_lookup = lambda key, length: True  # every prefix is cached
    runner = _Runner(fail_on={2})
    core = EngineCore(sched, runner)
    a, b = create_requests(2, prompt_len=6, max_frames=50)
    for r in (a, b):
        r.segments[0].prefix_key, r.segments[0].prefix_len = "voice", 4
    core.add_request(a)
    core.step()  # a's prompt after the prefix in one chunk: it decodes from here on
    assert a.status == RequestStatus.DECODING
    core.add_request(b)
    core.step()
    assert a.status == RequestStatus.FINISHED_ERROR
    for _ in range(3):
        core.step()
    seg = b.current
    # b's prompt starts after a copied prefix: that copy ran, or b failed with the step that lost it
    assert b.status == RequestStatus.FINISHED_ERROR or (
        seg is not None and seg.copied and b.kv_slot in runner.copies
    )


def test_a_request_closed_with_no_text_gives_its_admission_place_back():
    sched = create_scheduler(codec_slots=1, queue_limit=1)
    (empty,) = create_requests(1, segments=0, closed=True)
    sched.add_request(empty)
    assert empty.status == RequestStatus.FINISHED_STOPPED
    assert sched.admission.figures().admitted == 0
    # the one place is free: the next request is admitted, not queued
    (r,) = create_requests(1, prefix="next")
    sched.add_request(r)
    assert r.admitted


async def test_each_queued_arrival_arming_expiry_keeps_one_timer_not_one_per_arrival():
    import asyncio

    from engine.admission import Admission

    loop = asyncio.get_running_loop()
    adm: Admission[int] = Admission(1, 16, clock=loop.time, lifetime_s=0.001)
    adm.arrive(0)  # holds the one place: the rest queue
    calls = 0

    def expire() -> None:
        nonlocal calls
        calls += 1
        adm.expire()
        adm.arm_expiry(loop, expire)

    for i in range(1, 9):  # as an engine does: each queued arrival with a max wait arms the timer
        adm.arrive(i, max_wait_s=0.02 * i)
        adm.arm_expiry(loop, expire)
    await asyncio.sleep(0.25)
    assert adm.queued == 0 and adm.figures().refused["wait_expired"] == 8
    # one expiry pass per queued request (a timer may fire early), not one per arrival and expiry
    assert calls <= 8 + 2, calls


def test_a_step_whose_output_does_not_fit_its_plan_fails_its_requests_not_the_step_thread():
    class ShortRunner:
        """Hands back one frame fewer than the plan samples on its second step."""

        def __init__(self) -> None:
            self.plans = 0

        def execute(self, plan: StepPlan, while_waiting=None) -> StepOutput:
            self.plans += 1
            out = fake_output(plan)
            if self.plans == 2:
                out.codes = out.codes[:-1]
            return out

    core = EngineCore(create_scheduler(), ShortRunner())
    (a,) = create_requests(1, prompt_len=2, max_frames=50)
    core.add_request(a)
    core.step()
    outs = core.step()  # raised ValueError out of the step, which ends the step thread
    assert a.status == RequestStatus.FINISHED_ERROR
    assert [o.request_id for o in outs if o.finished and o.error] == ["r0"]
    (b,) = create_requests(1, prompt_len=2, prefix="b")
    core.add_request(b)
    core.step()
    assert b.frames_generated == 1


def test_a_failed_step_that_held_a_streams_deferred_audio_ends_that_stream():
    import numpy as np

    from engine.qwen3.request import SAMPLES_PER_FRAME

    class DeferringRunner:
        """Like the runner that defers Code2Wav: a step's later chunks come with the next step's
        output; the step numbered `fail_on` takes them, then fails."""

        def __init__(self, fail_on: int) -> None:
            self.fail_on, self.plans = fail_on, 0
            self.held: list[tuple[str, int]] = []

        def execute(self, plan: StepPlan, while_waiting=None) -> StepOutput:
            self.plans += 1
            out = fake_output(plan)
            held, self.held = self.held, [(c.request_id, c.num_frames) for c in plan.codec]
            if self.plans == self.fail_on:
                raise RuntimeError("device fault")
            now = [(f.request_id, 1) for f in plan.first_audio_now if f.request_id in out.audio]
            audio = {rid: np.ones(n * SAMPLES_PER_FRAME, np.float32) for rid, n in held + now}
            return StepOutput(codes=out.codes, audio=audio, delivered=held + now)

    runner = DeferringRunner(fail_on=0)
    sched = create_scheduler(codec_delivery_steps=1, max_now_frame_rows=0)
    core = EngineCore(sched, runner)
    (a,) = create_requests(1, prompt_len=2, max_frames=4)
    core.add_request(a)
    # a's last chunk launched: the next step only collects it
    while not (a.status == RequestStatus.DRAINING and a.frames_in_flight and not a.frames_pending):
        core.step()
        assert runner.plans < 20
    runner.fail_on = runner.plans + 1  # the step that would hand over a's last audio fails
    for _ in range(5):
        core.step()
    assert a.is_finished  # not a stream left waiting forever for audio the failed step held
    assert not core.has_work()  # nor steps run on and on to collect it
