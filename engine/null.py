"""A null engine: a constant tone in real time, 20 ms chunks, with estimated word timings.

For measuring the gateway alone (fan-out, pacing, packet lag) without any synthesis cost. It runs
in the event loop: one shared ticker serves every stream (no thread and no timer per stream), and
each stream's audio is planned from its text (English ~14 chars/s, CJK ~4.5 chars/s) or forced
to `forced_frames`.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.api import (
    AudioChunk,
    EngineError,
    EngineInfo,
    EngineLoad,
    InvalidRequest,
    Overloaded,
    SynthesisRequest,
    TextSegment,
    WordTiming,
)
from engine.bridge import ChunkChannel

SAMPLE_RATE = 24_000
CHUNK_SAMPLES = 480  # 20 ms
TICK_S = CHUNK_SAMPLES / SAMPLE_RATE
SAMPLES_PER_FRAME = 1_920
LATIN_CHARS_PER_S = 14.0
CJK_CHARS_PER_S = 4.5
# 200 Hz divides 20 ms into whole periods, so one chunk serves every stream at every tick
_TONE: npt.NDArray[np.float32] = (
    0.1 * np.sin(2 * np.pi * 200 * np.arange(CHUNK_SAMPLES) / SAMPLE_RATE)
).astype(np.float32)
_TONE.flags.writeable = False
_WORD = re.compile(r"\S+")


def _is_cjk(ch: str) -> bool:
    return "\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af"


def estimate_words(segment: TextSegment, start_sample: int) -> tuple[list[WordTiming], int]:
    """Words of a segment laid out from `start_sample`; returns them and the segment's length."""
    words: list[WordTiming] = []
    cursor = start_sample
    text = segment.text
    for match in _WORD.finditer(text):
        token = match.group()
        # CJK runs: one "word" per character, each at its own rate
        pieces = [(match.start() + i, match.start() + i + 1) for i, ch in enumerate(token) if _is_cjk(ch)]
        if not pieces:
            pieces = [(match.start(), match.end())]
        for a, b in pieces:
            rate = CJK_CHARS_PER_S if _is_cjk(text[a]) else LATIN_CHARS_PER_S
            length = round((b - a + (0 if _is_cjk(text[a]) else 1)) * SAMPLE_RATE / rate)
            words.append(
                WordTiming(
                    text=text[a:b],
                    start_sample=cursor,
                    end_sample=cursor + length,
                    char_start=segment.source_offset(a),
                    char_end=segment.source_offset(b - 1) + 1,
                    source="estimate",
                )
            )
            cursor += length
    return words, cursor - start_sample


class _LoopChannel(ChunkChannel):
    """A ChunkChannel fed from the event loop itself (no thread hop, no self-pipe wake-up)."""

    def put(self, chunk: AudioChunk) -> None:
        self._push(chunk)


@dataclass(slots=True)
class _Clock:
    next_due: float = 0.0  # loop time of the next chunk
    running: bool = False  # False while starved of text: the clock restarts when text comes


class NullStream:
    def __init__(self, engine: NullEngine, request: SynthesisRequest) -> None:
        self.request_id = request.request_id
        self._engine = engine
        frames = request.forced_frames
        self._forced = frames * SAMPLES_PER_FRAME if frames else None
        self._channel = _LoopChannel()
        self._planned = 0  # samples of audio the text received so far will take
        self._sent = 0
        self._words: list[WordTiming] = []  # planned, not yet sent
        self._text_closed = False
        self._clock = _Clock()
        self.done = False

    # -- SynthesisStream -----------------------------------------------------------------------
    def push(self, segment: TextSegment) -> None:
        if self._text_closed:
            raise InvalidRequest("text pushed after close_text()")
        words, length = estimate_words(segment, self._planned)
        self._words.extend(words)
        self._planned += length

    def close_text(self) -> None:
        self._text_closed = True
        if self._forced is not None:
            self._planned = self._forced

    def cancel(self) -> None:
        self.done = True
        self._channel.close()
        self._engine._streams.pop(self, None)

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._channel.__aiter__()

    # -- the ticker ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Emit every chunk that is due by `now`."""
        limit = self._planned if self._forced is None else min(self._planned, self._forced)
        while not self.done and self._sent < limit:
            if not self._clock.running:
                self._clock.running, self._clock.next_due = True, now
            if self._clock.next_due > now + TICK_S / 2:  # a tick may wake a hair early
                return
            count = limit - self._sent
            self._emit(_TONE if count >= CHUNK_SAMPLES else _TONE[:count], limit)
            self._clock.next_due += TICK_S
        if self._text_closed and self._sent >= limit and not self.done:
            self._channel.put(AudioChunk(self.request_id, _TONE[:0], self._sent, final=True))
            self.done = True
            self._engine._streams.pop(self, None)
        elif self._clock.running and self._clock.next_due <= now + TICK_S / 2:
            self._clock.running = False  # starved: restart in real time when text comes

    def _emit(self, samples: npt.NDArray[np.float32], limit: int) -> None:
        end = self._sent + len(samples)
        words: tuple[WordTiming, ...] = ()
        if self._words and self._words[0].start_sample < end:  # most chunks start no word
            ready = 0
            while ready < len(self._words) and self._words[ready].start_sample < end:
                ready += 1
            words = tuple(
                w if w.end_sample <= limit else _clip(w, limit)
                for w in self._words[:ready]
                if w.start_sample < limit
            )
            del self._words[:ready]
        self._channel.put(AudioChunk(self.request_id, samples, self._sent, words))
        self._sent = end


def _clip(word: WordTiming, limit: int) -> WordTiming:
    return WordTiming(word.text, word.start_sample, limit, word.char_start, word.char_end, word.source)


class NullEngine:
    """engine.api.Engine that costs nothing but the gateway's own work."""

    def __init__(self, max_streams: int = 100_000, queue_limit: int = 0) -> None:
        self.info = EngineInfo(
            name="null",
            model="constant tone",
            sample_rate=SAMPLE_RATE,
            voices=("default",),
            languages=("Auto", "English", "Chinese"),
            default_voice="default",
        )
        self.max_streams = max_streams
        self.queue_limit = queue_limit
        # open order, kept as streams come and go (a set's order changes as it grows): every tick
        # serves the streams in the same order, so none moves back and forth within a tick
        self._streams: dict[NullStream, None] = {}
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def stop(self) -> None:
        for stream in list(self._streams):
            stream.done = True
            stream._channel.fail(EngineError("engine stopped"))
        self._streams.clear()
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None

    def load(self) -> EngineLoad:
        return EngineLoad(
            active=len(self._streams),
            queued=0,
            capacity=self.max_streams,
            queue_limit=self.queue_limit,
            ready=self._ticker is not None,
        )

    def open(self, request: SynthesisRequest) -> NullStream:
        if self._ticker is None:
            raise EngineError("null engine is not running")
        if request.ref_audio is not None:
            raise InvalidRequest("the null engine cannot clone voices")
        if len(self._streams) >= self.max_streams + self.queue_limit:
            raise Overloaded(retry_after_s=0.5)
        stream = NullStream(self, request)
        self._streams[stream] = None
        return stream

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        raise InvalidRequest("the null engine cannot clone voices")

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            now = loop.time()
            for stream in list(self._streams):
                stream.tick(now)
            next_tick += TICK_S
            if next_tick < now:  # late by whole ticks: skip them, keeping the phase (a stream
                # emits all it owes at the next one; a shifted phase would shift every stream)
                next_tick += math.ceil((now - next_tick) / TICK_S) * TICK_S
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
