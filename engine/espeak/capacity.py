"""What eSpeak's one worker thread keeps in real time, measured as it runs (engine.admission).

The worker serves the streams with text one sentence at a time, so n streams each get one n-th
of it: they stay ahead of real time while n times the engine-seconds one second of audio costs
stays below one. That share is measured per window of synthesis, against the streams that were
generating in it (the cost per audio-second rises with them: the gateway and its clients share
the cores), and admission keeps it within `headroom`. A first sentence goes before the next
sentences of running streams, and first sentences one after another: a new stream's first audio
waits for those queued before it, so `starts` bounds how many may wait at once.
"""

from __future__ import annotations

import math

from engine.admission import LoadCurve

HEADROOM = 0.6  # the worker's predicted share of real time for the admitted streams
TTFA_TARGET_S = 0.15  # a new stream's first audio, from its admission
WINDOW_S = 0.25  # synthesis time folded into one measurement at most
WINDOW_PIECES = 8  # sentences folded into one measurement at most
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it runs all the way back home again."
)


class EspeakCapacity:
    def __init__(
        self, headroom: float = HEADROOM, ttfa_target_s: float = TTFA_TARGET_S, window_s: float = WINDOW_S
    ) -> None:
        self.headroom = headroom
        self.ttfa_target_s = ttfa_target_s
        self.window_s = window_s
        # by streams generating: their share of real time (n x engine-seconds per audio-second).
        # The share grows in proportion to n (one thread, serial work) but for the contention
        # measured: the reach past the largest measured batch is wide
        self.curve = LoadCurve(probe_factor=1.5, probe_rows=16)
        self.uncontended_cost: float | None = None  # engine-seconds per audio-second, alone
        self.first_piece_s: float | None = None  # running mean of a first sentence's synthesis
        self._synth_s = self._audio_s = self._streams_s = 0.0
        self._pieces = 0

    def calibrate(self, synth_s: float, audio_s: float) -> None:
        """One sentence synthesised alone at start-up: the prior before any load."""
        if audio_s <= 0 or synth_s <= 0:
            return
        self.uncontended_cost = synth_s / audio_s
        self.curve.observe(1, self.uncontended_cost)
        self.first_piece_s = synth_s

    def piece(self, synth_s: float, audio_s: float, streams: int, first: bool) -> None:
        """A sentence took `synth_s` for `audio_s` of audio while `streams` streams had text."""
        if first:
            self.first_piece_s = (
                synth_s
                if self.first_piece_s is None
                else self.first_piece_s + 0.2 * (synth_s - self.first_piece_s)
            )
        self._synth_s += synth_s
        self._audio_s += audio_s
        self._streams_s += streams * synth_s
        self._pieces += 1
        if (self._synth_s >= self.window_s or self._pieces >= WINDOW_PIECES) and self._audio_s > 0:
            streams_mean = self._streams_s / self._synth_s if self._synth_s > 0 else float(streams)
            self.curve.observe(max(1, round(streams_mean)), streams_mean * self._synth_s / self._audio_s)
            self._synth_s = self._audio_s = self._streams_s = 0.0
            self._pieces = 0

    def auto_max_streams(self) -> int:
        """The upper bound when none is given: streams the worker could keep real time alone."""
        if not self.uncontended_cost:
            return 256
        return max(1, math.floor(1.0 / self.uncontended_cost))

    def capacity(self, max_streams: int) -> int:
        return self.curve.rows_within(self.headroom, max_streams)

    def starts(self, first_pieces_waiting: int) -> int:
        """New streams that may start now with their first audio within the target."""
        least = 0 if first_pieces_waiting else 1  # one may always start: the worker serves it next
        if not self.first_piece_s:
            return 1 << 30
        return max(least, math.floor(self.ttfa_target_s / self.first_piece_s) - 1 - first_pieces_waiting)
