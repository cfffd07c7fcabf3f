"""Admission by measured cost, shared by every engine (plain Python: no torch, no I/O, no lock).

An engine measures what its work costs by batch shape while it runs (`LoadCurve`: a step's time
by the rows in it, or the share of real time n streams take) and tells `Admission` how many
streams that cost admits now (`capacity`) and how many more may start at once without a new
one's first audio passing its target (`starts`). `Admission` admits an arriving request while
both allow it; otherwise the request waits in a bounded queue, FIFO within priority, and learns
its position and expected wait at once; past the queue's bound, or when the caller's own
`max_wait_s` would pass, it is refused (Overloaded, with a Retry-After). Admitted streams are
never taken back: a later arrival waits instead of slowing them down.

Not thread-safe: each engine calls it under its own lock (or on its event loop), and the
callbacks it is given must not take that lock again.
"""

from __future__ import annotations

import asyncio
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from engine.api import AdmissionFigures, Overloaded, Priority, QueuePosition

T = TypeVar("T")

QUEUE_WAIT_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REFUSAL_REASONS = ("queue_full", "max_wait", "wait_expired")
BUCKETS_PER_OCTAVE = 4


class LoadCurve:
    """A cost measured by batch shape: per bucket of row counts (four per octave), the running
    mean of the rows observed there and a running estimate of the cost that rises fast and falls
    slowly (`rise`, `fall`): a batch of one size costs more when more of its streams are young
    (a step with many first chunks), and admission must hold through such waves, not on average.
    Where a smaller batch costs more than a larger one, the larger is held at the smaller's cost
    (noise must not make a larger batch look cheaper), unless the two were last observed an eighth
    of `memory` observations or more apart: then the smaller is passed over. A ramp's costly first
    steps, never measured again once load has moved past them, must not cap the batches measured
    since; nor may a drain's last steps, measured once load has left the larger batches (a costly
    step of a few rows, its cost not theirs), cap what those batches cost when they ran: admission
    pinned below them would never measure them again. A bucket above every one measured in the
    last `memory` observations is forgotten: the cost there is measured again when load comes
    back, instead of holding admission below it forever.

    `predict(rows)` interpolates between the buckets of that curve; past the largest batch measured
    it goes on along the steeper of the last segment and the mean slope, but only out to `reach()` (a
    quarter further, at least `probe_rows` more): a cost never measured near there is not
    predicted, so capacity grows as load shows what larger batches cost, a step at a time."""

    def __init__(
        self,
        rise: float = 0.1,
        fall: float = 0.05,
        probe_factor: float = 1.25,
        probe_rows: int = 8,
        memory: int = 400,
    ) -> None:
        self.rise, self.fall = rise, fall
        self.memory = memory
        self.probe_factor = probe_factor
        self.probe_rows = probe_rows
        self._points: dict[int, list[float]] = {}  # bucket -> [mean rows, cost, last observation]
        self._curve: list[tuple[float, float]] | None = None  # (rows, cost), rising in both
        self._xs: list[float] = []  # the curve's rows
        self._within: dict[tuple[float, int], int] = {}  # rows_within's answers for this curve
        self.samples = 0

    def observe(self, rows: int, cost: float) -> None:
        if rows < 1 or not math.isfinite(cost) or cost < 0:
            return
        key = round(BUCKETS_PER_OCTAVE * math.log2(rows))
        self.samples += 1
        point = self._points.get(key)
        if point is None:
            self._points[key] = [float(rows), cost, self.samples]
        else:
            point[0] += 0.1 * (rows - point[0])
            point[1] += (self.rise if cost > point[1] else self.fall) * (cost - point[1])
            point[2] = self.samples
        if self.samples % 64 == 0:
            self._forget_stale()
        self._curve = None
        self._within.clear()

    def _forget_stale(self) -> None:
        recent = [k for k, p in self._points.items() if self.samples - p[2] <= self.memory]
        if recent:
            top = max(recent)
            for key in [k for k in self._points if k > top]:
                del self._points[key]

    def curve(self) -> list[tuple[float, float]]:
        """The buckets' (rows, cost), by rows, the cost made non-decreasing (see the class)."""
        if self._curve is None:
            # (rows, cost, when the bucket whose cost this is was last observed)
            kept: list[tuple[float, float, float]] = []
            superseded = max(1, self.memory // 8)
            for rows, cost, last in sorted(tuple(p) for p in self._points.values()):
                while kept and kept[-1][1] > cost and abs(last - kept[-1][2]) >= superseded:
                    kept.pop()  # a costlier smaller batch measured at another time: passed over
                if kept and kept[-1][1] > cost:
                    cost, last = kept[-1][1], kept[-1][2]  # held at the smaller batch's cost
                kept.append((rows, cost, last))
            self._curve = [(rows, cost) for rows, cost, _ in kept]
            self._xs = [rows for rows, _, _ in kept]
        return self._curve

    def largest_rows(self) -> float:
        curve = self.curve()
        return curve[-1][0] if curve else 0.0

    def reach(self) -> float:
        """The largest batch the curve predicts a cost for."""
        largest = self.largest_rows()
        return max(largest * self.probe_factor, largest + self.probe_rows) if largest else 0.0

    def predict(self, rows: float) -> float | None:
        curve = self.curve()
        if not curve or rows > self.reach():
            return None
        xs = self._xs
        i = bisect_left(xs, rows)
        if i < len(curve) and xs[i] == rows:
            return curve[i][1]
        if i == 0:
            return curve[0][1]
        if i < len(curve):
            (r0, c0), (r1, c1) = curve[i - 1], curve[i]
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
        last_rows, last_cost = curve[-1]
        if len(curve) == 1:
            slope = last_cost / last_rows  # one point: as if the cost grew in proportion
        else:
            (r0, c0), (r1, c1) = curve[-2], curve[-1]
            slope = max((c1 - c0) / (r1 - r0), (c1 - curve[0][1]) / (r1 - curve[0][0]), 0.0)
        return last_cost + slope * (rows - last_rows)

    def rows_within(self, limit: float, upper: int) -> int:
        """The largest row count, at most `upper`, whose predicted cost is within `limit` (0 when
        none is: nothing measured yet, or even one row costs more)."""
        key = (limit, upper)
        known = self._within.get(key)
        if known is not None:
            return known
        top = min(upper, math.floor(self.reach()))
        lo, hi = 0, top
        while lo < hi:  # predict() is non-decreasing in rows
            mid = (lo + hi + 1) // 2
            cost = self.predict(mid)
            if cost is not None and cost <= limit:
                lo = mid
            else:
                hi = mid - 1
        self._within[key] = lo
        return lo


@dataclass(eq=False)
class Ticket(Generic[T]):
    """One request before and after admission."""

    item: T
    priority: Priority
    max_wait_s: float | None
    arrived_at: float
    position: int = 0  # where it joined the queue (1: next); 0: admitted at once
    expected_wait_s: float = 0.0  # as told at arrival
    admitted_at: float | None = None
    done: bool = False  # left (finished, cancelled, expired)

    @property
    def queued(self) -> bool:
        return self.admitted_at is None and not self.done

    @property
    def waited_s(self) -> float:
        return 0.0 if self.admitted_at is None else self.admitted_at - self.arrived_at


@dataclass
class _Counts:
    admitted_total: int = 0
    queued_total: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    wait_counts: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_WAIT_BOUNDS_S) + 1))
    wait_sum_s: float = 0.0


class Admission(Generic[T]):
    """Admitted streams, the bounded queue before them, and what admission did (see the module)."""

    def __init__(
        self,
        max_streams: int,
        queue_limit: int,
        capacity: Callable[[], int] | None = None,
        starts: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_floor_s: float = 0.5,
        lifetime_s: float = 5.0,
        window_s: float = 60.0,
    ) -> None:
        self.max_streams = max(1, max_streams)
        self.queue_limit = max(0, queue_limit)
        # streams the measured cost admits now; None: max_streams
        self._capacity = capacity
        # how many more may start now and still get first audio in time; None: no such limit
        self._starts = starts
        self.clock = clock
        self.retry_floor_s = retry_floor_s
        self.window_s = window_s
        self.admitted: set[Ticket[T]] = set()
        self._queues: dict[Priority, deque[Ticket[T]]] = {p: deque() for p in Priority}
        self._counts = _Counts()
        self._lifetime_prior_s = lifetime_s  # an admitted stream's life, before one is measured
        self._lifetime_s: float | None = None  # running mean of an admitted stream's life
        self._interval_s: float | None = None  # running mean between two admissions from the queue
        self._last_from_queue: float | None = None
        self._waits: deque[tuple[float, float]] = deque()  # (admitted at, waited) over the window
        # the one expiry timer armed (arm_expiry): its loop, when it fires (clock time), its handle
        self._expiry_timer: tuple[asyncio.AbstractEventLoop, float, asyncio.TimerHandle] | None = None

    # -- the engine's view -------------------------------------------------------------------------
    def capacity(self) -> int:
        cost = self.max_streams if self._capacity is None else self._capacity()
        return max(1, min(self.max_streams, cost))

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued_tickets(self) -> list[Ticket[T]]:
        return [t for p in Priority for t in self._queues[p]]

    def _room(self) -> int:
        room = self.capacity() - len(self.admitted)
        if self._starts is not None:
            room = min(room, self._starts())
        return room

    # -- arrivals and departures ---------------------------------------------------------------------
    def arrive(
        self, item: T, priority: Priority = Priority.INTERACTIVE, max_wait_s: float | None = None
    ) -> Ticket[T]:
        """Admit `item` now (ticket.admitted_at is set), queue it (ticket.position and
        expected_wait_s say where and for how long), or raise Overloaded."""
        now = self.clock()
        ticket = Ticket(item, priority, max_wait_s, now)
        position = self._position_of(priority, len(self._queues[priority]))
        if position == 1 and self._room() > 0:  # nobody of its priority or above waits
            self._admit(ticket, now)
            return ticket
        wait = self._expected_wait(position)
        if self.queued >= self.queue_limit:
            self._refuse("queue_full")
            raise Overloaded(
                f"engine at capacity ({len(self.admitted)} streams) and its queue is full",
                retry_after_s=max(self.retry_floor_s, self._expected_wait(self.queued + 1)),
            )
        if max_wait_s is not None and (wait > max_wait_s or max_wait_s <= 0):  # 0: now or never
            self._refuse("max_wait")
            raise Overloaded(
                f"engine at capacity: the expected wait ({wait:.1f} s) is longer than max_wait_ms",
                retry_after_s=max(self.retry_floor_s, wait),
            )
        ticket.position = position
        ticket.expected_wait_s = wait
        self._queues[priority].append(ticket)
        return ticket

    def leave(self, ticket: Ticket[T]) -> None:
        """An admitted stream finished, or a queued one was cancelled (no refusal counted).
        Admitting others into the room it leaves is `admit_waiting`'s."""
        if ticket.done:
            return
        ticket.done = True
        if ticket in self.admitted:
            self.admitted.discard(ticket)
            assert ticket.admitted_at is not None
            life = self.clock() - ticket.admitted_at
            mean = self._lifetime_s
            self._lifetime_s = life if mean is None else mean + 0.1 * (life - mean)
        else:
            queue = self._queues[ticket.priority]
            if ticket in queue:
                queue.remove(ticket)

    def admit_waiting(self) -> list[Ticket[T]]:
        """Admit queued requests while the room allows, interactive first, FIFO within a priority."""
        if not self.queued:
            return []
        out: list[Ticket[T]] = []
        room = self._room()
        now = self.clock()
        for priority in Priority:
            queue = self._queues[priority]
            while queue and room > 0:
                ticket = queue.popleft()
                self._admit(ticket, now)
                out.append(ticket)
                room -= 1
        return out

    def expire(self) -> list[Ticket[T]]:
        """Queued requests whose own max wait has passed: removed and counted as refused; the
        engine fails each one with `expired_error()`."""
        now = self.clock()
        out: list[Ticket[T]] = []
        for queue in self._queues.values():
            for ticket in [
                t for t in queue if t.max_wait_s is not None and now >= t.arrived_at + t.max_wait_s
            ]:
                queue.remove(ticket)
                ticket.done = True
                self._refuse("wait_expired")
                out.append(ticket)
        return out

    def expired_error(self, ticket: Ticket[T]) -> Overloaded:
        position = self.queued + 1
        return Overloaded(
            "engine at capacity: still queued when max_wait_ms passed",
            retry_after_s=max(self.retry_floor_s, self._expected_wait(position)),
        )

    def until_expiry(self) -> float | None:
        """Seconds until `next_expiry` (0 when it has passed), or None."""
        at = self.next_expiry()
        return None if at is None else max(0.0, at - self.clock())

    def arm_expiry(self, loop: asyncio.AbstractEventLoop | None, expire: Callable[[], None]) -> None:
        """For an engine on an event loop: `expire` runs once the first queued request's max wait
        has passed (a timer may fire early: `expire` arms the next one)."""
        at = self.next_expiry()
        if at is None or loop is None:
            return
        armed = self._expiry_timer
        if armed is not None and armed[0] is loop and not loop.is_closed():
            if armed[1] <= at:
                return  # the timer armed already fires by then: one more would run every pass twice
            armed[2].cancel()

        def fire() -> None:
            self._expiry_timer = None
            expire()

        handle = loop.call_later(max(0.0, at - self.clock()) + 0.001, fire)
        self._expiry_timer = (loop, at, handle)

    def next_expiry(self) -> float | None:
        """When the first queued request's max wait passes (clock time), or None."""
        times = [
            t.arrived_at + t.max_wait_s for q in self._queues.values() for t in q if t.max_wait_s is not None
        ]
        return min(times, default=None)

    def position(self, ticket: Ticket[T]) -> QueuePosition | None:
        """Where a queued request stands now; None once admitted or gone."""
        if not ticket.queued:
            return None
        queue = self._queues[ticket.priority]
        try:
            index = queue.index(ticket)
        except ValueError:
            return None
        position = self._position_of(ticket.priority, index)
        return QueuePosition(position, self._expected_wait(position))

    # -- figures ----------------------------------------------------------------------------------------
    def figures(self) -> AdmissionFigures:
        counts = self._counts
        horizon = self.clock() - self.window_s
        while self._waits and self._waits[0][0] < horizon:
            self._waits.popleft()
        waits = sorted(w for _, w in self._waits)
        cumulative, total = [], 0
        for n in counts.wait_counts:
            total += n
            cumulative.append(total)
        return AdmissionFigures(
            capacity=self.capacity(),
            max_streams=self.max_streams,
            admitted=len(self.admitted),
            queued=self.queued,
            queue_limit=self.queue_limit,
            admitted_total=counts.admitted_total,
            queued_total=counts.queued_total,
            refused=dict(counts.refused),
            wait_bounds_s=QUEUE_WAIT_BOUNDS_S,
            wait_counts=tuple(cumulative),
            wait_sum_s=counts.wait_sum_s,
            wait_p50_s=_quantile(waits, 0.5),
            wait_p90_s=_quantile(waits, 0.9),
        )

    # -- internals ----------------------------------------------------------------------------------------
    def _admit(self, ticket: Ticket[T], now: float) -> None:
        ticket.admitted_at = now
        self.admitted.add(ticket)
        self._counts.admitted_total += 1
        if ticket.position:  # it waited in the queue
            waited = now - ticket.arrived_at
            counts = self._counts
            counts.queued_total += 1
            counts.wait_sum_s += waited
            counts.wait_counts[bisect_left(QUEUE_WAIT_BOUNDS_S, waited)] += 1
            self._waits.append((now, waited))
            if self._last_from_queue is not None:
                gap = now - self._last_from_queue
                self._interval_s = (
                    gap if self._interval_s is None else self._interval_s + 0.1 * (gap - self._interval_s)
                )
            self._last_from_queue = now if self.queued > 0 else None

    def _refuse(self, reason: str) -> None:
        self._counts.refused[reason] = self._counts.refused.get(reason, 0) + 1

    def _position_of(self, priority: Priority, index: int) -> int:
        """1-based place in service order of the `index`-th request of `priority`'s queue."""
        return sum(len(self._queues[p]) for p in Priority if p < priority) + index + 1

    def _expected_wait(self, position: int) -> float:
        """Until the request at `position` is admitted: that many times the measured interval
        between admissions from the queue, or, before there is one, between two streams leaving
        (an admitted stream's mean life over the capacity)."""
        interval = self._interval_s
        if interval is None:
            life = self._lifetime_prior_s if self._lifetime_s is None else self._lifetime_s
            interval = life / self.capacity()
        return position * interval


def in_series(first: AdmissionFigures, then: AdmissionFigures) -> AdmissionFigures:
    """One engine's figures from two admissions a request passes in turn (an aligner's, then the
    wrapped engine's): the streams, capacity and bound of the second, which every stream reaches;
    the queues, refusals and waits of both."""
    waits = [w for w in (first.wait_p50_s, then.wait_p50_s) if w is not None]
    tails = [w for w in (first.wait_p90_s, then.wait_p90_s) if w is not None]
    reasons = dict.fromkeys([*first.refused, *then.refused])
    counts, wait_sum = then.wait_counts, then.wait_sum_s
    if first.wait_bounds_s == then.wait_bounds_s:
        counts = tuple(a + b for a, b in zip(first.wait_counts, then.wait_counts, strict=True))
        wait_sum += first.wait_sum_s
    return replace(
        then,
        queued=first.queued + then.queued,
        queue_limit=first.queue_limit + then.queue_limit,
        queued_total=first.queued_total + then.queued_total,
        refused={r: first.refused.get(r, 0) + then.refused.get(r, 0) for r in reasons},
        wait_counts=counts,
        wait_sum_s=wait_sum,
        wait_p50_s=max(waits, default=None),
        wait_p90_s=max(tails, default=None),
    )


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
