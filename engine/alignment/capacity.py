"""What the forced aligner's worker keeps up with, measured as it runs (engine.admission; no torch).

Every aligned stream hands the aligner its audio as the wrapped engine makes it: at least in real
time, and faster while the engine has room. The worker aligns whatever is queued as one batch, so
it keeps up while the audio the aligned streams make each second stays within `headroom` of what
it aligns in a second at its largest batch. Two things are measured as it runs:

- what a call costs by the jobs in it (a LoadCurve of call seconds by batch: a call's cost is
  mostly fixed, so a batch of 32 takes far less than 32 of one), and the audio a job holds;
- the audio each aligned stream makes per second (per window of the worker's calls, against the
  aligned streams admitted meanwhile; sync probes count, since they are aligned again; at least
  real time: a stream still waiting for its first audio will speak). Only windows with at least
  half the most streams measured count: with few streams the engine makes each one's audio many
  times faster than under load, and a rate measured while load drains away would hold admission
  far below what the aligner keeps up with once load returns.

Its throughput is predicted at the largest batch the curve reaches (out to `max_batch`), and
capacity reaches at most twice the aligned streams measured so far (at least `initial_streams`),
so it grows as load shows what larger batches cost and how fast streams then make their audio.
Before any call is measured, `initial_streams` are admitted.

Work queued and not yet aligned must not grow without bound: while the backlog, priced at that
throughput, is over `backlog_limit_s`, no new aligned stream starts (the words of those admitted
would fall further behind their audio).

On a GPU the aligner shares with the TTS engine, its kernels also lengthen the engine's steps; the
engine's own step measurement (engine.qwen3.capacity) sees that, so only the aligner's keeping up
is counted here, and the TTS kernels' share of the GPU shows up in the aligner's call times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from engine.admission import LoadCurve

HEADROOM = 0.7  # the aligned streams' audio per second, as a share of what the aligner aligns in one
BACKLOG_LIMIT_S = 1.0  # aligner seconds of queued work beyond which no new aligned stream starts
WINDOW_S = 0.5  # the worker's calls folded into one measurement of the streams' rate at least this long
INITIAL_STREAMS = 64  # admitted before anything is measured
LOADED_SHARE = 0.5  # a window measures the streams' rate with at least this share of the most streams
MAX_BATCH = 64  # the worker's largest batch


class AlignerCapacity:
    def __init__(
        self,
        headroom: float = HEADROOM,
        backlog_limit_s: float = BACKLOG_LIMIT_S,
        window_s: float = WINDOW_S,
        initial_streams: int = INITIAL_STREAMS,
        max_batch: int = MAX_BATCH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.headroom = headroom
        self.backlog_limit_s = backlog_limit_s
        self.window_s = window_s
        self.initial_streams = initial_streams
        self.max_batch = max_batch
        self.clock = clock
        self.calls = LoadCurve(probe_factor=2.0, probe_rows=8)  # a call's seconds by its jobs
        self.job_audio_s: float | None = None  # running mean of the audio in one job, probes included
        self.rate: float | None = None  # running mean: audio aligned per aligned stream per second
        self.cost_per_aligned_s: float | None = None  # running: busy seconds per second aligned
        self.most_streams = 0.0  # the most aligned streams over a window measured
        self._streams = 0
        self._since = self._window_at = clock()
        self._stream_s = self._audio_s = 0.0

    def streams(self, count: int) -> None:
        """The aligned streams admitted now."""
        self._fold()
        if self._streams == 0 and self._audio_s == 0:  # the window so far was idle: it measures nothing
            self._window_at, self._stream_s = self._since, 0.0
        self._streams = count

    def batch(self, busy_s: float, audio_s: float, jobs: int) -> None:
        """One aligner call: `busy_s` for `jobs` jobs holding `audio_s` of audio."""
        if jobs < 1 or audio_s <= 0 or busy_s < 0:
            return
        self.calls.observe(jobs, busy_s)
        self.job_audio_s = _mean(self.job_audio_s, audio_s / jobs, 0.1)
        self.cost_per_aligned_s = _mean(self.cost_per_aligned_s, busy_s / audio_s, 0.1)
        self._fold()
        self._audio_s += audio_s
        span = self._since - self._window_at
        if span >= self.window_s and self._stream_s > 0:
            streams = self._stream_s / span
            self.most_streams = max(self.most_streams, streams)
            if streams >= LOADED_SHARE * self.most_streams:
                self.rate = _mean(self.rate, max(1.0, self._audio_s / self._stream_s), 0.2)
            self._window_at = self._since
            self._stream_s = self._audio_s = 0.0

    def _fold(self) -> None:
        now = self.clock()
        self._stream_s += self._streams * (now - self._since)
        self._since = now

    def throughput(self) -> float | None:
        """Audio seconds aligned per second at the largest batch the measured calls predict."""
        if self.job_audio_s is None:
            return None
        batch = min(self.max_batch, math.floor(self.calls.reach()))
        call_s = self.calls.predict(batch) if batch >= 1 else None
        if call_s is None or call_s <= 0:
            return None
        return batch * self.job_audio_s / call_s

    def capacity(self, upper: int) -> int:
        """Aligned streams whose audio the aligner keeps up with, within the headroom."""
        throughput = self.throughput()
        if throughput is None:
            return min(self.initial_streams, upper)
        reach = max(self.initial_streams, math.floor(2 * self.most_streams))
        return min(upper, reach, math.floor(self.headroom * throughput / (self.rate or 1.0)))

    def share(self, streams: int) -> float:
        """The predicted share of the aligner's throughput `streams` aligned streams take."""
        throughput = self.throughput()
        if streams <= 0 or throughput is None:
            return 0.0
        return streams * (self.rate or 1.0) / throughput

    def backlog_s(self, queued_audio_s: float) -> float:
        """Aligner seconds the queued audio needs (before a throughput is known, at what a second
        has cost so far)."""
        throughput = self.throughput()
        if throughput is None:
            return queued_audio_s * (self.cost_per_aligned_s or 0.0)
        return queued_audio_s / throughput

    def starts(self, queued_audio_s: float) -> int:
        """New aligned streams that may start now: none while the backlog is over its limit."""
        return 0 if self.backlog_s(queued_audio_s) > self.backlog_limit_s else 1 << 30


def _mean(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else mean + weight * (value - mean)
