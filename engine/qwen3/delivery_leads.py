"""How early each Code2Wav chunk reaches the gateway, against the listener's playback clock.

A stream plays from its first audio on, in real time: the chunk that starts at frame `a` is needed
`a` frame periods after the first audio. Its lead is that moment minus the time the engine hands
the chunk out (negative: late). The figures separate lateness made in the engine from lateness
added later (gateway, network, client): a stream whose chunks all had leads above -B in the engine
can only underrun behind a client buffer of B if something after the engine delayed it.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

LATE_BEHIND_BUFFER_S = 0.15  # the benchmark's client buffer (shared bench definition of underrun)


class _Window:
    """Values with the time each came, over a sliding window. Times and values sit in deques of
    floats, so a snapshot copies the values into numpy at C speed: it runs under the scheduler's
    lock, which the step thread needs, over the thousands of chunks of a loaded engine's window."""

    def __init__(self) -> None:
        self.times: deque[float] = deque()
        self.values: deque[float] = deque()

    def add(self, now: float, value: float) -> None:
        self.times.append(now)
        self.values.append(value)

    def sorted_since(self, horizon: float) -> np.ndarray:
        while self.times and self.times[0] < horizon:
            self.times.popleft()
            self.values.popleft()
        return np.sort(np.fromiter(self.values, np.float64, len(self.values)))


class DeliveryLeads:
    """Chunk leads and each finished stream's smallest lead, over a sliding window."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._chunks = _Window()  # handed out at, lead s
        self._streams = _Window()  # finished at, smallest lead s

    def chunk(self, now: float, lead_s: float) -> None:
        self._chunks.add(now, lead_s)

    def stream_done(self, now: float, min_lead_s: float) -> None:
        """A stream that produced more than one chunk ended; min_lead_s is its smallest lead."""
        if math.isfinite(min_lead_s):
            self._streams.add(now, min_lead_s)

    def snapshot(self, now: float) -> dict[str, float]:
        horizon = now - self.window_s
        out: dict[str, float] = {}
        chunks = self._chunks.sorted_since(horizon)
        if len(chunks):
            out["lead_chunk_p1_ms"] = 1000 * _quantile(chunks, 0.01)
            out["lead_chunk_p10_ms"] = 1000 * _quantile(chunks, 0.10)
            out["lead_chunk_p50_ms"] = 1000 * _quantile(chunks, 0.50)
            out["lead_late_chunks_pct"] = 100 * float(np.count_nonzero(chunks < 0)) / len(chunks)
        streams = self._streams.sorted_since(horizon)
        if len(streams):
            out["lead_stream_min_p10_ms"] = 1000 * _quantile(streams, 0.10)
            late = np.count_nonzero(streams < -LATE_BEHIND_BUFFER_S)
            out["lead_streams_late_behind_buffer_pct"] = 100 * float(late) / len(streams)
        return out


def _quantile(sorted_values: np.ndarray, q: float) -> float:
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])
