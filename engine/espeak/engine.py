"""eSpeak NG as a Cadence engine: zero-download, multilingual, far faster than real time, native
word times.

One worker thread owns the (process-global) eSpeak library and serves the streams one sentence
per turn, interactive requests first, then the earliest deadline: a new request's is its first
audio's target, a running one's the moment its listener would run dry (its first audio plus the
audio made since). A stream far ahead of its listener waits for one about to run dry, and a new
request's first sentence goes before the next sentences of streams with audio in hand; the event
loop never blocks on the worker. Streams are admitted by the cost the worker measures
(engine.espeak.capacity): beyond what it keeps in real time they wait in a bounded queue, or are
refused. A sentence's
PCM is streamed as eSpeak produces it (~100 ms chunks), resampled 22 050 -> 24 000 Hz, and handed
to the event loop through a ChunkChannel. WORD events become WordTimings on the 24 kHz utterance
timeline, with character offsets into the client's text; audio is held back only up to the start
of the word still open, so words always arrive before or with their audio. A cancel aborts the
sentence in progress at its next ~100 ms chunk.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import soxr

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
    UnknownVoice,
    WordTiming,
)
from engine.bridge import ChunkChannel
from engine.espeak.capacity import CALIBRATION_TEXT, HEADROOM, TTFA_TARGET_S, EspeakCapacity
from engine.espeak.lib import Espeak, WordEvent, library
from engine.espeak.text import TimedSpan, WordTracker, script_language, split_sentences

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1_920  # one 12.5 Hz codec frame, the unit of forced_frames / max_frames
BASE_RATE_WPM = 175
SILENCE_LEVEL = 0.01  # |sample| below this counts as silence when trimming a word's end
END_HANGOVER = 240  # 10 ms kept after a word's last loud sample
SENTENCE_PAUSE = 7_200  # 300 ms between sentences
CLAUSE_PAUSE = 3_600  # 150 ms after a clause cut at , ; :

LANGUAGES: dict[str, str] = {
    "English": "en-us",
    "Chinese": "cmn",
    "Japanese": "ja",
    "Korean": "ko",
    "German": "de",
    "French": "fr",
    "Russian": "ru",
    "Portuguese": "pt",
    "Spanish": "es",
    "Italian": "it",
    "Cantonese": "yue",
}

# preset name -> eSpeak variant; the Qwen3 CustomVoice names map too, so a client written for the
# neural engine still gets a voice of the same kind here
VOICES: dict[str, str] = {
    "default": "",
    "female": "+f3",
    "male": "+m3",
    "deep": "+m1",
    "whisper": "+whisper",
    "robot": "+klatt",
    "Vivian": "+f3",
    "Serena": "+f2",
    "Ono_Anna": "+f4",
    "Sohee": "+f5",
    "Uncle_Fu": "+m1",
    "Dylan": "+m3",
    "Eric": "+m2",
    "Ryan": "+m7",
    "Aiden": "+m5",
}


def pause_after(text: str) -> int:
    """Silence after a piece of text when more may follow (eSpeak ends a call without one)."""
    tail = text.rstrip().rstrip("\"'”’)]」』）")
    if tail.endswith(tuple(".!?…。！？")):
        return SENTENCE_PAUSE
    if tail.endswith(tuple(",;:，；：、")):
        return CLAUSE_PAUSE
    return 0


class EspeakEngine:
    """engine.api.Engine backed by eSpeak NG."""

    def __init__(
        self,
        max_streams: int | None = None,
        queue_limit: int | None = None,
        headroom: float = HEADROOM,
        ttfa_target_s: float = TTFA_TARGET_S,
    ) -> None:
        """`max_streams`: the upper bound on admitted streams (None: what the worker keeps in real
        time alone, measured at start); `queue_limit`: streams waiting beyond them (None: as many)."""
        self.info = EngineInfo(
            name="espeak",
            model="eSpeak NG",
            sample_rate=SAMPLE_RATE,
            voices=tuple(VOICES),
            languages=("Auto", *LANGUAGES),
            default_voice="default",
        )
        self._bound, self._queue_bound = max_streams, queue_limit
        self.max_streams = max_streams or 256
        self.queue_limit = self.max_streams if queue_limit is None else queue_limit
        self.cost = EspeakCapacity(headroom, ttfa_target_s)
        self.admission: Admission[EspeakStream] = Admission(
            self.max_streams, self.queue_limit, capacity=self._cost_capacity, starts=self._starts
        )
        self._lib: Espeak | None = None
        self._cond = threading.Condition()
        # streams with a sentence to synthesise: (priority, deadline, order, stream), a heap
        self._ready: list[tuple[int, float, int, EspeakStream]] = []
        self._order = itertools.count()
        self._first_waiting = 0  # of them, streams whose first sentence it is
        self._active: set[EspeakStream] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._audio_s = 0.0
        self._synth_s = 0.0
        self._piece: tuple[float, float] | None = None  # (synthesis s, audio s) of the last sentence

    # -- Engine -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._lib = await asyncio.to_thread(_warmed_library)
        self.cost.calibrate(*await asyncio.to_thread(_calibration, self._lib))
        if self._bound is None:
            self.max_streams = self.cost.auto_max_streams()
            self.queue_limit = self.max_streams if self._queue_bound is None else self._queue_bound
            self.admission.max_streams, self.admission.queue_limit = self.max_streams, self.queue_limit
        self.info = replace(self.info, model=f"eSpeak NG {self._lib.version}".strip())
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="espeak-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            streams = [*self._active, *(t.item for t in self.admission.queued_tickets())]
            self._stopping = True
            self._cond.notify_all()
        for stream in streams:
            stream.abort(EngineError("engine stopped"))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        with self._cond:  # a restart begins with nothing admitted
            for ticket in [*self.admission.admitted, *self.admission.queued_tickets()]:
                self.admission.leave(ticket)
            self._active.clear()
            self._ready.clear()
            self._first_waiting = 0

    def load(self) -> EngineLoad:
        with self._cond:
            figures = self.admission.figures()
        extra = {"x_realtime": self._audio_s / self._synth_s} if self._synth_s else {}
        return EngineLoad(
            active=figures.admitted,
            queued=figures.queued,
            capacity=figures.capacity,
            queue_limit=figures.queue_limit,
            ready=self._thread is not None and self._thread.is_alive() and not self._stopping,
            extra=extra,
            admission=figures,
        )

    def open(self, request: SynthesisRequest) -> EspeakStream:
        if self._thread is None or self._stopping:
            raise EngineError("espeak engine is not running")
        variant = self._variant(request)
        language = self._language(request.language)
        if not 0.25 <= request.speed <= 4.0:
            raise InvalidRequest("speed must be within 0.25..4")
        stream = EspeakStream(self, request, variant, language)
        with self._cond:
            stream.ticket = self.admission.arrive(
                stream, request.priority, request.max_wait_s
            )  # or Overloaded
            if stream.ticket.admitted_at is not None:
                self._active.add(stream)
            else:
                self._cond.notify()  # the worker's wait now ends at this one's max wait
        return stream

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        raise InvalidRequest("the espeak engine cannot clone voices")

    async def unregister_voice(self, voice_id: str) -> None:
        return None  # it keeps no voices

    # -- validation ---------------------------------------------------------------------------
    def _variant(self, request: SynthesisRequest) -> str:
        if request.ref_audio is not None:
            raise InvalidRequest("the espeak engine cannot clone voices")
        voice = request.voice or "default"
        if voice not in VOICES:
            raise UnknownVoice(f"unknown voice {voice!r}; espeak has {', '.join(VOICES)}")
        return VOICES[voice]

    def _language(self, language: str | None) -> str | None:
        """eSpeak language code, or None for "Auto" (chosen by script per sentence)."""
        if not language or language == "Auto":
            return None
        if language in LANGUAGES:
            return LANGUAGES[language]
        assert self._lib is not None
        code = self._lib.languages().get(language.lower())
        if code is None:
            raise InvalidRequest(
                f"unknown language {language!r}; choose one of {', '.join(self.info.languages)}, "
                "or an eSpeak language code (such as en-gb or pt-br)"
            )
        return code

    # -- admission (called with self._cond held) ---------------------------------------------------
    def _cost_capacity(self) -> int:
        return self.cost.capacity(self.admission.max_streams)

    def _starts(self) -> int:
        return self.cost.starts(self._first_waiting)

    def _promote(self) -> None:
        """Admit the queued streams the measured cost has room for now."""
        for ticket in self.admission.admit_waiting():
            self._active.add(ticket.item)
            self._schedule(ticket.item)

    def _expire(self) -> None:
        for ticket in self.admission.expire():
            ticket.item.abort(self.admission.expired_error(ticket))

    def _until_expiry(self) -> float | None:
        wait = self.admission.until_expiry()
        return None if wait is None else wait + 0.001

    # -- scheduling (called with self._cond held) ------------------------------------------------
    def _schedule(self, stream: EspeakStream) -> None:
        if stream in self._active and not stream.scheduled and stream.has_work():
            stream.scheduled = True
            if stream.samples_out == 0:
                self._first_waiting += 1
            entry = (
                int(stream.request.priority),
                stream.deadline(self.cost.ttfa_target_s),
                next(self._order),
                stream,
            )
            heapq.heappush(self._ready, entry)
            self._cond.notify()

    def _retire(self, stream: EspeakStream) -> None:
        ticket = stream.ticket
        if stream in self._active:
            self._active.discard(stream)
            if ticket is not None:
                self.admission.leave(ticket)
            self._promote()
        elif ticket is not None:
            self.admission.leave(ticket)  # cancelled while queued

    def _next_ready(self) -> EspeakStream | None:
        if not self._ready:
            return None
        stream = heapq.heappop(self._ready)[3]
        if stream.samples_out == 0:
            self._first_waiting -= 1
        return stream

    def _generating(self) -> int:
        """Streams with a sentence to synthesise, the one about to be served included."""
        return 1 + len(self._ready)

    # -- the worker thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cond:
                self._expire()
                stream = self._next_ready()
                while stream is None and not self._stopping:
                    self._cond.wait(self._until_expiry())
                    self._expire()
                    stream = self._next_ready()
                if stream is None:
                    return
                first, generating = stream.samples_out == 0, self._generating()
                piece = stream.take_piece()
            self._piece = None
            try:
                if piece is not None and not stream.stopped:
                    self._speak(stream, *piece)
                elif not stream.stopped:
                    stream.finish()
            except Exception as exc:  # a failed request must not take the worker down
                stream.abort(exc if isinstance(exc, EngineError) else EngineError(f"espeak: {exc}"))
            with self._cond:
                if self._piece is not None:
                    self.cost.piece(*self._piece, generating, first)
                stream.scheduled = False
                if stream.stopped:
                    self._retire(stream)
                else:
                    self._schedule(stream)
                self._promote()  # the cost measured may admit more now

    def _speak(self, stream: EspeakStream, segment: TextSegment, start: int, end: int) -> None:
        assert self._lib is not None
        text = segment.text[start:end]
        language = stream.language_for(segment, text)
        call = _SynthCall(stream, segment, start, text, self._lib.sample_rate)
        began = time.perf_counter()
        self._lib.synthesize(text, language + stream.variant, stream.rate_wpm, call.on_chunk)
        if not stream.stopped:
            more_may_follow = stream.has_pieces() or not stream.text_closed
            call.finish(pause_after(text) if more_may_follow else 0)
        synth_s, audio_s = time.perf_counter() - began, (call.produced - call.origin) / SAMPLE_RATE
        self._synth_s += synth_s
        self._audio_s += audio_s
        self._piece = (synth_s, audio_s)


def _calibration(lib: Espeak) -> tuple[float, float]:
    """(synthesis seconds, audio seconds) of one sentence spoken alone."""
    samples = 0

    def count(pcm: npt.NDArray[np.int16], words: list[WordEvent]) -> bool:
        nonlocal samples
        samples += len(pcm)
        return False

    began = time.perf_counter()
    lib.synthesize(CALIBRATION_TEXT, "en-us", BASE_RATE_WPM, count)
    return time.perf_counter() - began, samples / lib.sample_rate


def _warmed_library() -> Espeak:
    """Load eSpeak and touch the two main languages so the first request pays no load cost."""
    lib = library()
    for language, text in (("en-us", "ok"), ("cmn", "好")):
        lib.synthesize(text, language, BASE_RATE_WPM, lambda pcm, words: False)
    return lib


class EspeakStream(SynthesisStream):
    """One request: text pieces in, AudioChunks out (engine.api.SynthesisStream)."""

    def __init__(self, engine: EspeakEngine, request: SynthesisRequest, variant: str, language: str | None):
        self.request_id = request.request_id
        self.request = request
        self.variant = variant
        self.language = language
        self.rate_wpm = max(80, min(450, round(BASE_RATE_WPM * request.speed)))
        frames = request.forced_frames or request.max_frames
        self.limit_samples = frames * SAMPLES_PER_FRAME if frames else None
        self.channel = ChunkChannel()
        self.ticket: Ticket[EspeakStream] | None = None  # its admission (set by the engine's open)
        self.samples_out = 0  # utterance samples sent so far (worker thread)
        self.first_audio_at: float | None = None  # monotonic time of its first samples
        self.scheduled = False  # in the ready queue or being served (under the engine's lock)
        self.stopped = False  # cancelled, failed, finished or at its length limit
        self._engine = engine
        self._pieces: deque[tuple[TextSegment, int, int]] = deque()
        self.text_closed = False

    # -- SynthesisStream (event loop) ------------------------------------------------------------
    def push(self, segment: TextSegment) -> None:
        if self.text_closed:
            raise InvalidRequest("text pushed after close_text()")
        with self._engine._cond:
            self._pieces.extend((segment, a, b) for a, b in split_sentences(segment.text))
            self._engine._schedule(self)

    def close_text(self) -> None:
        with self._engine._cond:
            self.text_closed = True
            self._engine._schedule(self)

    def cancel(self) -> None:
        self.stopped = True
        self.channel.close()
        with self._engine._cond:
            self._engine._retire(self)

    def listen(self, listener: ChunkListener) -> bool:
        self.channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self.channel.__aiter__()

    def queue_position(self) -> QueuePosition | None:
        with self._engine._cond:
            return None if self.ticket is None else self._engine.admission.position(self.ticket)

    def queue_wait_s(self) -> float:
        return 0.0 if self.ticket is None else self.ticket.waited_s

    # -- worker side --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        if self.stopped:
            return False
        return bool(self._pieces) or self.reached_limit() or self.text_closed

    def has_pieces(self) -> bool:
        return bool(self._pieces)

    def take_piece(self) -> tuple[TextSegment, int, int] | None:
        """The next sentence; None means finish (all text spoken, or the length limit reached)."""
        if self.reached_limit():
            self._pieces.clear()
        return self._pieces.popleft() if self._pieces else None

    def language_for(self, segment: TextSegment, text: str) -> str:
        if segment.language and segment.language != "Auto":
            return LANGUAGES.get(segment.language, segment.language)
        return self.language or script_language(text)

    def reached_limit(self) -> bool:
        return self.limit_samples is not None and self.samples_out >= self.limit_samples

    def deadline(self, ttfa_target_s: float) -> float:
        """When it needs more audio (monotonic): its listener runs dry then, or its first audio
        is due."""
        if self.first_audio_at is None:
            admitted = self.ticket.admitted_at if self.ticket is not None else None
            return (time.monotonic() if admitted is None else admitted) + ttfa_target_s
        return self.first_audio_at + self.samples_out / SAMPLE_RATE

    def emit(self, samples: npt.NDArray[np.float32], words: tuple[WordTiming, ...] = ()) -> None:
        if len(samples) and self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        if len(samples) or words:
            self.channel.put(AudioChunk(self.request_id, samples, self.samples_out, words))
            self.samples_out += len(samples)

    def finish(self) -> None:
        """All text spoken: pad to forced_frames if asked, then the final chunk."""
        if self.request.forced_frames and self.limit_samples is not None:
            while self.samples_out < self.limit_samples:
                pad = min(SAMPLE_RATE, self.limit_samples - self.samples_out)
                self.emit(np.zeros(pad, np.float32))
        self.stopped = True
        self.channel.put(AudioChunk(self.request_id, np.zeros(0, np.float32), self.samples_out, final=True))

    def abort(self, error: BaseException) -> None:
        self.stopped = True
        self.channel.fail(error)


class _SynthCall:
    """One espeak_Synth call of one stream: resampling, word tracking, holding back audio."""

    def __init__(self, stream: EspeakStream, segment: TextSegment, offset: int, text: str, rate: int):
        self.stream = stream
        self.segment = segment
        self.offset = offset  # of the call's text in segment.text
        self.text = text
        self.origin = stream.samples_out
        self.produced = self.origin  # utterance sample after the last resampled one
        # fresh per call: every sentence ends in eSpeak's pause, so nothing is cut at the seam,
        # and flushing at the end of a call sends the whole sentence without waiting for more text
        self._resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
        self._tracker = WordTracker(text, self.origin)
        self._pending = np.zeros(0, np.float32)  # produced, not yet sent; starts at stream.samples_out

    def on_chunk(self, pcm: npt.NDArray[np.int16], events: list[WordEvent]) -> bool:
        if self.stream.stopped:
            return True
        if len(pcm):
            self._add(self._resampler.resample_chunk(pcm.astype(np.float32) / 32768.0, last=False))
        spans: list[TimedSpan] = []
        for event in events:
            spans += self._tracker.on_event(event.position, self.origin + event.ms * SAMPLE_RATE // 1000)
        open_from = self._tracker.open_from
        self._send(self.produced if open_from is None else min(open_from, self.produced), spans)
        return self.stream.reached_limit()

    def finish(self, pause_samples: int) -> None:
        self._add(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        self._add(np.zeros(pause_samples, np.float32))
        self._send(self.produced, self._tracker.finish(self.produced))

    def _add(self, samples: npt.NDArray[np.float32]) -> None:
        if len(samples):
            self._pending = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
            self.produced += len(samples)

    def _send(self, upto: int, spans: list[TimedSpan]) -> None:
        stream = self.stream
        start = stream.samples_out
        if stream.limit_samples is not None:
            upto = min(upto, stream.limit_samples)
        count = max(0, min(upto - start, len(self._pending)))
        words = tuple(self._word(span, start) for span in spans if self._in_limit(span))
        samples, self._pending = self._pending[:count], self._pending[count:]
        stream.emit(samples, words)

    def _in_limit(self, span: TimedSpan) -> bool:
        limit = self.stream.limit_samples
        return limit is None or span.start_sample < limit

    def _word(self, span: TimedSpan, pending_at: int) -> WordTiming:
        end = self._trimmed_end(span, pending_at)
        if self.stream.limit_samples is not None:
            end = min(end, self.stream.limit_samples)
        segment, a, b = self.segment, self.offset + span.start_char, self.offset + span.end_char
        return WordTiming(
            text=segment.text[a:b],
            start_sample=span.start_sample,
            end_sample=end,
            char_start=segment.source_offset(a),
            char_end=segment.source_offset(b - 1) + 1,
            source="engine",
        )

    def _trimmed_end(self, span: TimedSpan, pending_at: int) -> int:
        """Pull a word's end back from the pause after it to its last loud sample."""
        lo = max(span.start_sample, pending_at) - pending_at
        hi = min(span.end_sample - pending_at, len(self._pending))
        if hi <= lo:
            return span.end_sample
        loud = np.flatnonzero(np.abs(self._pending[lo:hi]) > SILENCE_LEVEL)
        if not len(loud):
            return span.end_sample
        return min(span.end_sample, pending_at + lo + int(loud[-1]) + 1 + END_HANGOVER)
