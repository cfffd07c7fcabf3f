"""A null engine: a constant tone in real time, 20 ms chunks, with estimated word timings.

For measuring the gateway alone (fan-out, pacing, packet lag) without any synthesis cost. It runs
in the event loop: one timer serves every stream (no thread and no timer per stream), and each
stream's audio is planned from its text (English ~14 chars/s, CJK ~4.5 chars/s) or forced to
`forced_frames`.

Phase: by default every stream is on one 20 ms grid, so all streams' chunks of a tick come in one
burst (the worst case for the gateway's jitter, and what a batched engine step looks like).
`phase="stream"` starts each stream's clock when its text comes instead, so streams opened at
different moments produce their chunks at different moments, like independent real-time sources.

Admission: at most `max_streams` streams produce audio at once (the null engine costs nothing to
measure); beyond them `queue_limit` wait in engine.admission's queue, and their clocks start when
they are admitted.

Ahead of real time: `speed` > 1 produces `chunk_ms` of audio every `chunk_ms / speed`, the way a
real engine with an RTF below 1 runs ahead (Qwen3-TTS: 80 ms codec frames at RTF 0.5 is
`chunk_ms=80, speed=2`); the gateway's realtime pacing then releases the audio on its own clock.

Audio: int16 PCM (`engine.api.pcm16`), the form the worker processes hand over, so that a load
test of the gateway takes the real engines' path (the packetiser slices int16 without re-encoding).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import re
from collections.abc import AsyncIterator
from typing import Literal

import numpy as np
import numpy.typing as npt

from engine.admission import Admission, Ticket
from engine.api import (
    AudioChunk,
    ChunkListener,
    EngineError,
    EngineInfo,
    EngineLoad,
    InvalidRequest,
    QueuePosition,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    WordTiming,
    pcm16,
)
from engine.bridge import LoopChunkChannel

SAMPLE_RATE = 24_000
CHUNK_SAMPLES = 480  # 20 ms, the default chunk
TICK_S = CHUNK_SAMPLES / SAMPLE_RATE  # the default tick: one chunk in real time
_STREAM_SLACK_S = 0.001  # a timer may fire this much early (the loop clock's granularity under uvloop)
Phase = Literal["stream", "shared"]
SAMPLES_PER_FRAME = 1_920
LATIN_CHARS_PER_S = 14.0
CJK_CHARS_PER_S = 4.5
TONE_HZ = 200  # divides 20 ms into whole periods, so one chunk serves every stream at every tick
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


class NullStream(SynthesisStream):
    def __init__(self, engine: NullEngine, request: SynthesisRequest, order: int) -> None:
        self.request_id = request.request_id
        self._engine = engine
        self.order = order  # the tie-break among streams due at the same moment: open order
        frames = request.forced_frames
        self._forced = frames * SAMPLES_PER_FRAME if frames else None
        self._channel = LoopChunkChannel()
        self._planned = 0  # samples of audio the text received so far will take
        self._sent = 0
        self._words: list[WordTiming] = []  # planned, not yet sent
        self._text_closed = False
        self._tone = engine.tone
        self._tick_s = engine.tick_s
        # the clock: chunk `_tick` is due at `_base + _tick * _tick_s`; None while starved of text
        # (it restarts in real time when text comes)
        self._base = 0.0
        self._tick: int | None = None
        self.done = False
        self.ticket: Ticket[NullStream] | None = None  # its admission (set by the engine's open)

    # -- SynthesisStream -----------------------------------------------------------------------
    def push(self, segment: TextSegment) -> None:
        if self._text_closed:
            raise InvalidRequest("text pushed after close_text()")
        words, length = estimate_words(segment, self._planned)
        self._words.extend(words)
        self._planned += length
        self._engine._wake(self)

    def close_text(self) -> None:
        self._text_closed = True
        if self._forced is not None:
            self._planned = self._forced
        self._engine._wake(self)

    def cancel(self) -> None:
        self.done = True
        self._channel.close()
        self._engine._gone(self)

    def listen(self, listener: ChunkListener) -> bool:
        self._channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._channel.__aiter__()

    def queue_position(self) -> QueuePosition | None:
        return None if self.ticket is None else self._engine.admission.position(self.ticket)

    def queue_wait_s(self) -> float:
        return 0.0 if self.ticket is None else self.ticket.waited_s

    # -- the clock -----------------------------------------------------------------------------
    def due(self) -> float:
        """Loop time of the next chunk (only while the clock runs)."""
        assert self._tick is not None
        return self._base + self._tick * self._tick_s

    def tick(self, horizon: float) -> bool:
        """Emit every chunk that is due by `horizon`; True when the clock runs on (due again)."""
        limit = self._planned if self._forced is None else min(self._planned, self._forced)
        assert self._tick is not None
        tone, tick_s = self._tone, self._tick_s
        while self._sent < limit and self._base + self._tick * tick_s <= horizon:
            count = limit - self._sent
            self._emit(tone if count >= len(tone) else tone[:count], limit)
            self._tick += 1
        if self._text_closed and self._sent >= limit:
            self._channel.put(AudioChunk(self.request_id, tone[:0], self._sent, final=True))
            self.done = True
            self._engine._gone(self)
            return False
        if self._sent >= limit and self._base + self._tick * tick_s <= horizon:
            self._tick = None  # starved: restart in real time when text comes
            return False
        return True

    def _emit(self, samples: npt.NDArray[np.int16], limit: int) -> None:
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

    def __init__(
        self,
        max_streams: int = 100_000,
        queue_limit: int = 0,
        phase: Phase = "shared",
        chunk_ms: int = 20,
        speed: float = 1.0,
    ) -> None:
        if chunk_ms <= 0 or chunk_ms % 20:
            raise ValueError("chunk_ms must be a positive multiple of 20")
        if speed <= 0:
            raise ValueError("speed must be positive")
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
        self.admission: Admission[NullStream] = Admission(max_streams, queue_limit)
        self.phase: Phase = phase
        samples = chunk_ms * SAMPLE_RATE // 1000
        self.tone: npt.NDArray[np.int16] = pcm16(
            (0.1 * np.sin(2 * np.pi * TONE_HZ * np.arange(samples) / SAMPLE_RATE)).astype(np.float32)
        )
        self.tone.flags.writeable = False
        self.tick_s = samples / SAMPLE_RATE / speed  # one chunk is made every tick
        # on the shared grid, anything within half a tick counts as the tick
        self._slack = self.tick_s / 2 if phase == "shared" else _STREAM_SLACK_S
        self._streams: dict[NullStream, None] = {}  # open, in open order
        self._order = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._epoch = 0.0  # the shared grid's tick 0 (phase "shared")
        # clocks that run, by when they are due: (due, open order, stream); ONE timer for the earliest
        self._due: list[tuple[float, int, NullStream]] = []
        self._scheduled: set[NullStream] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._epoch = self._loop.time()

    async def stop(self) -> None:
        for stream in list(self._streams):
            stream.done = True
            stream._channel.fail(EngineError("engine stopped"))
            if stream.ticket is not None:
                self.admission.leave(stream.ticket)
        self._streams.clear()
        self._due.clear()
        self._scheduled.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at, self._loop = None, math.inf, None

    def load(self) -> EngineLoad:
        figures = self.admission.figures()
        return EngineLoad(
            active=figures.admitted,
            queued=figures.queued,
            capacity=figures.capacity,
            queue_limit=figures.queue_limit,
            ready=self._loop is not None,
            admission=figures,
        )

    def open(self, request: SynthesisRequest) -> NullStream:
        if self._loop is None:
            raise EngineError("null engine is not running")
        if request.ref_audio is not None:
            raise InvalidRequest("the null engine cannot clone voices")
        stream = NullStream(self, request, next(self._order))
        stream.ticket = self.admission.arrive(stream, request.priority, request.max_wait_s)  # or Overloaded
        self._streams[stream] = None
        if stream.ticket.queued and request.max_wait_s is not None:
            self.admission.arm_expiry(self._loop, self._expire)
        return stream

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        raise InvalidRequest("the null engine cannot clone voices")

    async def unregister_voice(self, voice_id: str) -> None:
        return None  # it keeps no voices

    # -- admission -----------------------------------------------------------------------------
    def _gone(self, stream: NullStream) -> None:
        """A stream finished or was cancelled: its place goes to the next one queued."""
        self._streams.pop(stream, None)
        if stream.ticket is not None:
            self.admission.leave(stream.ticket)
        for ticket in self.admission.admit_waiting():
            self._wake(ticket.item)

    def _expire(self) -> None:
        for ticket in self.admission.expire():
            stream = ticket.item
            stream.done = True
            self._streams.pop(stream, None)
            stream._channel.fail(self.admission.expired_error(ticket))
        self.admission.arm_expiry(self._loop, self._expire)

    # -- the clocks ----------------------------------------------------------------------------
    def _wake(self, stream: NullStream) -> None:
        """Text came (or the stream was admitted): a stream whose clock stopped starts it now (its
        own phase), or at the next tick of the shared grid."""
        if stream.done or stream in self._scheduled or self._loop is None:
            return
        if stream.ticket is not None and stream.ticket.queued:
            return  # its clock starts when it is admitted
        if stream._tick is None:
            now = self._loop.time()
            if self.phase == "shared":
                stream._base, stream._tick = self._epoch, math.ceil((now - self._epoch) / self.tick_s - 1e-9)
            else:
                stream._base, stream._tick = now, 0
        self._schedule(stream)

    def _schedule(self, stream: NullStream) -> None:
        due = stream.due()
        heapq.heappush(self._due, (due, stream.order, stream))
        self._scheduled.add(stream)
        if due < self._timer_at:
            self._arm(due)

    def _arm(self, at: float) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        """Serve every stream due by now, in (due, open order); a stream late by several chunks
        (a stalled loop) emits them all at once and keeps its phase."""
        assert self._loop is not None
        self._timer, self._timer_at = None, math.inf
        horizon = self._loop.time() + self._slack
        due, scheduled = self._due, self._scheduled
        again: list[NullStream] = []
        while due and due[0][0] <= horizon:
            stream = heapq.heappop(due)[2]
            scheduled.discard(stream)
            if not stream.done and stream.tick(horizon):
                again.append(stream)
        for stream in again:  # after the loop: a stream served now is not served twice
            heapq.heappush(due, (stream.due(), stream.order, stream))
            scheduled.add(stream)
        if due:
            self._arm(due[0][0])
