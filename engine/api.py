"""The engine contract: what the gateway may know about any speech engine.

The gateway imports this module and nothing else of `engine`. It is plain Python (numpy for the
audio arrays); no torch here.

Life of a request:

    stream = engine.open(SynthesisRequest(...))     # raises Overloaded / UnknownVoice / InvalidRequest
    stream.push(TextSegment("Hello there. ", char_start=0))
    stream.push(TextSegment("How are you?", char_start=13))
    stream.close_text()                             # no more text
    async for chunk in stream:                      # AudioChunk, in order, the last one has final=True
        ...
    stream.cancel()                                 # any time, from the event loop; effective at the
                                                    # engine's next step; iteration then ends

An engine admits a request while its measured cost keeps the admitted streams in real time
(engine.admission); beyond that `open` still returns a stream, which waits for admission in the
engine's queue (`stream.queue_position()` says where) and produces audio once admitted, or `open`
raises Overloaded (queue full, or the request's `max_wait_s` would pass; a stream still queued
when it passes fails with Overloaded).

Text arrives as segments (the gateway cuts the client's text at sentence and clause boundaries);
each segment says where its first character sits in the utterance's text as the client sent it, so
that word timings can point back into that text (`char_start` / `char_end`).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

WordSource = Literal["engine", "aligner", "estimate"]


class Priority(enum.IntEnum):
    """Lower runs first."""

    INTERACTIVE = 0
    BULK = 1


@dataclass(frozen=True, slots=True)
class TextSegment:
    text: str
    # offset of text[0] in the utterance's text as the client sent it
    char_start: int
    # language of this segment ("English", "Chinese", ... or None = the request's language)
    language: str | None = None
    # optional per-character map into the client's text, when the gateway removed markup
    # (len == len(text)); None means text[i] sits at char_start + i
    char_map: tuple[int, ...] | None = None

    def source_offset(self, i: int) -> int:
        """Offset in the client's text of self.text[i] (i may equal len(text): the end)."""
        if self.char_map is None:
            return self.char_start + i
        if i >= len(self.char_map):
            return (self.char_map[-1] + 1) if self.char_map else self.char_start
        return self.char_map[i]


@dataclass(frozen=True, slots=True)
class ChunkSchedule:
    """Frames per audio chunk: the first chunks small for time to first audio, then growing."""

    first: int = 1
    growth: float = 2.0
    largest: int = 25


@dataclass(frozen=True, slots=True)
class SynthesisRequest:
    request_id: str
    voice: str | None = None  # preset speaker, registered voice id, or None = engine default
    language: str = "Auto"
    instructions: str | None = None
    priority: Priority = Priority.INTERACTIVE
    seed: int | None = None
    # sampling: None = the engine's defaults (Qwen3: upstream generation_config values)
    greedy: bool = False
    max_frames: int | None = None
    # benchmark mode: EOS masked until this many frames, forced at it
    forced_frames: int | None = None
    # reference clip for a one-off voice clone (mono float32, its rate, its transcript)
    ref_audio: tuple[npt.NDArray[np.float32], int] | None = None
    ref_text: str | None = None
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    speed: float = 1.0
    # the longest the caller will wait in the engine's queue for admission: a request whose expected
    # wait is longer is refused at once (Overloaded), one still queued when it passes is refused
    # then; None: the queue's own bound only; 0: admitted at once or refused
    max_wait_s: float | None = None
    # where an engine with a forced aligner takes the words from: "sync", "async" or "off" (as
    # SynthesisStream.set_word_alignment); None: its default. Known at open, it decides whether
    # the stream counts towards the aligner's share in admission
    word_alignment: str | None = None


@dataclass(frozen=True, slots=True)
class WordTiming:
    """One word on the utterance's audio timeline (engine sample rate)."""

    text: str
    start_sample: int
    end_sample: int
    char_start: int  # offsets into the utterance's text as the client sent it
    char_end: int
    source: WordSource = "engine"


PCM16_FULL_SCALE = 32767.0  # int16 samples are float samples times this, rounded


def pcm16(samples: npt.NDArray[np.float32]) -> npt.NDArray[np.int16]:
    """float32 samples as int16 PCM: clipped to [-1, 1], scaled by PCM16_FULL_SCALE, rounded.
    Plain ufuncs: np.clip's wrapper costs more than the arithmetic on a 20 ms packet."""
    scaled = np.maximum(np.asarray(samples, np.float32).reshape(-1), -1.0)
    np.minimum(scaled, 1.0, out=scaled)
    np.multiply(scaled, PCM16_FULL_SCALE, out=scaled)
    np.rint(scaled, out=scaled)
    return scaled.astype(np.int16)


def float_samples(samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]) -> npt.NDArray[np.float32]:
    """A chunk's samples as mono float32 in [-1, 1], whichever of the two forms it came in."""
    if samples.dtype == np.int16:
        out = samples.reshape(-1).astype(np.float32)
        out *= np.float32(1.0 / PCM16_FULL_SCALE)
        return out
    if samples.dtype == np.float32 and samples.ndim == 1:
        return cast(npt.NDArray[np.float32], samples)
    return np.asarray(samples, dtype=np.float32).reshape(-1)


@dataclass(frozen=True, slots=True)
class AudioChunk:
    request_id: str
    # mono at Engine.sample_rate: float32 in [-1, 1], or int16 PCM (`pcm16` of them), which the
    # Qwen3 engine makes on the device and an engine in another process hands over (half the bytes,
    # and the gateway's default output as it is); `float_samples` gives either as float32. May be
    # empty (a words-only or final chunk)
    samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]
    # index of samples[0] on the utterance's timeline
    sample_offset: int
    # words whose timing became known with this chunk (never changed once sent)
    words: tuple[WordTiming, ...] = ()
    final: bool = False


@dataclass(frozen=True, slots=True)
class QueuePosition:
    """Where a request waits for admission: `position` 1 is admitted next."""

    position: int
    expected_wait_s: float


@dataclass(frozen=True, slots=True)
class AdmissionFigures:
    """Admission by measured cost (engine.admission), for /metrics and the page's load panel."""

    capacity: int  # streams the measured cost admits now (at most max_streams)
    max_streams: int  # the upper bound, whatever the cost
    admitted: int  # streams admitted and not finished
    queued: int  # waiting for admission
    queue_limit: int
    admitted_total: int  # since start
    queued_total: int  # requests that waited in the queue before admission, since start
    refused: dict[str, int]  # refusals since start by reason: queue_full, max_wait, wait_expired
    wait_bounds_s: tuple[float, ...]  # upper bounds of the queue-wait histogram's buckets
    wait_counts: tuple[int, ...]  # cumulative counts per bound, then the total (+Inf)
    wait_sum_s: float
    wait_p50_s: float | None = None  # over the requests admitted from the queue in the last minute
    wait_p90_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A snapshot for admission control, /readyz and /metrics."""

    active: int  # requests producing audio
    queued: int  # admitted, waiting for a slot
    capacity: int  # active slots (with admission by measured cost: what the cost admits now)
    queue_limit: int  # queued beyond this -> Overloaded
    ready: bool = True
    extra: dict[str, float] = field(default_factory=dict)  # engine-specific figures
    admission: AdmissionFigures | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    name: str
    model: str
    sample_rate: int
    voices: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    default_voice: str | None = None


class EngineError(Exception):
    """Base of the errors an engine reports; `code` is the protocol's error code."""

    code = "internal"


class Overloaded(EngineError):
    code = "overloaded"

    def __init__(self, message: str = "engine at capacity", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownVoice(EngineError):
    code = "unknown_voice"


class InvalidRequest(EngineError):
    code = "invalid_request"


class InvalidAudio(InvalidRequest):
    code = "invalid_audio"


class ChunkListener(Protocol):
    """Takes one stream's items on its event loop, in order, in place of an iterating task."""

    def chunk(self, chunk: AudioChunk) -> None: ...

    def end(self) -> None:
        """The stream ended (after a final chunk, a finish or the consumer's close)."""

    def fail(self, error: BaseException) -> None:
        """The stream failed (the error as the engine reported it)."""


@runtime_checkable
class SynthesisStream(Protocol):
    """One request's stream. A class that subclasses this Protocol inherits the two optional
    methods below (`listen` declines, `set_word_alignment` keeps the engine's own words)."""

    request_id: str

    def push(self, segment: TextSegment) -> None:
        """Queue more text; synthesis of it may begin at once."""

    def close_text(self) -> None:
        """No more text will come; the stream ends after the last segment's audio."""

    def cancel(self) -> None:
        """Stop now: no chunk is produced after the engine's next step; iteration ends."""

    def listen(self, listener: ChunkListener) -> bool:
        """Hand this stream's chunks to `listener` on the event loop as they come, instead of being
        iterated: no task and no future per chunk. False when it cannot (then iterate it); call it
        once, before iterating."""
        return False

    def set_word_alignment(self, mode: str) -> None:
        """Where the words of an engine with a forced aligner come from: "async" (audio at once,
        words when aligned), "sync" (audio held until its words are aligned) or "off" (the engine's
        own words), in place of the request's `word_alignment`; effective before the first chunk.
        An engine without an aligner keeps its own words."""
        return None

    def queue_position(self) -> QueuePosition | None:
        """Where the stream waits for admission, or None once admitted (or for an engine without a
        queue)."""
        return None

    def queue_wait_s(self) -> float:
        """Seconds the stream waited in the queue before admission (0 when admitted at once or still
        waiting)."""
        return 0.0

    def __aiter__(self) -> AsyncIterator[AudioChunk]: ...


@runtime_checkable
class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None:
        """Load models, capture graphs; returns when ready to serve."""

    async def stop(self) -> None:
        """Cancel everything in flight and release resources."""

    def load(self) -> EngineLoad: ...

    def open(self, request: SynthesisRequest) -> SynthesisStream:
        """Admit a request (raises Overloaded, UnknownVoice, InvalidRequest)."""
        ...

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        """Prepare a reusable voice from a reference clip (raises InvalidAudio, InvalidRequest)."""

    async def unregister_voice(self, voice_id: str) -> None:
        """Release what `register_voice` keeps for `voice_id` (its prompt, its clip); streams already
        open in it finish, later requests get UnknownVoice. An id it does not hold is no error."""
