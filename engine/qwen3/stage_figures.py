"""Rows and time per stage of the engine's step, for /metrics and the live load panel."""

from __future__ import annotations

import time

import torch

STAGES = ("decode", "prefill", "sample", "codec")
# summed over a step: the gaps between stages, and the Code2Wav graphs' own GPU time (the codec
# stage's time less this is the GPU waiting for the host between its launches)
SUMMED = ("gpu_gaps", "codec_replays")


class StageFigures:
    """Rows and time per stage, as running means over the steps where the stage ran.

    On the GPU a stage is timed by CUDA events around its launches, read once the step's results
    have reached the host (no extra synchronisation); on the CPU by the wall clock.
    """

    def __init__(self, cuda: bool, smoothing: float = 0.1) -> None:
        self.cuda = cuda
        self.smoothing = smoothing
        names = [f"step_ms_{s}" for s in STAGES] + [f"batch_{s}" for s in STAGES]
        names += ["prefill_tokens", "codec_frames", "codec_launches"] + [f"step_ms_{s}" for s in SUMMED]
        self._mean = dict.fromkeys(
            names, 0.0
        )  # every key up front: readers on other threads see a fixed dict
        self._seen: set[str] = set()
        self._open: list[tuple[str, object, object]] = []
        # the stages run on one CUDA stream: the time from one stage's end to the next one's start is
        # the GPU waiting for the host (or running small untimed work: prompt embeddings, copies)
        self.gaps = cuda
        self._last_stop: object = None
        self.steps = 0

    def start(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if self.gaps and self._last_stop is not None:
                self._open.append(("gpu_gaps", self._last_stop, event))
                self._last_stop = None
            return event
        return time.perf_counter()

    def stop(self, stage: str, started: object) -> None:
        ended = self.start()
        self._open.append((stage, started, ended))
        self._last_stop = ended

    def mark(self) -> object:
        """An event inside a stage, for `span` (no effect on the gaps between stages)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self, name: str, started: object) -> None:
        """Add the time since `started` (a mark) to this step's sum `name` (one of SUMMED)."""
        self._open.append((name, started, self.mark()))

    def rows(self, name: str, value: float) -> None:
        self._update(name, value)

    def finish_step(self) -> None:
        """Fold in the stage times whose work is done; work still running on the GPU (Code2Wav
        chunks collected next step) is folded in by a later step, without waiting for it here."""
        running = []
        sums: dict[str, float] = {}  # SUMMED figures resolved now: about one step's worth
        for stage, a, b in self._open:
            if self.cuda:
                if not b.query():  # type: ignore[attr-defined]
                    running.append((stage, a, b))
                    continue
                ms = float(a.elapsed_time(b))  # type: ignore[attr-defined]
            else:
                ms = 1000 * (float(b) - float(a))  # type: ignore[arg-type]
            if stage in SUMMED:
                sums[stage] = sums.get(stage, 0.0) + ms
            else:
                self._update(f"step_ms_{stage}", ms)
        for name, ms in sums.items():
            self._update(f"step_ms_{name}", ms)
        self._open = running
        self.steps += 1

    def _update(self, name: str, value: float) -> None:
        if name not in self._seen:
            self._seen.add(name)
            self._mean[name] = value
        else:
            self._mean[name] += self.smoothing * (value - self._mean[name])

    def snapshot(self) -> dict[str, float]:
        out = dict(self._mean)
        out["steps"] = float(self.steps)
        return out
