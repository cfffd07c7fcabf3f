"""A fake speech engine implementing engine.api.Engine as real code.

Each word of the pushed text becomes a tone (its pitch a deterministic function of the word) with
short fades, followed by a short pause; word timings are exact. Audio comes in chunks of at most
`chunk_ms`, the word timing with the word's first chunk. Knobs: `step_s` (sleep per chunk; 0 =
as fast as the event loop allows), `capacity` (open streams before Overloaded), `fail_after_words`
(EngineError mid-stream), `stall_after_words` (the engine stops producing until cancelled),
`open_error` (raised by open()).
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
    InvalidAudio,
    Overloaded,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    UnknownVoice,
    WordTiming,
)

_WORD = re.compile(r"\S+")


def word_frequency(word: str) -> float:
    return 220.0 + 20.0 * (sum(map(ord, word)) % 24)


def word_ms(word: str, speed: float = 1.0) -> int:
    return int((80 + 30 * len(word)) / speed)


@dataclass
class FakeOptions:
    sample_rate: int = 24_000
    chunk_ms: int = 60
    gap_ms: int = 40
    step_s: float = 0.0
    capacity: int = 64
    fail_after_words: int | None = None
    stall_after_words: int | None = None
    open_error: EngineError | None = None


class FakeStream(SynthesisStream):
    def __init__(self, engine: FakeEngine, request: SynthesisRequest) -> None:
        self.request_id = request.request_id
        self.request = request
        self._engine = engine
        self._segments: asyncio.Queue[TextSegment | None] = asyncio.Queue()
        self._cancelled = asyncio.Event()
        self.pushed: list[TextSegment] = []
        self.cancelled = False
        self.finished = False

    def push(self, segment: TextSegment) -> None:
        self.pushed.append(segment)
        self._segments.put_nowait(segment)

    def close_text(self) -> None:
        self._segments.put_nowait(None)

    def cancel(self) -> None:
        self.cancelled = True
        self._cancelled.set()
        self._engine.release(self)

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._run()

    async def _next_segment(self) -> TextSegment | None | bool:
        """The next segment, None at the end of text, False when cancelled."""
        getter = asyncio.ensure_future(self._segments.get())
        canceller = asyncio.ensure_future(self._cancelled.wait())
        try:
            await asyncio.wait({getter, canceller}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            canceller.cancel()
        if getter.done():
            return getter.result()
        getter.cancel()
        return False

    async def _step(self) -> bool:
        """One engine step's pause; False when cancelled meanwhile."""
        if self._engine.options.step_s > 0:
            try:
                await asyncio.wait_for(self._cancelled.wait(), self._engine.options.step_s)
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(0)
        return not self._cancelled.is_set()

    async def _run(self) -> AsyncIterator[AudioChunk]:
        opts = self._engine.options
        rate = opts.sample_rate
        offset = 0
        words_done = 0
        try:
            while True:
                segment = await self._next_segment()
                if segment is False:
                    return
                if segment is None:
                    break
                assert isinstance(segment, TextSegment)
                for match in _WORD.finditer(segment.text):
                    if opts.fail_after_words is not None and words_done >= opts.fail_after_words:
                        raise EngineError("injected engine failure")
                    if opts.stall_after_words is not None and words_done >= opts.stall_after_words:
                        await self._cancelled.wait()
                        return
                    tone = self._engine.tone(match.group(), self.request.speed)
                    timing = WordTiming(
                        text=match.group(),
                        start_sample=offset,
                        end_sample=offset + len(tone),
                        char_start=segment.source_offset(match.start()),
                        char_end=segment.source_offset(match.end() - 1) + 1,
                        source="engine",
                    )
                    audio = np.concatenate((tone, np.zeros(rate * opts.gap_ms // 1000, np.float32)))
                    step = max(1, rate * opts.chunk_ms // 1000)
                    for i in range(0, len(audio), step):
                        if not await self._step():
                            return
                        piece = audio[i : i + step]
                        yield AudioChunk(self.request_id, piece, offset, (timing,) if i == 0 else ())
                        offset += len(piece)
                    words_done += 1
                    self._engine.words_spoken += 1
            yield AudioChunk(self.request_id, np.zeros(0, np.float32), offset, (), final=True)
            self.finished = True
        finally:
            self._engine.release(self)


class FakeEngine:
    def __init__(self, options: FakeOptions | None = None, **overrides: object) -> None:
        self.options = options or FakeOptions()
        for name, value in overrides.items():
            setattr(self.options, name, value)
        self.info = EngineInfo(
            name="fake",
            model="tones",
            sample_rate=self.options.sample_rate,
            voices=("alice", "bob"),
            languages=("English", "Chinese"),
            default_voice="alice",
        )
        self.streams: list[FakeStream] = []
        self.active: set[FakeStream] = set()
        self.registered: dict[str, tuple[int, str | None]] = {}
        self.started = False
        self.stopped = False
        self.words_spoken = 0

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        for stream in list(self.active):
            stream.cancel()
        self.stopped = True

    def load(self) -> EngineLoad:
        return EngineLoad(
            active=len(self.active),
            queued=0,
            capacity=self.options.capacity,
            queue_limit=0,
            ready=self.started,
        )

    def open(self, request: SynthesisRequest) -> FakeStream:
        if self.options.open_error is not None:
            raise self.options.open_error
        if (
            request.voice is not None
            and request.voice not in self.info.voices
            and request.voice not in self.registered
        ):
            raise UnknownVoice(f"unknown voice {request.voice!r}")
        if len(self.active) >= self.options.capacity:
            raise Overloaded("fake engine at capacity", retry_after_s=2.0)
        stream = FakeStream(self, request)
        self.streams.append(stream)
        self.active.add(stream)
        return stream

    def release(self, stream: FakeStream) -> None:
        self.active.discard(stream)

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        if len(audio) < sample_rate // 2:
            raise InvalidAudio("reference clip shorter than 0.5 s")
        self.registered[voice_id] = (sample_rate, text)

    async def unregister_voice(self, voice_id: str) -> None:
        self.registered.pop(voice_id, None)

    def tone(self, word: str, speed: float = 1.0) -> npt.NDArray[np.float32]:
        rate = self.options.sample_rate
        n = rate * word_ms(word, speed) // 1000
        t = np.arange(n) / rate
        wave = 0.3 * np.sin(2 * math.pi * word_frequency(word) * t)
        fade = min(n // 2, rate * 5 // 1000)
        envelope = np.ones(n)
        envelope[:fade] = np.linspace(0.0, 1.0, fade)
        envelope[n - fade :] = np.linspace(1.0, 0.0, fade)
        return (wave * envelope).astype(np.float32)
