"""Deterministic aligners for the stage's tests: real word splitting, times spread over the audio."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from aligner.api import AlignedWord, AlignInput
from aligner.text import UnitSplitter, display_spans


class SpreadAligner:
    """Each unit gets an equal share of the window; records every batch it is given.

    `gate`: when set, the first batch waits on it (so later jobs queue up behind it).
    `fail_on`: a substring; a batch holding a text with it raises (as a real model error would)."""

    def __init__(
        self, max_audio_s: float = 300.0, gate: threading.Event | None = None, fail_on: str | None = None
    ) -> None:
        self._max_audio_s = max_audio_s
        self.splitter = UnitSplitter()
        self.batches: list[list[str]] = []
        self.gate = gate
        self.fail_on = fail_on
        self.entered = threading.Event()

    @property
    def max_audio_s(self) -> float:
        return self._max_audio_s

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        self.batches.append([text for _, _, text, _ in batch])
        self.entered.set()
        if self.gate is not None and len(self.batches) == 1:
            self.gate.wait(10)
        if self.fail_on is not None and any(self.fail_on in text for _, _, text, _ in batch):
            raise RuntimeError("model failure")
        out = []
        for audio, rate, text, language in batch:
            units = self.splitter.units(text, language)
            spans = display_spans(text, units)
            seconds = len(audio) / rate
            share = seconds / max(1, len(spans))
            out.append(
                [
                    AlignedWord(text[a:b], round(i * share, 3), round((i + 0.8) * share, 3), a, b)
                    for i, (a, b) in enumerate(spans)
                ]
            )
        return out
