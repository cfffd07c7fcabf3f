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

LATE_BEHIND_BUFFER_S = 0.15  # the benchmark's client buffer (shared bench definition of underrun)


class DeliveryLeads:
    """Chunk leads and each finished stream's smallest lead, over a sliding window."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._chunks: deque[tuple[float, float]] = deque()  # (handed out at, lead s)
        self._streams: deque[tuple[float, float]] = deque()  # (finished at, smallest lead s)

    def chunk(self, now: float, lead_s: float) -> None:
        self._chunks.append((now, lead_s))

    def stream_done(self, now: float, min_lead_s: float) -> None:
        """A stream that produced more than one chunk ended; min_lead_s is its smallest lead."""
        if math.isfinite(min_lead_s):
            self._streams.append((now, min_lead_s))

    def snapshot(self, now: float) -> dict[str, float]:
        horizon = now - self.window_s
        for q in (self._chunks, self._streams):
            while q and q[0][0] < horizon:
                q.popleft()
        out: dict[str, float] = {}
        chunks = sorted(lead for _, lead in self._chunks)
        if chunks:
            out["lead_chunk_p1_ms"] = 1000 * _quantile(chunks, 0.01)
            out["lead_chunk_p10_ms"] = 1000 * _quantile(chunks, 0.10)
            out["lead_chunk_p50_ms"] = 1000 * _quantile(chunks, 0.50)
            out["lead_late_chunks_pct"] = 100 * sum(1 for v in chunks if v < 0) / len(chunks)
        streams = sorted(lead for _, lead in self._streams)
        if streams:
            out["lead_stream_min_p10_ms"] = 1000 * _quantile(streams, 0.10)
            late = sum(1 for v in streams if v < -LATE_BEHIND_BUFFER_S)
            out["lead_streams_late_behind_buffer_pct"] = 100 * late / len(streams)
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
