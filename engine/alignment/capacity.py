"""What the forced aligner's worker keeps in real time, measured as it runs (engine.admission; no torch).

Every aligned stream hands the aligner its audio as the wrapped engine makes it: at least in real
time, and faster while the engine has room. The aligner keeps up while its share of real time for
the aligned streams stays within `headroom`. That share is measured per window of the worker's
calls, against the aligned streams admitted meanwhile: the larger of the time it was busy over the
window's length (the audio as fast as it came) and n times what a second of a stream's audio cost
it (n streams in real time; each second counted once however often sync probes align part of it
again: the probes are part of its price). The LoadCurve holds it by n (a second of audio costs less
as batches grow, and each stream is made more slowly as the engine fills).
Before anything is measured, `initial_streams` are admitted; the curve then predicts out to that
many past the largest n measured, and forgets within `MEMORY_WINDOWS` a costlier n it no longer
sees (a cold start's first windows must not hold admission for minutes).

Work queued and not yet aligned must not grow without bound: while the backlog, priced at what a
second of aligned audio costs, is over `backlog_limit_s`, no new aligned stream starts (the words
of those admitted would fall further behind their audio).

On a GPU the aligner shares with the TTS engine, its kernels also lengthen the engine's steps; the
engine's own step measurement (engine.qwen3.capacity) sees that, so only the aligner's keeping up
is counted here, and the TTS kernels' share of the GPU shows up in the aligner's busy time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.admission import LoadCurve

HEADROOM = 0.7  # the aligner's predicted share of real time for the aligned streams admitted
BACKLOG_LIMIT_S = 1.0  # aligner seconds of queued work beyond which no new aligned stream starts
WINDOW_S = 0.5  # the worker's calls folded into one measurement at least this long
INITIAL_STREAMS = 64  # admitted before anything is measured, and the curve's reach past it
MEMORY_WINDOWS = 16  # the curve's memory, in windows


class AlignerCapacity:
    def __init__(
        self,
        headroom: float = HEADROOM,
        backlog_limit_s: float = BACKLOG_LIMIT_S,
        window_s: float = WINDOW_S,
        initial_streams: int = INITIAL_STREAMS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.headroom = headroom
        self.backlog_limit_s = backlog_limit_s
        self.window_s = window_s
        self.initial_streams = initial_streams
        self.clock = clock
        # by aligned streams: the share of real time the aligner takes for them
        self.curve = LoadCurve(probe_factor=2.0, probe_rows=initial_streams, memory=MEMORY_WINDOWS)
        self.cost_per_audio_s: float | None = None  # last window: busy seconds per stream-audio second
        self.cost_per_aligned_s: float | None = None  # running: per second aligned, probes included
        self._streams = 0
        self._since = self._window_at = clock()
        self._stream_s = self._busy_s = self._fresh_s = 0.0

    def streams(self, count: int) -> None:
        """The aligned streams admitted now."""
        self._fold()
        if self._streams == 0 and self._busy_s == 0:  # the window so far was idle: it measures nothing
            self._window_at, self._stream_s = self._since, 0.0
        self._streams = count

    def batch(self, busy_s: float, audio_s: float, fresh_s: float) -> None:
        """One aligner call: `busy_s` for `audio_s` of audio, of which `fresh_s` the streams' own
        audio that no earlier call held."""
        if audio_s > 0 and busy_s >= 0:
            cost, mean = busy_s / audio_s, self.cost_per_aligned_s
            self.cost_per_aligned_s = cost if mean is None else mean + 0.1 * (cost - mean)
        self._fold()
        self._busy_s += busy_s
        self._fresh_s += fresh_s
        span = self._since - self._window_at
        if span >= self.window_s and self._fresh_s > 0:
            streams = max(1.0, self._stream_s / span)
            self.cost_per_audio_s = self._busy_s / self._fresh_s
            share = max(self._busy_s / span, streams * self.cost_per_audio_s)
            self.curve.observe(max(1, round(streams)), share)
            self._window_at = self._since
            self._stream_s = self._busy_s = self._fresh_s = 0.0

    def _fold(self) -> None:
        now = self.clock()
        self._stream_s += self._streams * (now - self._since)
        self._since = now

    def capacity(self, upper: int) -> int:
        """Aligned streams the measured cost keeps within the headroom."""
        if not self.curve.curve():
            return min(self.initial_streams, upper)
        return self.curve.rows_within(self.headroom, upper)

    def share(self, streams: int) -> float:
        """The predicted share of real time `streams` aligned streams take (0 before a measurement)."""
        if streams <= 0:
            return 0.0
        predicted = self.curve.predict(streams)
        if predicted is None:  # past the curve's reach: in proportion to its largest point
            curve = self.curve.curve()
            return curve[-1][1] * streams / curve[-1][0] if curve else 0.0
        return predicted

    def backlog_s(self, queued_audio_s: float) -> float:
        """Aligner seconds the queued audio needs."""
        return queued_audio_s * (self.cost_per_aligned_s or 0.0)

    def starts(self, queued_audio_s: float) -> int:
        """New aligned streams that may start now: none while the backlog is over its limit."""
        return 0 if self.backlog_s(queued_audio_s) > self.backlog_limit_s else 1 << 30
