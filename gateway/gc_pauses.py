"""The cyclic garbage collector's pauses in this process, for /metrics.

A collection stops the event loop, and with it every packet in flight, for as long as it runs; at
hundreds of streams a full one over the sessions' objects can last long enough to run a listener's
buffer dry. Each pause is timed by a `gc.callbacks` hook and kept for a window, so the longest
recent one can be read at any time.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any

Observer = Callable[[int, float], None]  # (generation, seconds)


class GcPauses:
    def __init__(self, observe: Observer | None = None, window_s: float = 60.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.observe = observe
        self.window_s = window_s
        self.clock = clock
        self._started: float | None = None
        self._recent: deque[tuple[float, float]] = deque()  # (ended at, seconds) within the window

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
        self._recent.append((now, pause))
        self._forget(now)
        if self.observe is not None:
            self.observe(int(info.get("generation", -1)), pause)

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def longest_s(self) -> float:
        """The longest pause that ended within the window (0 when none did)."""
        self._forget(self.clock())
        return max((pause for _, pause in self._recent), default=0.0)
