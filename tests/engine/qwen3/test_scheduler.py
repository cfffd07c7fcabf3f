from __future__ import annotations

import itertools

import pytest

from engine.api import ChunkSchedule, Overloaded, Priority
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager
from engine.qwen3.request import SAMPLES_PER_FRAME, RequestStatus
from engine.qwen3.scheduler import Scheduler, SchedulerConfig, chunk_frames
from tests.engine.qwen3.utils import (
    FakeClock,
    create_requests,
    create_scheduler,
    fake_output,
    make_segment,
    run_steps,
)


def test_new_request_is_prefilled_and_samples_its_first_frame_in_one_step():
    sched = create_scheduler()
    (r,) = create_requests(1, prompt_len=12)
    sched.add_request(r)
    plan = sched.schedule()
    assert [c.length for c in plan.prefill] == [12]
    assert plan.prefill[0].samples_frame and plan.prefill[0].start == 0 and not plan.prefill[0].codes
    assert plan.sampling_rows == ["r0"]
    sched.update(plan, fake_output(plan))
    assert r.status == RequestStatus.DECODING
    assert r.frames_generated == 1
    assert sched.kv.length(r.kv_slot) == 12


def test_decode_rows_feed_positions_after_the_prompt():
    sched = create_scheduler()
    (r,) = create_requests(1, prompt_len=5)
    sched.add_request(r)
    plans, _ = run_steps(sched, 3)
    assert [d.position for p in plans[1:] for d in p.decode] == [5, 6]
    assert [d.frame_index for p in plans[1:] for d in p.decode] == [1, 2]


def test_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples():
    sched = create_scheduler(max_prefill_chunk=256, max_len=1024)
    (r,) = create_requests(1, prompt_len=600)
    sched.add_request(r)
    plans, _ = run_steps(sched, 3)
    chunks = [c for p in plans for c in p.prefill]
    assert [(c.start, c.length, c.samples_frame) for c in chunks] == [
        (0, 256, False),
        (256, 256, False),
        (512, 88, True),
    ]
    assert r.frames_generated == 1


def test_short_request_is_not_stuck_behind_a_long_prompt():
    sched = create_scheduler(max_prefill_chunk=128, max_tokens_per_step=256, max_len=2048)
    (long_r,) = create_requests(1, prompt_len=1500, prefix="long")
    (short_r,) = create_requests(1, prompt_len=20, prefix="short", arrival_time=0.001)
    sched.add_request(long_r)
    sched.add_request(short_r)
    plan = sched.schedule()
    assert {c.request_id: c.length for c in plan.prefill} == {"long0": 128, "short0": 20}
    sched.update(plan, fake_output(plan))
    assert short_r.frames_generated == 1 and long_r.frames_generated == 0


def test_decode_rows_take_the_token_budget_first():
    sched = create_scheduler(max_tokens_per_step=6, max_prefill_chunk=100)
    for r in create_requests(4, prompt_len=1):
        sched.add_request(r)
    run_steps(sched, 1)  # four one-token prompts: all decoding now
    (late,) = create_requests(1, prompt_len=50, prefix="late")
    sched.add_request(late)
    plan = sched.schedule()
    assert len(plan.decode) == 4
    assert [(c.request_id, c.length) for c in plan.prefill] == [("late0", 2)]
    assert plan.num_prefill_tokens + len(plan.decode) == 6


def test_max_batch_bounds_rows_per_step():
    sched = create_scheduler(num_kv_slots=8, max_batch=3)
    for r in create_requests(5, prompt_len=2):
        sched.add_request(r)
    plan = sched.schedule()
    assert len(plan.sampling_rows) == 3


def test_eos_ends_the_segment_without_a_frame_and_frees_the_slot_for_the_next_request():
    sched = create_scheduler(num_kv_slots=1)
    a, b = create_requests(2, prompt_len=3)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    assert plan.sampling_rows == ["r0"]
    sched.update(plan, fake_output(plan))
    plan = sched.schedule()
    sched.update(plan, fake_output(plan, eos_for={"r0"}))
    assert a.frames_generated == 1  # the EOS step added no frame
    assert a.kv_slot is None and a.status in (RequestStatus.DRAINING, RequestStatus.FINISHED_STOPPED)
    plan = sched.schedule()  # slot refilled at the very next step
    assert [c.request_id for c in plan.prefill] == ["r1"]
    assert plan.freed_kv_slots == [0]


def test_segment_stops_at_max_frames_and_at_the_cache_length():
    sched = create_scheduler(max_len=20)
    (a,) = create_requests(1, prompt_len=5, max_frames=4, prefix="a")
    (b,) = create_requests(1, prompt_len=15, max_frames=100, prefix="b")
    sched.add_request(a)
    sched.add_request(b)
    run_steps(sched, 12)
    assert a.frames_generated == 4
    assert b.frames_generated == 5  # positions 15..19 hold frames 0..4 inputs at most


def test_overloaded_beyond_capacity_plus_queue_limit():
    sched = create_scheduler(codec_slots=2, queue_limit=1)
    reqs = create_requests(4)
    for r in reqs[:3]:
        sched.add_request(r)
    with pytest.raises(Overloaded):
        sched.add_request(reqs[3])
    plan = sched.schedule()
    assert len(plan.prefill) == 2  # the third waits for a Code2Wav row
    assert sched.num_active == 2 and sched.num_queued == 1


def test_queued_request_is_admitted_when_a_request_finishes():
    sched = create_scheduler(codec_slots=1, queue_limit=4)
    a, b = create_requests(2, prompt_len=2, max_frames=2)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(12):
        if b.frames_generated:
            break
        plan = sched.schedule()
        sched.update(plan, fake_output(plan))
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert b.frames_generated >= 1


def test_duplicate_request_id_is_rejected():
    sched = create_scheduler()
    (r,) = create_requests(1)
    sched.add_request(r)
    with pytest.raises(ValueError):
        sched.add_request(create_requests(1)[0])


def test_interactive_admitted_before_bulk():
    sched = create_scheduler(num_kv_slots=1)
    (bulk,) = create_requests(1, priority=Priority.BULK, prefix="bulk")
    (inter,) = create_requests(1, prefix="inter", arrival_time=1.0)
    sched.add_request(bulk)
    sched.add_request(inter)
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefill] == ["inter0"]


def test_interactive_preempts_bulk_which_later_resumes_with_recompute():
    clock = FakeClock()
    sched = create_scheduler(num_kv_slots=1, clock=clock)
    (bulk,) = create_requests(1, prompt_len=4, priority=Priority.BULK, prefix="bulk", max_frames=5)
    sched.add_request(bulk)
    run_steps(sched, 3, clock)
    assert bulk.frames_generated == 3
    (inter,) = create_requests(1, prompt_len=2, max_frames=2, prefix="inter", arrival_time=clock.t)
    sched.add_request(inter)
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefill] == ["inter0"] and not plan.decode
    assert bulk.status == RequestStatus.WAITING and bulk.preemptions == 1
    sched.update(plan, fake_output(plan))
    for _ in range(10):
        plan = sched.schedule()
        resumed = [c for c in plan.prefill if c.request_id == "bulk0"]
        sched.update(plan, fake_output(plan))
        if resumed:
            break
    (chunk,) = resumed
    # the context is rebuilt: prompt (4) + the 3 frames generated before the preemption
    assert (chunk.start, chunk.length, chunk.prompt_len) == (0, 7, 4)
    assert chunk.codes == bulk.codes[:3] and chunk.frame_index == 3
    run_steps(sched, 5)
    assert bulk.frames_generated == 5


def test_bulk_does_not_preempt_and_preemption_can_be_disabled():
    sched = create_scheduler(num_kv_slots=1, preempt_bulk=False)
    (bulk,) = create_requests(1, priority=Priority.BULK, prefix="bulk")
    sched.add_request(bulk)
    run_steps(sched, 1)
    (inter,) = create_requests(1, prefix="inter")
    sched.add_request(inter)
    plan = sched.schedule()
    assert plan.sampling_rows == ["bulk0"] and inter.status == RequestStatus.WAITING


def test_abort_frees_slots_at_the_next_step():
    sched = create_scheduler(num_kv_slots=1, codec_slots=1)
    a, b = create_requests(2, prompt_len=2)
    sched.add_request(a)
    sched.add_request(b)
    run_steps(sched, 2)
    outs = sched.abort(["r0"])
    assert outs[0].finished and outs[0].status == RequestStatus.FINISHED_CANCELLED
    assert a.kv_slot is None and a.codec_slot is None
    plan = sched.schedule()
    assert "r0" not in plan.sampling_rows and [c.request_id for c in plan.prefill] == ["r1"]
    assert sched.abort(["r0", "missing"]) == []


def test_update_ignores_rows_of_a_request_aborted_mid_step():
    sched = create_scheduler()
    (a,) = create_requests(1)
    sched.add_request(a)
    plan = sched.schedule()
    sched.abort(["r0"])
    assert sched.update(plan, fake_output(plan)) == []
    assert a.frames_generated == 0


def test_chunk_frames_grow_to_the_largest():
    s = ChunkSchedule(first=1, growth=2.0, largest=25)
    assert [chunk_frames(s, i) for i in range(7)] == [1, 2, 4, 8, 16, 25, 25]
    assert chunk_frames(ChunkSchedule(first=2), 0) == 2
    assert chunk_frames(s, 1000) == 25


def _codec_sizes(sched, clock, steps, dt=0.01):
    sizes = []
    for _ in range(steps):
        plan = sched.schedule()
        sizes += [c.num_frames for c in plan.codec] + [1] * len(plan.first_audio_now)
        clock.t += dt
        sched.update(plan, fake_output(plan))
    return sizes


def test_codec_chunks_follow_the_schedule_when_the_buffer_allows():
    clock = FakeClock()
    sched = create_scheduler(clock=clock, safety_margin_s=0.0)
    (r,) = create_requests(1, prompt_len=3, max_frames=80)
    sched.add_request(r)
    sizes = _codec_sizes(sched, clock, 90)
    assert sizes[:6] == [1, 2, 4, 8, 16, 25]
    assert sum(sizes) == 80
    assert all(s in (1, 2, 4, 8, 16, 25) for s in sizes)
    assert r.status == RequestStatus.FINISHED_STOPPED
    # the step that prefills and samples the first frame also decodes it
    assert r.ttfa is not None and r.ttfa == pytest.approx(0.01)


def test_codec_keeps_a_safety_margin_before_growing():
    clock = FakeClock()
    sched = create_scheduler(clock=clock, safety_margin_s=0.1)
    (r,) = create_requests(1, prompt_len=3, max_frames=80)
    sched.add_request(r)
    sizes = _codec_sizes(sched, clock, 90)
    # one frame per chunk until the listener holds more than the margin, then the schedule grows
    assert sizes[:3] == [1, 1, 1] and max(sizes) == 25 and sum(sizes) == 80


def test_codec_emits_early_when_the_listeners_buffer_runs_low():
    clock = FakeClock()
    # slow steps: 60 ms per frame, almost real time (80 ms)
    sched = create_scheduler(clock=clock, safety_margin_s=0.1)
    (r,) = create_requests(1, prompt_len=3, max_frames=60)
    sched.add_request(r)
    sizes = _codec_sizes(sched, clock, 70, dt=0.06)
    assert sizes[0] == 1
    # growth would ask for 2, 4, 8... but the buffer never holds enough to wait for them
    assert max(sizes) <= 2
    assert sum(sizes) == 60


def _sizes_with_host_gap(busy: float, gap: float, steps: int) -> list[int]:
    """Chunk sizes when each step takes `busy` from planning to results and `gap` more before the
    next step is planned (host work outside the step): frames come once per busy + gap."""
    clock = FakeClock()
    sched = create_scheduler(clock=clock, safety_margin_s=0.1)
    (r,) = create_requests(1, prompt_len=3, max_frames=60)
    sched.add_request(r)
    sizes, late = [], 0
    for _ in range(steps):
        plan = sched.schedule()
        sizes += [c.num_frames for c in plan.codec] + [1] * len(plan.first_audio_now)
        clock.t += busy
        sched.update(plan, fake_output(plan))
        if r.first_audio_time is not None and not r.is_finished:
            late += clock.t > r.deadline  # the listener ran dry
        clock.t += gap
    assert late == 0
    assert sched.step_time_s == pytest.approx(busy + gap, rel=0.05)
    assert sched.step_busy_s == pytest.approx(busy, rel=0.05)
    return sizes


def test_deadlines_count_the_time_between_steps_not_only_the_step():
    # 70 ms from one frame to the next, of which 20 ms is the step: the buffer allows no growth
    assert max(_sizes_with_host_gap(0.02, 0.05, 80)) <= 2
    # the same frames every 20 ms: the schedule grows
    assert max(_sizes_with_host_gap(0.02, 0.0, 80)) == 25


def test_an_idle_engine_does_not_count_as_a_slow_step():
    clock = FakeClock()
    sched = create_scheduler(clock=clock)
    for r in create_requests(4, prompt_len=4, max_frames=500):
        sched.add_request(r)
    run_steps(sched, 80, clock, dt=0.03)
    clock.t += 30.0  # the loop stalled for half a minute
    run_steps(sched, 1, clock, dt=0.03)
    assert sched.step_time_s == pytest.approx(0.03, rel=0.01)


def test_a_stream_waiting_for_its_text_does_not_count_as_a_slow_step():
    # its segment spoken, the text still open: plans come up empty and the loop sleeps until the
    # client's next text, so the plan after each sleep must not measure the sleep as a step
    clock = FakeClock()
    sched = create_scheduler(clock=clock)
    (r,) = create_requests(1, prompt_len=4, max_frames=6, closed=False)
    sched.add_request(r)
    empty = 0
    for _ in range(40):
        plan = sched.schedule()
        if plan.is_empty:
            empty += 1
            clock.t += 0.5
            continue
        clock.t += 0.01
        sched.update(plan, fake_output(plan))
    assert empty > 20
    assert [cost for _, cost in sched.capacity.curve.curve()] == [pytest.approx(0.01)]
    assert sched.step_time_s < 0.03  # the sleeps are not in the step time either (0.5 s each)


def test_first_chunks_go_before_later_ones():
    clock = FakeClock()
    sched = create_scheduler(clock=clock, max_codec_rows=1)
    (old,) = create_requests(1, prompt_len=1, prefix="old")
    sched.add_request(old)
    _codec_sizes(sched, clock, 4)
    assert old.chunks_emitted >= 1
    # a first chunk of two frames goes through the codec queue (one frame would be decoded at once)
    (new,) = create_requests(
        1, prompt_len=1, prefix="new", arrival_time=clock.t, schedule=ChunkSchedule(first=2)
    )
    sched.add_request(new)
    for _ in range(4):
        plan = sched.schedule()
        if plan.codec and plan.codec[0].request_id == "new0":
            break
        sched.update(plan, fake_output(plan))
    assert plan.codec[0].request_id == "new0" and plan.codec[0].first_chunk


def test_a_one_frame_first_chunk_is_decoded_in_the_step_that_samples_it():
    clock = FakeClock()
    sched = create_scheduler(clock=clock)
    a, b, c = create_requests(3, prompt_len=2)
    b.schedule = ChunkSchedule(first=2)
    for r in (a, b, c):
        sched.add_request(r)
    plan = sched.schedule()
    assert [f.request_id for f in plan.first_audio_now] == ["r0", "r2"]  # r1's first chunk is 2 frames
    outs = {o.request_id: o for o in sched.update(plan, fake_output(plan, eos_for={"r2"}))}
    assert outs["r0"].audio is not None and a.chunks_emitted == 1 and a.frames_decoded == 1
    assert a.first_audio_time is not None and a.frames_pending == 0
    assert b.chunks_emitted == 0 and b.frames_pending == 1
    assert c.chunks_emitted == 0 and c.frames_generated == 0  # an EOS first frame makes no audio
    later = sched.schedule()
    assert "r0" not in [x.request_id for x in later.codec]
    # no first frame is left; r0's listener holds one frame (80 ms), short of the margin and two
    # steps: its next frame is decoded in the step that samples it (max_now_frame_rows)
    assert [(f.request_id, f.frame) for f in later.first_audio_now] == [("r0", 1)]


def test_final_flush_uses_bucket_sizes():
    clock = FakeClock()
    sched = create_scheduler(clock=clock, codec_frame_buckets=(1, 4))
    (r,) = create_requests(1, prompt_len=1, max_frames=7, schedule=ChunkSchedule(first=4, largest=4))
    sched.add_request(r)
    sizes = _codec_sizes(sched, clock, 12)
    assert sizes == [4, 1, 1, 1]


def test_segments_run_back_to_back_on_one_slot_with_one_codec_timeline():
    sched = create_scheduler()
    (r,) = create_requests(1, prompt_len=3, max_frames=2, segments=3)
    sched.add_request(r)
    slot = None
    finished = []
    for _ in range(20):
        plan = sched.schedule()
        for c in plan.prefill:
            slot = c.kv_slot if slot is None else slot
            assert c.kv_slot == slot
        for o in sched.update(plan, fake_output(plan)):
            finished += o.finished_segments
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert [s.first_frame for s in finished] == [0, 2, 4]
    assert r.frames_decoded == 6


def test_streamed_text_waits_then_finishes_after_close():
    sched = create_scheduler()
    (r,) = create_requests(1, prompt_len=2, max_frames=2, closed=False)
    sched.add_request(r)
    run_steps(sched, 6)
    assert r.status == RequestStatus.WAITING_FOR_TEXT and r.kv_slot is None and r.codec_slot is not None
    assert not sched.has_work()
    sched.add_segment("r0", make_segment(prompt_len=2, max_frames=3))
    assert r.status == RequestStatus.WAITING and sched.has_work()
    run_steps(sched, 8)
    assert r.frames_generated == 5 and r.frames_decoded == 5
    outs = sched.close_text("r0")
    assert outs and outs[0].finished and r.status == RequestStatus.FINISHED_STOPPED
    assert sched.num_active == 0


def test_request_opened_without_text_holds_nothing():
    sched = create_scheduler(codec_slots=1)
    (r,) = create_requests(1, segments=0, closed=False)
    sched.add_request(r)
    assert r.codec_slot is None and sched.num_queued == 1 and not sched.has_work()


def test_has_work_is_false_when_idle():
    sched = create_scheduler()
    assert not sched.has_work()
    (r,) = create_requests(1, prompt_len=2, max_frames=3)
    sched.add_request(r)
    assert sched.has_work()
    run_steps(sched, 10)
    assert not sched.has_work() and sched.schedule().is_empty


def test_codec_resets_reported_once_per_new_request():
    sched = create_scheduler()
    a, b = create_requests(2)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    assert sorted(plan.codec_resets) == [0, 1]
    sched.update(plan, fake_output(plan))
    assert sched.schedule().codec_resets == []


def test_sample_offsets_are_contiguous():
    clock = FakeClock()
    sched = create_scheduler(clock=clock)
    (r,) = create_requests(1, prompt_len=2, max_frames=30)
    sched.add_request(r)
    offset = 0
    for _ in range(40):
        plan = sched.schedule()
        clock.t += 0.01
        for o in sched.update(plan, fake_output(plan)):
            if o.audio is not None:
                assert o.sample_offset == offset
                offset += len(o.audio)
    assert offset == 30 * 1920


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(codec_frame_buckets=(2, 4))
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch=-1)
    with pytest.raises(ValueError):
        SchedulerConfig(max_prefill_chunk=0)


def test_sizes_left_at_zero_follow_the_talker_slots():
    auto = SchedulerConfig(codec_slots=0, max_batch=0, max_codec_rows=0, max_tokens_per_step=0)
    sized = auto.sized(768)
    assert (sized.codec_slots, sized.max_batch, sized.max_codec_rows, sized.max_tokens_per_step) == (
        768,
        768,
        768,
        1280,
    )
    bounded = SchedulerConfig(codec_slots=300, max_batch=0, max_codec_rows=0, max_tokens_per_step=0).sized(
        768
    )
    assert (bounded.codec_slots, bounded.max_batch, bounded.max_tokens_per_step) == (300, 300, 812)
    given = SchedulerConfig(max_batch=64, max_codec_rows=32).sized(768)
    assert (given.max_batch, given.max_codec_rows, given.max_tokens_per_step) == (64, 32, 512)
    with pytest.raises(ValueError, match="sized"):
        Scheduler(auto, KVCacheManager(KVCacheLayout(num_slots=8, max_len=64, bytes_per_token=1)))


def _overloaded_codec_chunks(early_cap: int, n: int = 200) -> list[list[int]]:
    """Later chunk sizes per step for n streams whose steps take 200 ms (far slower than real time)."""
    clock = FakeClock()
    sched = create_scheduler(
        num_kv_slots=n,
        clock=clock,
        max_batch=n,
        codec_slots=n,
        max_codec_rows=n,
        max_tokens_per_step=4 * n,
        max_early_codec_rows=early_cap,
        safety_margin_s=0.1,
        initial_streams=n,  # every stream admitted before a step is measured: the overload comes after
    )
    for r in create_requests(n, prompt_len=2, max_frames=40):
        sched.add_request(r)
    per_step: list[list[int]] = []
    for _ in range(40):
        plan = sched.schedule()
        per_step.append([c.num_frames for c in plan.codec if not c.first_chunk])
        clock.t += 0.2
        sched.update(plan, fake_output(plan))
    return [sizes for sizes in per_step[5:] if sizes]


def test_under_overload_early_flushes_are_capped_and_late_rows_grow_their_chunks():
    capped, uncapped = _overloaded_codec_chunks(64), _overloaded_codec_chunks(200)
    # a later chunk of one frame is always early (the schedule asks for 2 or more after the first)
    assert all(sizes.count(1) <= 64 for sizes in capped)
    assert any(sizes.count(1) > 64 for sizes in uncapped)

    def frames_per_chunk(steps: list[list[int]]) -> float:
        return sum(map(sum, steps)) / sum(map(len, steps))

    assert frames_per_chunk(uncapped) < 1.2  # every late row flushes its one new frame every step
    assert frames_per_chunk(capped) > 2.0  # held-back rows grow: fewer, larger Code2Wav rows


def test_early_flushes_are_not_capped_at_light_load():
    clock = FakeClock()
    sched = create_scheduler(clock=clock, max_early_codec_rows=1, safety_margin_s=0.1)
    reqs = create_requests(1, prompt_len=3, max_frames=60)
    sched.add_request(reqs[0])
    sizes = _codec_sizes(sched, clock, 70, dt=0.06)
    assert max(sizes) <= 2 and sum(sizes) == 60  # the one late row still flushes every step


def _waiting_chunk(rid: str, chunk_index: int, pending: int, clock: FakeClock, buffered_s: float = 2.0):
    """A decoding request whose next chunk is `chunk_index` of the default schedule (1, 2, 4, 8, 16,
    25), with `pending` frames ready and `buffered_s` of audio still ahead of its listener."""
    (r,) = create_requests(1, prompt_len=1, max_frames=500, prefix=rid)
    r.status = RequestStatus.DECODING
    launched = 40
    r.codes = [[5] * 16 for _ in range(launched + pending)]
    r.frames_launched = r.frames_decoded = launched
    r.chunks_emitted = chunk_index
    r.first_audio_time = clock.t + buffered_s - launched * 0.08
    return r


def _codec_plan(requests, clock: FakeClock, **config) -> dict[str, int]:
    sched = create_scheduler(num_kv_slots=64, clock=clock, codec_slots=64, **config)
    for slot, r in enumerate(requests):
        r.codec_slot = slot
        sched.requests[r.request_id] = r
    return {c.request_id: c.num_frames for c in sched._schedule_codec(clock.t)}


def test_a_small_group_of_on_schedule_chunks_joins_a_smaller_size_saving_a_codec_launch():
    clock = FakeClock(10.0)
    fours = [_waiting_chunk(f"four{i}-", 2, 4, clock) for i in range(9)]
    eights = [_waiting_chunk(f"eight{i}-", 3, 8, clock) for i in range(3)]
    plan = _codec_plan(fours + eights, clock)
    assert set(plan.values()) == {4}  # one launch: the three 8-frame chunks went as 4 frames
    assert len(plan) == 12
    # a group as large as the limit keeps its size; so does everything with merging off
    many = [_waiting_chunk(f"e{i}-", 3, 8, clock) for i in range(32)]
    assert sorted(set(_codec_plan(fours + many, clock).values())) == [4, 8]
    assert sorted(set(_codec_plan(fours + eights, clock, merge_codec_groups_below=0).values())) == [4, 8]


def test_a_chunk_is_cut_down_only_when_its_listener_can_wait():
    clock = FakeClock(10.0)
    # nine listeners about to run dry, each with the one frame it has (its schedule wants 2)
    ones = [_waiting_chunk(f"one{i}-", 1, 1, clock, buffered_s=0.0) for i in range(9)]
    # two rows of 8 frames: one on schedule whose listener holds 2 s, one about to run dry (its
    # schedule wants 16); after a 1-frame chunk the second would hold 80 ms, less than the margin
    # and a step
    relaxed = _waiting_chunk("relaxed-", 3, 8, clock, buffered_s=2.0)
    late = _waiting_chunk("late-", 4, 8, clock, buffered_s=0.0)
    plan = _codec_plan([*ones, relaxed], clock, safety_margin_s=0.1)
    assert plan["relaxed-0"] == 1 and set(plan.values()) == {1}
    plan = _codec_plan([*ones, relaxed, late], clock, safety_margin_s=0.1)
    assert plan["late-0"] == 8 and plan["relaxed-0"] == 8  # a group moves whole or not at all
    # a first chunk keeps its size too
    (fresh,) = create_requests(1, prompt_len=1, prefix="fresh", arrival_time=clock.t)
    fresh.status = RequestStatus.DECODING
    fresh.codes = [[5] * 16, [5] * 16]
    fresh.schedule = ChunkSchedule(first=2)
    assert _codec_plan([*ones, fresh], clock)["fresh0"] == 2


def test_a_steps_codec_frames_stay_near_production_when_listeners_can_wait():
    clock = FakeClock(10.0)
    relaxed = [_waiting_chunk(f"calm{i}-", 5, 25, clock, buffered_s=3.0) for i in range(6)]
    urgent = [_waiting_chunk(f"dry{i}-", 5, 25, clock, buffered_s=0.05) for i in range(2)]
    sched = create_scheduler(num_kv_slots=64, clock=clock, codec_slots=64, merge_codec_groups_below=0)
    for slot, r in enumerate(urgent + relaxed):
        r.codec_slot = slot
        sched.requests[r.request_id] = r
    sched._frames_per_step = 40.0  # the talker makes 40 frames a step: at most 60 frames go now
    plan = {c.request_id: c.num_frames for c in sched._schedule_codec(clock.t)}
    assert "dry0-0" in plan and "dry1-0" in plan  # the listeners about to run dry go first
    assert sum(plan.values()) <= 60 and len(plan) == 2
    sched.config.codec_frames_over_production = 0  # no limit
    assert len(sched._schedule_codec(clock.t)) == 8


def test_a_streams_two_chunks_delivered_in_one_step_make_one_output_at_the_earlier_offset():
    import numpy as np

    from engine.qwen3.plan import StepOutput, StepPlan

    clock = FakeClock(10.0)
    r = _waiting_chunk("two-", 2, 0, clock)
    r.frames_launched = 43  # frames 40-42 in flight: a deferred 2-frame chunk, a frame decoded in its step
    sched = create_scheduler(num_kv_slots=64, clock=clock, codec_slots=64)
    r.codec_slot = 0
    sched.requests[r.request_id] = r
    audio = np.zeros(3 * 1920, np.float32)
    (out,) = sched.update(
        StepPlan(step=1), StepOutput(codes=[], audio={"two-0": audio}, delivered=[("two-0", 2), ("two-0", 1)])
    )
    assert out.sample_offset == 40 * 1920 and out.audio is audio and r.frames_decoded == 43


def test_config_override_sets_typed_fields_and_rejects_bad_names_and_types():
    config = SchedulerConfig()
    returned = config.override(
        [
            "preempt_bulk=false",
            "max_early_codec_rows=96",
            "safety_margin_s=1",
            "codec_frame_buckets=[4, 1, 2]",
        ]
    )
    assert returned is config
    assert config.preempt_bulk is False and config.max_early_codec_rows == 96
    assert config.safety_margin_s == 1.0 and isinstance(config.safety_margin_s, float)
    assert config.codec_frame_buckets == (1, 2, 4)  # sorted again, as at construction
    for bad, message in [
        ("no_such_field=1", "FIELD one of"),
        ("max_batch", "FIELD=VALUE"),
        ("max_batch=yes", "not a JSON value"),
        ("max_batch=1.5", "expected int"),
        ("preempt_bulk=1", "expected bool"),
        ("codec_frame_buckets=[2]", "must contain 1"),
        # derived from the model and the runner: not settings
        ("codec_delivery_steps=2", "FIELD one of"),
        ("eos_code=7", "FIELD one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig().override([bad])


def _frames_decoded_now(dt: float, rows: int, n: int = 1, frames: int = 30):
    """Requests of `frames` frames with `dt` seconds per step: the frames each step decodes in the step
    that samples them (request id, frame), and each request's audio offsets."""
    clock = FakeClock()
    sched = create_scheduler(clock=clock, safety_margin_s=0.1, max_now_frame_rows=rows)
    reqs = create_requests(n, prompt_len=3, max_frames=frames)
    for r in reqs:
        sched.add_request(r)
    now: list[list[tuple[str, int]]] = []
    audio: dict[str, list[tuple[int, int]]] = {r.request_id: [] for r in reqs}
    for _ in range(frames * 3):
        plan = sched.schedule()
        now.append([(f.request_id, f.frame) for f in plan.first_audio_now])
        chunked = {c.request_id for c in plan.codec}
        assert not any(frame and rid in chunked for rid, frame in now[-1])  # never beside its own chunk
        clock.t += dt
        for o in sched.update(plan, fake_output(plan)):
            if o.audio is not None:
                audio[o.request_id].append((o.sample_offset, len(o.audio)))
        if all(r.is_finished for r in reqs):
            break
    assert all(r.status == RequestStatus.FINISHED_STOPPED for r in reqs)
    for spans in audio.values():  # every stream's audio contiguous and complete
        assert [off for off, _ in spans] == list(itertools.accumulate([0] + [n for _, n in spans[:-1]]))
        assert sum(n for _, n in spans) == frames * SAMPLES_PER_FRAME
    return now


def test_a_frame_whose_listener_runs_low_is_decoded_in_the_step_that_samples_it():
    # 60 ms a step against 80 ms of audio a frame: the buffer stays short for several frames
    frames = [f for step in _frames_decoded_now(0.06, rows=64) for _, f in step]
    assert frames[0] == 0 and len(frames) >= 4 and frames == sorted(set(frames))


def test_only_first_frames_are_decoded_in_their_step_when_the_option_is_off():
    frames = [f for step in _frames_decoded_now(0.06, rows=0) for _, f in step]
    assert frames == [0]


def test_a_listener_with_time_to_spare_waits_for_its_scheduled_chunks():
    # 10 ms a step: after a frame or two the buffer outgrows the margin and chunks grow again
    frames = [f for step in _frames_decoded_now(0.01, rows=64) for _, f in step]
    assert frames[0] == 0 and len(frames) <= 3


def test_at_most_the_cap_of_such_frames_a_step():
    steps = _frames_decoded_now(0.06, rows=1, n=4)
    later = [[(rid, f) for rid, f in step if f] for step in steps]
    assert max(len(s) for s in later) == 1 and sum(len(s) for s in later) >= 4
