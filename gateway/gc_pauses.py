"""The cyclic garbage collector's pauses in this process, for /metrics.

A collection stops the event loop, and with it every packet in flight, for as long as it runs; at
hundreds of streams a full one over the sessions' objects can last long enough to run a listener's
buffer dry. Each pause is timed by a `gc.callbacks` hook, counted per generation into a histogram
and kept for a window, so the longest recent one can be read at any time.

The hook runs wherever a collection starts, inside any allocation, in any thread, possibly while
that thread holds a lock. So it takes none: it only updates plain lists and a deque (each step
atomic under the GIL), and readers work on copies. (A prometheus_client metric observed from the
hook could deadlock: a scrape copies a metric's children under that metric's lock, and the copy may
start a collection.)
"""

from __future__ import annotations

import bisect
import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

GENERATIONS = 3
BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # upper bounds; then +Inf


class GcPauses:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window_s = window_s
        self.clock = clock
        self._started: float | None = None
        self._recent: deque[tuple[float, float]] = deque()  # (ended at, seconds) within the window
        self._counts = [[0] * (len(BUCKETS_S) + 1) for _ in range(GENERATIONS)]  # per bucket, not cumulative
        self._sums = [0.0] * GENERATIONS

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = self.clock()
        if phase == "start":
            self._started = now
            return
        if self._started is None:
            return
        pause, self._started = now - self._started, None
        generation = min(max(int(info.get("generation", 0)), 0), GENERATIONS - 1)
        self._counts[generation][bisect.bisect_left(BUCKETS_S, pause)] += 1
        self._sums[generation] += pause
        self._recent.append((now, pause))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def longest_s(self) -> float:
        """The longest pause that ended within the window (0 when none did)."""
        since = self.clock() - self.window_s
        return max((pause for ended, pause in list(self._recent) if ended >= since), default=0.0)

    def histograms(self) -> Iterator[tuple[int, list[int], float]]:
        """(generation, cumulative counts per bucket of BUCKETS_S then +Inf, seconds in all) of each
        generation that has paused."""
        for generation in range(GENERATIONS):
            counts, total = list(self._counts[generation]), self._sums[generation]
            if any(counts):
                cumulative, running = [], 0
                for n in counts:
                    running += n
                    cumulative.append(running)
                yield generation, cumulative, total
