"""engine.admission: the measured cost curve and the bounded, priority-ordered queue."""

from __future__ import annotations

import pytest

from engine.admission import QUEUE_WAIT_BOUNDS_S, Admission, LoadCurve, in_series
from engine.api import Overloaded, Priority


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the cost curve ---------------------------------------------------------------------------------
def test_an_empty_curve_predicts_nothing_and_admits_nothing() -> None:
    curve = LoadCurve()
    assert curve.predict(1) is None and curve.rows_within(1.0, 100) == 0


def test_the_curve_interpolates_and_never_falls_with_the_batch() -> None:
    curve = LoadCurve(rise=1.0, fall=1.0)
    for rows, cost in ((8, 10.0), (32, 20.0), (64, 18.0)):  # 64 measured cheaper: noise
        curve.observe(rows, cost)
    assert curve.predict(8) == 10.0
    assert curve.predict(20) == pytest.approx(15.0)
    assert curve.predict(64) == 20.0  # held at the smaller batch's cost
    assert curve.predict(4) == 10.0


def test_a_costlier_smaller_batch_long_unobserved_no_longer_caps_the_larger() -> None:
    curve = LoadCurve(rise=1.0, fall=1.0, memory=80)  # passed over 10 observations on
    curve.observe(8, 10.0)
    curve.observe(300, 60.0)  # a ramp's costly step, never measured again
    curve.observe(450, 30.0)
    assert curve.predict(450) == 60.0  # still fresh: held
    for _ in range(8):
        curve.observe(450, 30.0)
    assert curve.predict(450) == 60.0
    curve.observe(450, 30.0)
    assert curve.predict(450) == 30.0
    assert curve.predict(229) == pytest.approx(20.0)  # between 8 and 450, as if 300 were never seen
    assert curve.rows_within(40.0, 10_000) > 450
    curve.observe(300, 60.0)  # measured again: holds the larger batch again
    assert curve.predict(450) == 60.0


def test_a_costly_step_after_load_left_the_larger_batches_does_not_cap_them() -> None:
    curve = LoadCurve(rise=1.0, fall=1.0, memory=80)  # passed over 10 observations apart
    for _ in range(20):
        curve.observe(500, 40.0)  # at load
    for rows in range(400, 0, -20):  # a drain: the streams end, the batch shrinks
        curve.observe(rows, 5.0 + rows / 20)
    curve.observe(3, 300.0)  # one of its last steps, costly for a reason not its rows'
    assert curve.predict(500) == 40.0  # the batch measured long before it is not held
    assert curve.rows_within(56.0, 1000) >= 500
    curve.observe(500, 70.0)  # load back, and the larger batch measured again: its own cost
    assert curve.predict(500) == 70.0


def test_what_the_curve_admits_follows_each_new_observation() -> None:
    curve = LoadCurve(rise=1.0, fall=1.0)
    curve.observe(100, 10.0)
    assert curve.rows_within(30.0, 1000) == 125  # out to its reach
    assert curve.rows_within(30.0, 1000) == 125  # asked again: the same answer
    curve.observe(100, 40.0)
    assert curve.rows_within(30.0, 1000) == 0  # even the batch measured now costs more


def test_the_curve_reaches_only_a_little_past_what_was_measured() -> None:
    curve = LoadCurve(rise=1.0, fall=1.0, probe_factor=1.25, probe_rows=8)
    curve.observe(100, 30.0)
    curve.observe(200, 50.0)
    assert curve.reach() == 250
    assert curve.predict(250) == pytest.approx(60.0)  # along the last segment's slope
    assert curve.predict(251) is None
    # a limit the curve would allow far out is held at its reach
    assert curve.rows_within(1000.0, 10_000) == 250
    assert curve.rows_within(40.0, 10_000) == 150
    assert curve.rows_within(40.0, 120) == 120


def test_one_point_extends_in_proportion() -> None:
    curve = LoadCurve(rise=1.0, fall=1.0, probe_factor=1.5, probe_rows=16)
    curve.observe(1, 0.01)
    assert curve.reach() == 17
    assert curve.predict(10) == pytest.approx(0.1)
    assert curve.rows_within(0.6, 1000) == 17


def test_the_curve_ignores_nonsense() -> None:
    curve = LoadCurve()
    curve.observe(0, 1.0)
    curve.observe(4, float("nan"))
    curve.observe(4, -1.0)
    assert curve.samples == 0


# -- admission --------------------------------------------------------------------------------------
def test_admitted_up_to_capacity_then_queued_then_refused() -> None:
    clock = Clock()
    adm: Admission[str] = Admission(max_streams=10, queue_limit=2, capacity=lambda: 3, clock=clock)
    tickets = [adm.arrive(f"s{i}") for i in range(5)]
    assert [t.admitted_at is not None for t in tickets] == [True, True, True, False, False]
    assert [t.position for t in tickets[3:]] == [1, 2]
    with pytest.raises(Overloaded) as refused:
        adm.arrive("s5")
    assert refused.value.retry_after_s >= 0.5
    figures = adm.figures()
    assert (figures.capacity, figures.admitted, figures.queued, figures.queue_limit) == (3, 3, 2, 2)
    assert figures.refused == {"queue_full": 1, "max_wait": 0, "wait_expired": 0}


def test_capacity_is_bounded_by_max_streams_and_at_least_one() -> None:
    assert Admission[str](max_streams=4, queue_limit=0, capacity=lambda: 100).capacity() == 4
    assert Admission[str](max_streams=4, queue_limit=0, capacity=lambda: 0).capacity() == 1


def test_fifo_within_priority_interactive_first() -> None:
    clock = Clock()
    adm: Admission[str] = Admission(max_streams=1, queue_limit=10, clock=clock)
    running = adm.arrive("running")
    bulk = [adm.arrive(f"bulk{i}", Priority.BULK) for i in range(2)]
    inter = [adm.arrive(f"inter{i}", Priority.INTERACTIVE) for i in range(2)]
    assert [t.position for t in bulk] == [1, 2]
    assert [t.position for t in inter] == [1, 2]  # ahead of every bulk request
    position = adm.position(bulk[0])
    assert position is not None and position.position == 3
    order = []
    adm.leave(running)
    for _ in range(4):
        (ticket,) = adm.admit_waiting()
        order.append(ticket.item)
        adm.leave(ticket)
    assert order == ["inter0", "inter1", "bulk0", "bulk1"]


def test_a_new_arrival_never_jumps_a_queue_of_its_own_priority() -> None:
    room = [0]
    adm: Admission[str] = Admission(
        max_streams=10, queue_limit=10, capacity=lambda: 10, starts=lambda: room[0]
    )
    first = adm.arrive("first")
    assert first.queued
    room[0] = 5
    later = adm.arrive("later")
    assert later.queued and later.position == 2  # room now, but "first" waits ahead of it
    assert [t.item for t in adm.admit_waiting()] == ["first", "later"]


def test_max_wait_refuses_at_once_when_the_expected_wait_is_longer() -> None:
    clock = Clock()
    adm: Admission[str] = Admission(max_streams=1, queue_limit=10, clock=clock, lifetime_s=4.0)
    adm.arrive("running")
    with pytest.raises(Overloaded) as refused:
        adm.arrive("impatient", max_wait_s=1.0)  # expected: one stream's life, 4 s
    assert refused.value.retry_after_s == pytest.approx(4.0)
    with pytest.raises(Overloaded):
        adm.arrive("now or never", max_wait_s=0.0)
    patient = adm.arrive("patient", max_wait_s=10.0)
    assert patient.queued and patient.expected_wait_s == pytest.approx(4.0)
    assert adm.figures().refused["max_wait"] == 2


def test_no_wait_at_all_is_refused_when_there_is_no_room_even_where_the_queue_moves_at_once() -> None:
    room = [0]
    adm: Admission[str] = Admission(
        max_streams=10, queue_limit=10, capacity=lambda: 10, starts=lambda: room[0], clock=Clock()
    )
    adm.arrive("a"), adm.arrive("b")
    room[0] = 5
    assert len(adm.admit_waiting()) == 2  # one round: the measured interval between admissions is 0
    room[0] = 0
    with pytest.raises(Overloaded):
        adm.arrive("now or never", max_wait_s=0.0)
    assert adm.queued == 0 and adm.figures().refused["max_wait"] == 1


def test_a_queued_request_expires_when_its_max_wait_passes() -> None:
    clock = Clock()
    adm: Admission[str] = Admission(max_streams=1, queue_limit=10, clock=clock, lifetime_s=1.0)
    adm.arrive("running")
    waiting = adm.arrive("waiting", max_wait_s=2.0)
    forever = adm.arrive("forever")
    assert adm.next_expiry() == 2.0
    clock.now = 1.9
    assert adm.expire() == []
    clock.now = 2.0
    assert adm.expire() == [waiting]
    assert waiting.done and adm.queued == 1 and adm.position(forever) is not None
    assert adm.figures().refused["wait_expired"] == 1
    assert adm.expired_error(waiting).retry_after_s >= 0.5


def test_cancelled_while_queued_leaves_the_queue_without_a_refusal() -> None:
    adm: Admission[str] = Admission(max_streams=1, queue_limit=10)
    adm.arrive("running")
    queued = adm.arrive("queued")
    adm.leave(queued)
    assert adm.queued == 0 and adm.position(queued) is None
    assert sum(adm.figures().refused.values()) == 0


def test_waits_are_counted_in_the_histogram_and_the_window() -> None:
    clock = Clock()
    adm: Admission[str] = Admission(max_streams=1, queue_limit=10, clock=clock)
    running = adm.arrive("running")
    queued = [adm.arrive(f"q{i}") for i in range(3)]
    for i in range(3):
        clock.now = 0.3 * (i + 1)
        adm.leave(running)
        (running,) = adm.admit_waiting()
    assert [t.waited_s for t in queued] == pytest.approx([0.3, 0.6, 0.9])
    figures = adm.figures()
    assert figures.admitted_total == 4 and figures.queued_total == 3
    assert figures.wait_sum_s == pytest.approx(1.8)
    assert figures.wait_bounds_s == QUEUE_WAIT_BOUNDS_S
    assert figures.wait_counts[-1] == 3  # the total
    below_half_s = figures.wait_counts[QUEUE_WAIT_BOUNDS_S.index(0.5)]
    assert below_half_s == 1
    assert figures.wait_p50_s == pytest.approx(0.6) and figures.wait_p90_s == pytest.approx(0.9)
    # the interval between admissions from the queue sets the next expected wait
    late = adm.arrive("late")
    assert late.expected_wait_s == pytest.approx(0.3)
    clock.now = 100.0  # the window forgets, the histogram does not
    figures = adm.figures()
    assert figures.wait_p50_s is None and figures.wait_counts[-1] == 3


def test_two_admissions_in_series_report_both_queues_and_the_second_ones_streams() -> None:
    clock = Clock()
    first: Admission[str] = Admission(max_streams=1, queue_limit=1, clock=clock)
    then: Admission[str] = Admission(max_streams=4, queue_limit=3, clock=clock)
    admitted = first.arrive("a")
    then.arrive("a")
    waiting = first.arrive("b")
    with pytest.raises(Overloaded):
        first.arrive("c")
    clock.now = 2.0
    first.leave(admitted)
    assert first.admit_waiting() == [waiting]  # waited 2 s in the first queue
    then.arrive("b")
    then.arrive("off, past the first")
    figures = in_series(first.figures(), then.figures())
    assert (figures.admitted, figures.capacity, figures.max_streams) == (3, 4, 4)
    assert (figures.queued, figures.queue_limit, figures.queued_total) == (0, 4, 1)
    assert figures.refused == {"queue_full": 1, "max_wait": 0, "wait_expired": 0}
    assert figures.wait_counts[-1] == 1 and figures.wait_sum_s == pytest.approx(2.0)
    assert figures.wait_p50_s == pytest.approx(2.0)
