"""What the Qwen3 engine's step keeps in real time, measured as it runs (engine.admission; no torch).

A step samples one frame, 80 ms of audio, for every decoding stream, so n streams stay ahead of
real time while a step of n rows takes less than a frame. The scheduler times every step from one
plan to the next (the GPU's work, the host's between, the prompts readied) against the rows it
sampled; admission keeps the step the curve predicts for the admitted streams within `headroom`
of a frame, and within half the first-audio target (a new stream's first audio takes about two
steps: the one running when it comes, then its prompt's). While no step measured is over that,
`initial_streams` are admitted whatever the curve has seen. Prompts wait for the token budget the
decode rows leave: `starts` bounds how many streams may wait for their first audio at once.

Streams whose audio waits for the aligner's words (engine.alignment, "sync") need more than real
time: their audio goes out word by word as probes of each new chunk time it, so a listener holds
only the words released so far until the next chunk's probe. Below about three times real time the
first words' audio runs out before the next release comes (bench/sync_release_sim.py), so
`sync_capacity` is the streams whose step stays within `SYNC_HEADROOM` of a frame, which the aligned
engine's admission holds to while a sync stream holds or awaits a place.
"""

from __future__ import annotations

import math

from engine.admission import LoadCurve

HEADROOM = 0.7  # a step's predicted time for the admitted streams, as a share of a frame's audio
TTFA_TARGET_S = 0.15  # a new stream's first audio, from its admission
INITIAL_STREAMS = 64  # admitted before the steps measured say more or fewer
SYNC_HEADROOM = 1 / 3  # a step's predicted time for sync streams: three frames made a frame's time


class StepCapacity:
    def __init__(
        self,
        frame_s: float,
        headroom: float = HEADROOM,
        ttfa_target_s: float = TTFA_TARGET_S,
        initial_streams: int = INITIAL_STREAMS,
    ) -> None:
        self.frame_s = frame_s
        self.headroom = headroom
        self.ttfa_target_s = ttfa_target_s
        self.initial_streams = initial_streams
        self.curve = LoadCurve(probe_factor=1.1, probe_rows=8)  # step seconds by rows
        self.prompt_positions: float | None = None  # running mean of a new stream's prompt to prefill

    @property
    def limit_s(self) -> float:
        return min(self.headroom * self.frame_s, self.ttfa_target_s / 2)

    def step(self, rows: int, seconds: float) -> None:
        self.curve.observe(rows, seconds)

    def prompt(self, positions: int) -> None:
        if self.prompt_positions is None:
            self.prompt_positions = float(positions)
        else:
            self.prompt_positions += 0.1 * (positions - self.prompt_positions)

    @property
    def sync_limit_s(self) -> float:
        return min(SYNC_HEADROOM * self.frame_s, self.limit_s)

    def capacity(self, upper: int) -> int:
        return self._within(self.limit_s, upper)

    def sync_capacity(self, upper: int) -> int:
        """Streams whose step keeps sync streams' listeners fed (see the module)."""
        return self._within(self.sync_limit_s, upper)

    def _within(self, limit: float, upper: int) -> int:
        measured = self.curve.rows_within(limit, upper)
        if all(cost <= limit for _, cost in self.curve.curve()):
            return max(measured, min(self.initial_streams, upper))
        return measured

    def figures(self, admitted: int, upper: int) -> dict[str, float]:
        """What holds admission where it is: the step limit, and the step the curve predicts for
        one stream more than `admitted` (absent past the curve's reach); and the streams kept at
        the sync streams' pace (`upper` at most)."""
        out = {
            "admission_step_limit_ms": 1000 * self.limit_s,
            "admission_sync_streams": float(self.sync_capacity(upper)),
        }
        predicted = self.curve.predict(admitted + 1)
        if predicted is not None:
            out["admission_step_next_ms"] = 1000 * predicted
        out["admission_curve_reach"] = self.curve.reach()
        return out

    def starts(self, rows: int, waiting_first: int, tokens_per_step: int) -> int:
        """New streams that may start now with first audio within the target: the steps that
        leaves beyond their own, times the prompts a step's spare token budget takes."""
        least = 0 if waiting_first else 1
        step_s = self.curve.predict(rows + 1)
        if step_s is None or step_s <= 0 or self.prompt_positions is None:
            return max(least, 1 << 30)
        steps = self.ttfa_target_s / step_s - 2
        per_step = max(1.0, (tokens_per_step - rows) / max(1.0, self.prompt_positions))
        return max(least, math.floor(steps * per_step) - waiting_first)
