"""Fakes for the stage's tests: deterministic aligners (real word splitting; times spread over the
window, or read from the fake engine's tones) and engines whose chunks come when the test says, or
whose words come only at a segment's end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

import numpy as np

from aligner.text import UnitSplitter, display_spans
from engine.alignment.api import AlignedWord, AlignInput
from engine.api import (
    AudioChunk,
    EngineInfo,
    EngineLoad,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    WordTiming,
)
from tests.fakes import FakeEngine


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


def sound_runs(audio: np.ndarray, rate: int, frame_ms: int = 5, gap_ms: int = 20) -> list[tuple[int, int]]:
    """(start, end) samples of each stretch of sound, stretches split by `gap_ms` of silence."""
    frame = rate * frame_ms // 1000
    loud = [bool(np.abs(audio[i : i + frame]).max() > 1e-3) for i in range(0, len(audio) - frame + 1, frame)]
    runs: list[tuple[int, int]] = []
    quiet = gap_ms // frame_ms
    for index, on in enumerate(loud):
        if not on:
            continue
        at = index * frame
        if runs and at - runs[-1][1] < quiet * frame:
            runs[-1] = (runs[-1][0], at + frame)
        else:
            runs.append((at, at + frame))
    return runs


class ToneAligner:
    """What a trained aligner does on tests.fakes.FakeEngine's audio (one tone per word, pauses
    between): the i-th unit gets the i-th stretch of sound. Units past the sound in the window are
    placed at its end, as a forced aligner must place text the audio lacks; a stretch cut by the
    window's end ends there. Stands in for real weights, which no machine here has."""

    def __init__(self) -> None:
        self.splitter = UnitSplitter()
        self.batches: list[list[str]] = []

    @property
    def max_audio_s(self) -> float:
        return 300.0

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        self.batches.append([text for _, _, text, _ in batch])
        out = []
        for audio, rate, text, language in batch:
            spans = display_spans(text, self.splitter.units(text, language))
            runs = sound_runs(np.asarray(audio), rate)
            end = len(audio) / rate
            words = []
            for i, (a, b) in enumerate(spans):
                start_s, end_s = (runs[i][0] / rate, runs[i][1] / rate) if i < len(runs) else (end, end)
                words.append(AlignedWord(text[a:b], round(start_s, 3), round(end_s, 3), a, b))
            out.append(words)
        return out


class HandFedStream(SynthesisStream):
    """Chunks come only when the test feeds them (`feed`, `finish`)."""

    def __init__(self, request: SynthesisRequest) -> None:
        self.request_id = request.request_id
        self.pushed: list[TextSegment] = []
        self.produced = 0  # samples fed so far
        self._queue: asyncio.Queue[AudioChunk | None] = asyncio.Queue()
        self.cancelled = False

    def push(self, segment: TextSegment) -> None:
        self.pushed.append(segment)

    def close_text(self) -> None: ...

    def cancel(self) -> None:
        self.cancelled = True
        self._queue.put_nowait(None)

    def feed(self, samples: np.ndarray, words: tuple[WordTiming, ...] = ()) -> None:
        self._queue.put_nowait(AudioChunk(self.request_id, samples, self.produced, words))
        self.produced += len(samples)

    def finish(self, words: tuple[WordTiming, ...] = ()) -> None:
        self._queue.put_nowait(
            AudioChunk(self.request_id, np.zeros(0, np.float32), self.produced, words, True)
        )
        self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._run()

    async def _run(self) -> AsyncIterator[AudioChunk]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk


class HandFedEngine:
    def __init__(self, sample_rate: int = 24_000) -> None:
        self.info = EngineInfo(name="hand-fed", model="tones", sample_rate=sample_rate)
        self.streams: list[HandFedStream] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def load(self) -> EngineLoad:
        return EngineLoad(active=len(self.streams), queued=0, capacity=64, queue_limit=0)

    def open(self, request: SynthesisRequest) -> HandFedStream:
        self.streams.append(HandFedStream(request))
        return self.streams[-1]

    async def register_voice(self, *args: object) -> None: ...


class LateWordsEngine(FakeEngine):
    """tests.fakes.FakeEngine whose words come only when a segment's audio is complete, with the
    next segment's first chunk or the final one, as the Qwen3 engine's estimates do."""

    def open(self, request: SynthesisRequest) -> SynthesisStream:
        return _LateWords(super().open(request))


class _LateWords(SynthesisStream):
    def __init__(self, inner: SynthesisStream) -> None:
        self.inner = inner
        self.request_id = inner.request_id
        self.ends: list[int] = []  # client offset past each pushed segment

    def push(self, segment: TextSegment) -> None:
        self.ends.append(segment.source_offset(len(segment.text)))
        self.inner.push(segment)

    def close_text(self) -> None:
        self.inner.close_text()

    def cancel(self) -> None:
        self.inner.cancel()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._run()

    async def _run(self) -> AsyncIterator[AudioChunk]:
        held: list[WordTiming] = []  # the words of the segment being spoken
        async for chunk in self.inner:
            out: list[WordTiming] = []
            for word in chunk.words:
                if held and self._segment(word) != self._segment(held[0]):
                    out, held = out + held, []
                held.append(word)
            if chunk.final:
                out, held = out + held, []
            yield AudioChunk(chunk.request_id, chunk.samples, chunk.sample_offset, tuple(out), chunk.final)

    def _segment(self, word: WordTiming) -> int:
        return next(i for i, end in enumerate(self.ends) if word.char_start < end)
