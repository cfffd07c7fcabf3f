"""Forced word times, the aligner's counterpart of the benchmark's forced lengths.

With random weights (the benchmark's checkpoints) an aligner's times are noise that moves as the
audio grows, so sync mode's probes never confirm a word and every sync stream waits for whole
segments: the benchmark would measure a model no one deploys. `ForcedTimesAligner` runs the wrapped
aligner as always (its compute, batching and failures unchanged) and then gives each unit the time
a voice speaking at the benchmark's rate would give it: the shared benchmark definition's 14
characters a second, 4.5 for CJK ideographs, the rates the corpus's forced lengths come from. Units
past the audio's end sit at its end, as a forced aligner places the text the audio does not hold
yet. Times are not rounded to the model's 80 ms slots: a trained model's slot for a word follows the
sound, wherever its window starts, while a time computed from the characters after a window's
start would move with that start's rounding, and two probes over different windows would disagree
where a trained model agrees. A benchmark mode (`cadence serve --aligner-forced-times`), never a
deployment's: the times describe the text, not the audio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.alignment.api import AlignedWord, Aligner, AlignerCall, AlignInput, split_calls

CHARS_PER_S = 14.0  # the benchmark's speech rate: English and other alphabetic text
IDEOGRAPHS_PER_S = 4.5  # Chinese, Japanese kanji


def _is_ideograph(ch: str) -> bool:
    code = ord(ch)
    return 0x3400 <= code <= 0x9FFF or 0xF900 <= code <= 0xFAFF or 0x20000 <= code <= 0x2FA1F


def speech_offsets(text: str) -> list[float]:
    """Seconds from the text's start to each character (and, last, to its end) at the benchmark's rate."""
    out, at = [0.0], 0.0
    for ch in text:
        at += 1.0 / (IDEOGRAPHS_PER_S if _is_ideograph(ch) else CHARS_PER_S)
        out.append(at)
    return out


def forced_words(words: Sequence[AlignedWord], text: str, audio_s: float) -> list[AlignedWord]:
    """The aligner's units of `text` with their times at the benchmark's rate, within `audio_s`."""
    offsets = speech_offsets(text)
    out = []
    for w in words:
        start = round(min(audio_s, offsets[w.char_start]), 3)
        stop = round(min(audio_s, max(start, offsets[w.char_end])), 3)
        out.append(AlignedWord(w.text, start, stop, w.char_start, w.char_end))
    return out


@dataclass(slots=True)
class _Forced:
    inner: AlignerCall
    batch: list[AlignInput]

    def ready(self) -> bool:
        return self.inner.ready()

    def wait(self) -> None:
        self.inner.wait()


class ForcedTimesAligner:
    """An aligner whose units get the benchmark's forced times (see the module's docstring); every
    other attribute (warm-up, call phases) is the wrapped aligner's."""

    def __init__(self, inner: Aligner) -> None:
        self.inner = inner
        self._calls = split_calls(inner)

    @property
    def max_audio_s(self) -> float:
        return self.inner.max_audio_s

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        return self._forced(self.inner.align(batch), batch)

    def submit(self, batch: Sequence[AlignInput]) -> AlignerCall:
        return _Forced(self._calls.submit(batch), list(batch))

    def collect(self, call: AlignerCall) -> list[list[AlignedWord]]:
        assert isinstance(call, _Forced)
        return self._forced(self._calls.collect(call.inner), call.batch)

    @staticmethod
    def _forced(aligned: list[list[AlignedWord]], batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        return [
            forced_words(words, text, len(audio) / rate)
            for words, (audio, rate, text, _) in zip(aligned, batch, strict=True)
        ]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
