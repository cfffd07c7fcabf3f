"""What the aligner stage asks of a forced aligner: audio + text in, timed words out (aligner.qwen3
is one). Imports neither torch nor a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# One alignment job: mono float32 PCM, its sample rate, the text as the client sent it, a language
# name ("English", "Chinese", "Japanese", …; ISO codes "ja"/"ko" are accepted too).
AlignInput = tuple[np.ndarray, int, str, str]


@dataclass(frozen=True, slots=True)
class AlignedWord:
    """One timed unit of the text.

    ``char_start``/``char_end`` are code-point offsets into the text exactly as sent, covering the
    unit and the punctuation attached to it; ``text`` is that slice. Times are seconds from the
    first sample of the aligned audio.
    """

    text: str
    start_s: float
    end_s: float
    char_start: int
    char_end: int


@dataclass(slots=True)
class CallPhases:
    """Where an aligner's calls went, summed: the host's work up to its wait on the device (the
    device's work launched meanwhile), the wait for the result, and the host's work after it."""

    calls: int = 0
    prepare_s: float = 0.0
    wait_s: float = 0.0
    finish_s: float = 0.0

    def add(self, prepare_s: float, wait_s: float, finish_s: float) -> None:
        self.calls += 1
        self.prepare_s += prepare_s
        self.wait_s += wait_s
        self.finish_s += finish_s


@runtime_checkable
class Aligner(Protocol):
    """Forced alignment of known text to audio, batched: one word list per input, in order."""

    @property
    def max_audio_s(self) -> float:
        """The longest audio one input may hold."""
        ...

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]: ...


class AlignerCall(Protocol):
    """A batch whose device work is queued (`SplitAligner.submit`)."""

    def ready(self) -> bool:
        """The device is done with it: `collect` returns without waiting."""
        ...

    def wait(self) -> None:
        """Until the device is done with it (the GIL released meanwhile)."""
        ...


@dataclass(slots=True)
class DeferredCall:
    """The batch of an aligner that does not split its calls: all its work is done when collected."""

    batch: list[AlignInput]

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass


@runtime_checkable
class SplitAligner(Aligner, Protocol):
    """An aligner whose call splits in two: `submit` readies a batch on the host and queues its
    device work, `collect` waits for that work and builds the words. `align(b)` is
    `collect(submit(b))`; a caller that submits the next batch before collecting this one keeps
    the device busy while the host readies it (engine.alignment.worker)."""

    def submit(self, batch: Sequence[AlignInput]) -> AlignerCall: ...

    def collect(self, call: AlignerCall) -> list[list[AlignedWord]]: ...


class _WholeCalls:
    """A SplitAligner over an aligner that does not split its calls: the work runs when collected."""

    def __init__(self, aligner: Aligner) -> None:
        self.aligner = aligner

    @property
    def max_audio_s(self) -> float:
        return self.aligner.max_audio_s

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        return self.aligner.align(batch)

    def submit(self, batch: Sequence[AlignInput]) -> AlignerCall:
        return DeferredCall(list(batch))

    def collect(self, call: AlignerCall) -> list[list[AlignedWord]]:
        assert isinstance(call, DeferredCall)
        return self.aligner.align(call.batch)


def split_calls(aligner: Aligner) -> SplitAligner:
    """`aligner` itself when it splits its calls, else one that runs each whole when collected."""
    return aligner if isinstance(aligner, SplitAligner) else _WholeCalls(aligner)
