"""The pacer of one event loop: it pumps every session with news once per loop pass, and wakes
the sessions whose paced audio falls due with one shared timer (gateway.session's writer path).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import weakref
from typing import ClassVar, Final, Protocol

from gateway.metrics import GatewayMetrics

log = logging.getLogger("cadence.session")

CLOCK_SLACK_S: Final = 0.001  # the loop clock's granularity (1 ms under uvloop)


class PacedSession(Protocol):
    """What the pacer needs of a session (gateway.session.Session)."""

    session_id: str
    metrics: GatewayMetrics
    pacing_tick_s: float  # its grid of paced sends (GatewayConfig.pacing_tick_ms)
    paced_tick: float | None  # the tick it waits for

    def pump(self) -> int: ...


class Pacer:
    """Shared by the sessions of one event loop: sessions with news are pumped once per loop pass,
    in the order the news came; paced audio waits on ONE timer, on a grid of `pacing_tick_ms`
    (GatewayConfig: paced audio, an engine ahead of real time, goes at most that often), and every
    session whose audio is due by a tick is pumped at that tick."""

    _of_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Pacer]] = (
        weakref.WeakKeyDictionary()
    )

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Pacer:
        pacer = cls._of_loop.get(loop)
        if pacer is None:
            pacer = cls._of_loop[loop] = cls(loop)
        return pacer

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._news: dict[PacedSession, None] = {}  # insertion-ordered set
        self._pass_scheduled = False
        self._due: list[tuple[float, int, PacedSession]] = []  # (tick, tie-break, session), a heap
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def pump_soon(self, session: PacedSession) -> None:
        self._news[session] = None
        if not self._pass_scheduled:
            self._pass_scheduled = True
            self._loop.call_soon(self._pump_news)

    def wake_at(self, session: PacedSession, due: float) -> float:
        """Pump `session` at the first tick at or after `due` (loop time); returns that tick."""
        grid = session.pacing_tick_s
        tick = math.ceil(due / grid) * grid
        heapq.heappush(self._due, (tick, next(self._order), session))
        if tick < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(tick, self._tick), tick
        return tick

    def _tick(self) -> None:
        self._timer, self._timer_at = None, math.inf
        horizon = self._loop.time() + CLOCK_SLACK_S
        while self._due and self._due[0][0] <= horizon:
            session = heapq.heappop(self._due)[2]
            session.paced_tick = None
            self._news[session] = None
        if self._due:
            tick = self._due[0][0]
            self._timer, self._timer_at = self._loop.call_at(tick, self._tick), tick
        self._pump_news()

    def _pump_news(self) -> None:
        self._pass_scheduled = False
        news, self._news = self._news, {}
        sent: dict[GatewayMetrics, int] = {}  # packets, counted once per pass
        for session in news:
            try:
                packets = session.pump()
            except Exception:  # one session's failure must not stall the others
                log.exception("session %s: pump failed", session.session_id)
                continue
            if packets:
                sent[session.metrics] = sent.get(session.metrics, 0) + packets
        for metrics, packets in sent.items():
            metrics.packets.inc(packets)
