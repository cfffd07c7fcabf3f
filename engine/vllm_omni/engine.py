"""vLLM-Omni as a Cadence engine: put the gateway in front of an existing vLLM-Omni Qwen3-TTS server.

Transport. Each stream holds one WebSocket to `/v1/audio/speech/stream` (session.config with
`stream_audio=true`, `response_format="pcm"`); every text segment is sent as `input.text` +
`input.done`, and its audio comes back as `audio.start`, binary s16le PCM frames (or base64
`audio.chunk` frames when the upstream's forced aligner gives word timestamps), `audio.done` and
`session.done`. Segments go one at a time: vLLM-Omni synthesises a connection's utterances in
order, so sending ahead would only save one round trip. Where the WebSocket route is absent
(HTTP 403/404 on the handshake) the engine switches to `POST /v1/audio/speech` with
`stream=true, stream_format="audio"`; a request with speed != 1 always goes that way (the
WebSocket stream refuses other speeds).

Capacity. At most `max_streams` segments are generating upstream at once (set it at or below the
server's `--max-num-seqs`: vLLM-Omni crashes instead of queueing beyond it). Streams are admitted
by the upstream's measured cost (engine.admission): each segment's wall time over its audio is
measured against the segments generating at once, and once that passes `UPSTREAM_HEADROOM` at some
concurrency, fewer streams are admitted than `max_streams`. The rest wait in a bounded queue
(`queue_limit`, FIFO within priority), or `open()` raises Overloaded.

Failures. A cancel closes the upstream socket (or HTTP response) at once. Upstream error messages
and HTTP statuses map to engine.api errors. A connection lost before a segment's first audio is
retried with exponential backoff; one lost in mid-sentence fails the stream (its audio cannot be
resumed). A background probe of `/health` (fast backoff while down) drives `load().ready`, so the
gateway's `/readyz` follows the upstream; while it is down `open()` raises Overloaded.

Word timings come from the upstream aligner when `word_timestamps` is on (source "aligner"),
otherwise they are estimated per segment by character count once its audio is complete.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import random
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx
import numpy as np
import numpy.typing as npt
import soundfile
import soxr
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from engine.admission import Admission, LoadCurve, Ticket
from engine.api import (
    AudioChunk,
    ChunkListener,
    EngineError,
    EngineInfo,
    EngineLoad,
    InvalidAudio,
    InvalidRequest,
    Overloaded,
    Priority,
    QueuePosition,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    UnknownVoice,
    WordTiming,
)
from engine.bridge import ChunkChannel

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000  # Qwen3-TTS's native rate; other upstream rates are resampled to it
SAMPLES_PER_FRAME = 1_920  # one 12.5 Hz codec frame = one upstream "token"
LANGUAGES = (
    "Auto",
    "Chinese",
    "English",
    "Japanese",
    "Korean",
    "German",
    "French",
    "Russian",
    "Portuguese",
    "Spanish",
    "Italian",
)
MAX_INSTRUCTIONS = 500
REF_AUDIO_SECONDS = (1.0, 30.0)
WS_PATH = "/v1/audio/speech/stream"
HTTP_PATH = "/v1/audio/speech"

Transport = Literal["auto", "websocket", "http"]


@dataclass(frozen=True, slots=True)
class VllmOmniConfig:
    upstream: str = "http://127.0.0.1:8091"  # the vLLM-Omni server's base URL
    model: str | None = None  # sent as "model"; None: the server's only model
    transport: Transport = "auto"  # auto: WebSocket, HTTP where the WebSocket route is absent
    max_streams: int = 8  # concurrent upstream generations; keep <= the server's --max-num-seqs
    queue_limit: int = 64  # streams waiting for a slot before open() raises Overloaded
    default_voice: str | None = None  # None: the server's default speaker
    voices: tuple[str, ...] = ()  # known voices; empty: asked from GET /v1/audio/voices
    task_type: str | None = None  # "CustomVoice" | "VoiceDesign" | "Base"; None: inferred upstream
    word_timestamps: bool = False  # the server runs --forced-aligner: ask for aligned word times
    initial_codec_chunk_frames: int | None = None  # per-request first-chunk size (TTFA)
    connect_timeout_s: float = 5.0
    first_audio_timeout_s: float = 60.0  # from input.done to the segment's first audio
    stall_timeout_s: float = 30.0  # between two upstream messages once audio flows
    reconnect_attempts: int = 3  # per segment, before its first audio
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    health_interval_s: float = 5.0  # probe period while the upstream is up
    api_key: str | None = None  # sent as a Bearer token (vllm serve --api-key)

    @property
    def ws_url(self) -> str:
        base = self.upstream.rstrip("/")
        return (
            "wss://" + base[8:] if base.startswith("https://") else "ws://" + base.removeprefix("http://")
        ) + WS_PATH


# -- error mapping ---------------------------------------------------------------------------------

_GENERATION_PREFIX = re.compile(r"^Generation failed for utterance \d+, sentence \d+:\s*")
_CRASH = re.compile(
    r"EngineDead|EngineCore|engine (is )?dead|ref_context_size|CUDA error|out of memory", re.I
)
_BUSY = re.compile(r"too many|overload|capacity|queue (is )?full|rate limit|try again", re.I)
_VOICE = re.compile(r"\b(voice|speaker)\b", re.I)
_NOT_FOUND = re.compile(r"invalid|unknown|not (found|supported|available)|unsupported|supported", re.I)
_NO_ALIGNER = re.compile(r"forced.aligner", re.I)
_BAD_AUDIO = re.compile(r"ref_audio|reference audio|audio duration", re.I)


def upstream_error(message: str, status: int | None = None, retry_after_s: float = 1.0) -> EngineError:
    """An engine.api error for an upstream error message (and HTTP status, where there is one)."""
    text = _GENERATION_PREFIX.sub("", message).strip() or "no message"
    if status == 429 or (status == 503 and not _CRASH.search(text)) or _BUSY.search(text):
        return Overloaded(f"vLLM-Omni is busy: {text}", retry_after_s=retry_after_s)
    if _CRASH.search(text) or (status is not None and status >= 500):
        return UpstreamCrashed(f"vLLM-Omni failed: {text}")
    if _VOICE.search(text) and _NOT_FOUND.search(text):
        return UnknownVoice(f"vLLM-Omni: {text}")
    if _BAD_AUDIO.search(text):
        return InvalidAudio(f"vLLM-Omni: {text}")
    if status in (400, 404, 422) or re.search(r"invalid|requires|must|expected|too (large|long)", text, re.I):
        return InvalidRequest(f"vLLM-Omni: {text}")
    return EngineError(f"vLLM-Omni: {text}")


class UpstreamCrashed(EngineError):
    """The upstream engine died (e.g. more concurrent requests than its --max-num-seqs)."""


class UpstreamLost(EngineError):
    """The connection to the upstream broke."""


def _http_error_message(body: bytes) -> str:
    """The message of a vLLM / FastAPI error body ({"error": {"message"}}, {"message"}, {"detail"})."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


# -- audio helpers ---------------------------------------------------------------------------------


def wav_data_url(audio: npt.NDArray[np.float32], sample_rate: int) -> str:
    """A reference clip as the `data:audio/wav;base64,...` URL vLLM-Omni accepts for ref_audio."""
    clip = np.asarray(audio, dtype=np.float32).reshape(-1)
    if not len(clip) or not np.all(np.isfinite(clip)):
        raise InvalidAudio("the reference clip is empty or not finite")
    seconds = len(clip) / sample_rate
    if not REF_AUDIO_SECONDS[0] <= seconds <= REF_AUDIO_SECONDS[1]:
        raise InvalidAudio(
            f"vLLM-Omni takes reference clips of {REF_AUDIO_SECONDS[0]:g}..{REF_AUDIO_SECONDS[1]:g} s,"
            f" got {seconds:.2f} s"
        )
    if sample_rate > SAMPLE_RATE:  # keeps a 30 s clip well under the 4 MB session.config limit
        clip, sample_rate = soxr.resample(clip, sample_rate, SAMPLE_RATE).astype(np.float32), SAMPLE_RATE
    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(clip, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class _PcmDecoder:
    """s16le bytes (split anywhere) -> float32 at SAMPLE_RATE."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self._odd = b""
        self._resampler = (
            None
            if sample_rate == SAMPLE_RATE
            else soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32")
        )

    def feed(self, data: bytes) -> npt.NDArray[np.float32]:
        data = self._odd + data
        whole = len(data) // 2 * 2
        self._odd = data[whole:]
        samples = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=False)
        return samples

    def flush(self) -> npt.NDArray[np.float32]:
        if self._resampler is None:
            return np.zeros(0, np.float32)
        tail: npt.NDArray[np.float32] = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        return tail


def _is_cjk(ch: str) -> bool:
    return "\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af"


def _word_spans(text: str) -> list[tuple[int, int]]:
    """Whitespace-separated words; CJK characters each their own word."""
    spans: list[tuple[int, int]] = []
    for match in re.finditer(r"\S+", text):
        a, b = match.span()
        if any(_is_cjk(c) for c in text[a:b]):
            run = a
            for i in range(a, b):
                if _is_cjk(text[i]):
                    if run < i:
                        spans.append((run, i))
                    spans.append((i, i + 1))
                    run = i + 1
            if run < b:
                spans.append((run, b))
        else:
            spans.append((a, b))
    return spans


def estimate_words(segment: TextSegment, start_sample: int, samples: int) -> list[WordTiming]:
    """Spread a segment's words over its audio in proportion to their characters."""
    spans = _word_spans(segment.text)
    chars = sum(b - a for a, b in spans)
    if not spans or samples <= 0:
        return []
    words, done = [], 0
    for a, b in spans:
        s0 = start_sample + samples * done // chars
        done += b - a
        words.append(
            WordTiming(
                segment.text[a:b],
                s0,
                start_sample + samples * done // chars,
                segment.source_offset(a),
                segment.source_offset(b - 1) + 1,
                "estimate",
            )
        )
    return words


def aligned_words(segment: TextSegment, start_sample: int, stamps: list[dict[str, Any]]) -> list[WordTiming]:
    """The upstream aligner's [{word, start_ms, end_ms}] (segment-relative) on the utterance timeline,
    each word found in the segment's text from where the previous one ended."""
    text, lowered, cursor = segment.text, segment.text.lower(), 0
    words: list[WordTiming] = []
    for stamp in stamps:
        word = str(stamp.get("word", "")).strip()
        at = lowered.find(word.lower(), cursor) if word else -1
        if at < 0:
            continue
        cursor = at + len(word)
        start = start_sample + round(float(stamp.get("start_ms", 0)) * SAMPLE_RATE / 1000)
        end = max(start, start_sample + round(float(stamp.get("end_ms", 0)) * SAMPLE_RATE / 1000))
        words.append(
            WordTiming(
                text[at:cursor],
                start,
                end,
                segment.source_offset(at),
                segment.source_offset(cursor - 1) + 1,
                "aligner",
            )
        )
    return words


# -- capacity --------------------------------------------------------------------------------------
UPSTREAM_HEADROOM = 0.8  # a segment's wall time over its audio, at most, for the streams admitted


class _Slots:
    """`capacity` upstream generations at once; waiters served by priority, FIFO within one
    (a stream that already produced audio goes to the front of its priority)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active = 0
        self._waiters: dict[Priority, deque[asyncio.Future[None]]] = {p: deque() for p in Priority}

    def queued(self) -> int:
        return sum(len(q) for q in self._waiters.values())

    async def acquire(self, priority: Priority, resuming: bool) -> None:
        if self.active < self.capacity and not self.queued():
            self.active += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiters[priority]
        queue.appendleft(waiter) if resuming else queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as we gave up
            elif waiter in queue:
                queue.remove(waiter)
            raise

    def release(self) -> None:
        for priority in Priority:
            queue = self._waiters[priority]
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot passes on; active stays the same
                    return
        self.active -= 1


# -- upstream health -------------------------------------------------------------------------------


@dataclass
class _Health:
    up: bool = False
    problem: str = "not probed yet"
    failures: int = 0  # consecutive failed probes
    next_probe_at: float = 0.0  # monotonic time
    probes: int = 0
    outages: int = 0


def backoff_s(attempt: int, initial: float, largest: float) -> float:
    """Exponential backoff with +-20 % jitter; attempt 1 waits about `initial`."""
    base = min(largest, initial * 2.0 ** max(0, attempt - 1))
    return float(base * random.uniform(0.8, 1.2))


# -- the engine ------------------------------------------------------------------------------------


@dataclass
class _Voice:
    """What session.config says about the voice."""

    fields: dict[str, Any] = field(default_factory=dict)


class VllmOmniEngine:
    """engine.api.Engine backed by a vLLM-Omni server."""

    def __init__(self, config: VllmOmniConfig | None = None) -> None:
        self.config = config or VllmOmniConfig()
        self.info = EngineInfo(
            name="vllm-omni",
            model=self.config.model or "vLLM-Omni (not reached yet)",
            sample_rate=SAMPLE_RATE,
            voices=self.config.voices,
            languages=LANGUAGES,
            default_voice=self.config.default_voice,
        )
        self.transport: Literal["websocket", "http"] = (
            "http" if self.config.transport == "http" else "websocket"
        )
        self.health = _Health()
        self.word_timestamps = self.config.word_timestamps  # off once the upstream says it has no aligner
        self.reconnects = 0
        self._slots = _Slots(self.config.max_streams)
        self.cost = LoadCurve(probe_factor=1.25, probe_rows=2)  # upstream RTF by segments generating
        self.admission: Admission[VllmOmniStream] = Admission(
            self.config.max_streams, self.config.queue_limit, capacity=self._measured_capacity
        )
        self._streams: set[VllmOmniStream] = set()
        self._cloned: dict[str, _Voice] = {}
        self._http: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._probe_now = asyncio.Event()
        self._running = False

    # -- Engine --------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._running:
            return
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        self._http = httpx.AsyncClient(
            base_url=self.config.upstream.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(self.config.stall_timeout_s, connect=self.config.connect_timeout_s),
        )
        self._probe_now = asyncio.Event()
        self._running = True
        if time.monotonic() >= self.health.next_probe_at:  # a restart while down keeps the backoff
            await self._probe()
        self._monitor = asyncio.create_task(self._watch(), name="vllm-omni-health")

    async def stop(self) -> None:
        self._running = False
        for stream in list(self._streams):
            stream.abort(EngineError("engine stopped"))
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        tasks = [s.task for s in self._streams if s.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def load(self) -> EngineLoad:
        figures = self.admission.figures()
        return EngineLoad(
            active=self._slots.active,
            queued=figures.queued + self._slots.queued(),
            capacity=figures.capacity,
            queue_limit=figures.queue_limit,
            admission=figures,
            ready=self._running and self.health.up,
            extra={
                "upstream_up": float(self.health.up),
                "upstream_outages": float(self.health.outages),
                "upstream_reconnects": float(self.reconnects),
                "transport_http": float(self.transport == "http"),
                "open_streams": float(len(self._streams)),
            },
        )

    def open(self, request: SynthesisRequest) -> VllmOmniStream:
        if not self._running:
            raise EngineError("the vllm-omni engine is not running")
        if not self.health.up:
            raise Overloaded(
                f"vLLM-Omni upstream unavailable ({self.health.problem})",
                retry_after_s=max(0.5, self.health.next_probe_at - time.monotonic()),
            )
        if not 0.25 <= request.speed <= 4.0:
            raise InvalidRequest("speed must be within 0.25..4")
        if request.instructions and len(request.instructions) > MAX_INSTRUCTIONS:
            raise InvalidRequest(f"instructions are limited to {MAX_INSTRUCTIONS} characters upstream")
        self._check_language(request.language)
        fields = {**self._voice_fields(request), **self._common_fields(request)}
        stream = VllmOmniStream(self, request, fields)
        stream.ticket = self.admission.arrive(stream, request.priority, request.max_wait_s)  # or Overloaded
        self._streams.add(stream)
        if stream.ticket.admitted_at is not None:
            stream.start()
        elif request.max_wait_s is not None:
            self._arm_expiry()
        return stream

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        """Keep the clip; every request in this voice carries it as ref_audio (task_type Base)."""
        url = await asyncio.to_thread(wav_data_url, audio, sample_rate)
        fields: dict[str, Any] = {"task_type": "Base", "ref_audio": url}
        if text:
            fields["ref_text"] = text
        else:
            fields["x_vector_only_mode"] = True  # no transcript: speaker embedding only
        self._cloned[voice_id] = _Voice(fields)

    async def unregister_voice(self, voice_id: str) -> None:
        self._cloned.pop(voice_id, None)

    # -- request -> session.config fields --------------------------------------------------------------
    def _check_language(self, language: str | None) -> None:
        if language and language not in LANGUAGES:
            raise InvalidRequest(f"unknown language {language!r}; vLLM-Omni takes {', '.join(LANGUAGES)}")

    def _voice_fields(self, request: SynthesisRequest) -> dict[str, Any]:
        if request.ref_audio is not None:
            fields: dict[str, Any] = {"task_type": "Base", "ref_audio": wav_data_url(*request.ref_audio)}
            if request.ref_text:
                fields["ref_text"] = request.ref_text
            else:
                fields["x_vector_only_mode"] = True
            return fields
        voice = request.voice or self.config.default_voice
        if voice is None:
            return {"task_type": self.config.task_type} if self.config.task_type else {}
        if voice in self._cloned:
            return dict(self._cloned[voice].fields)
        known = {v.lower() for v in self.info.voices}
        if known and voice.lower() not in known:
            raise UnknownVoice(f"unknown voice {voice!r}; vLLM-Omni has {', '.join(self.info.voices)}")
        fields = {"voice": voice}
        if self.config.task_type:
            fields["task_type"] = self.config.task_type
        return fields

    def _common_fields(self, request: SynthesisRequest) -> dict[str, Any]:
        fields: dict[str, Any] = {"language": request.language or "Auto"}
        if self.config.model:
            fields["model"] = self.config.model
        if request.instructions:
            fields["instructions"] = request.instructions
        if request.seed is not None:
            fields["seed"] = request.seed
        frames = request.forced_frames or request.max_frames
        if frames:
            fields["max_new_tokens"] = frames
        if self.config.initial_codec_chunk_frames is not None:
            fields["initial_codec_chunk_frames"] = self.config.initial_codec_chunk_frames
        return fields

    # -- upstream health -----------------------------------------------------------------------------
    def suspect(self) -> None:
        """Something failed talking to the upstream: probe it now."""
        self._probe_now.set()

    def mark_down(self, problem: str) -> None:
        if self.health.up:
            self.health.outages += 1
            log.warning("vLLM-Omni upstream down: %s", problem)
        self.health.up = False
        self.health.problem = problem
        self.suspect()

    async def _watch(self) -> None:
        while True:
            delay = max(0.0, self.health.next_probe_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_now.wait(), delay)
            self._probe_now.clear()
            await self._probe()

    async def _probe(self) -> None:
        assert self._http is not None
        self.health.probes += 1
        try:
            response = await self._http.get("/health", timeout=self.config.connect_timeout_s)
            problem = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            problem = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
        now = time.monotonic()
        if problem is None:
            was_up, self.health.up, self.health.failures = self.health.up, True, 0
            self.health.problem = ""
            self.health.next_probe_at = now + self.config.health_interval_s
            if not was_up:
                log.info("vLLM-Omni upstream %s is up", self.config.upstream)
                await self._discover()
            return
        if self.health.up:
            self.health.outages += 1
            log.warning("vLLM-Omni upstream down: %s", problem)
        self.health.up, self.health.problem = False, problem
        self.health.failures += 1
        self.health.next_probe_at = now + backoff_s(
            self.health.failures, self.config.backoff_initial_s, self.config.backoff_max_s
        )

    async def _discover(self) -> None:
        """The served model's name and the voice list, where the server says them."""
        assert self._http is not None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
            if not self.config.model:
                models = (await self._http.get("/v1/models")).json()
                self.info = replace(self.info, model=str(models["data"][0]["id"]))
        if self.config.voices:
            return
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = await self._http.get("/v1/audio/voices")
            if response.status_code == 200:
                voices = _voice_names(response.json())
                if voices:
                    self.info = replace(self.info, voices=voices)

    # -- used by streams -------------------------------------------------------------------------------
    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise EngineError("the vllm-omni engine is not running")
        return self._http

    def websocket_absent(self) -> None:
        if self.transport != "http":
            log.warning(
                "vLLM-Omni at %s has no %s; streaming over POST %s instead",
                self.config.upstream,
                WS_PATH,
                HTTP_PATH,
            )
        self.transport = "http"

    def aligner_absent(self) -> None:
        if self.word_timestamps:
            log.warning(
                "vLLM-Omni at %s runs without --forced-aligner: word times are estimated",
                self.config.upstream,
            )
        self.word_timestamps = False

    def forget(self, stream: VllmOmniStream) -> None:
        self._streams.discard(stream)
        if stream.ticket is not None and not stream.ticket.done:
            self.admission.leave(stream.ticket)
            for ticket in self.admission.admit_waiting() if self._running else ():
                ticket.item.start()

    # -- admission ---------------------------------------------------------------------------------------
    def _measured_capacity(self) -> int:
        """`max_streams` until a concurrency is measured over the headroom, then what the measured
        cost admits."""
        if all(cost <= UPSTREAM_HEADROOM for _, cost in self.cost.curve()):
            return self.config.max_streams
        return self.cost.rows_within(UPSTREAM_HEADROOM, self.config.max_streams)

    def measured(self, generating: int, wall_s: float, audio_s: float) -> None:
        """A segment took `wall_s` for `audio_s` of audio with `generating` segments upstream."""
        if audio_s > 0:
            self.cost.observe(generating, wall_s / audio_s)

    def _expire(self) -> None:
        for ticket in self.admission.expire():
            ticket.item.abort(self.admission.expired_error(ticket))
        self._arm_expiry()

    def _arm_expiry(self) -> None:
        if self._running:
            self.admission.arm_expiry(asyncio.get_running_loop(), self._expire)


def _voice_names(data: Any) -> tuple[str, ...]:
    """GET /v1/audio/voices: {"voices": [names or {"name"|"id"}], "uploaded_voices": [...]} or a list."""
    items: list[Any] = []
    if isinstance(data, dict):
        for key in ("voices", "uploaded_voices", "data"):
            if isinstance(data.get(key), list):
                items += data[key]
    elif isinstance(data, list):
        items = data
    names: list[str] = []
    for item in items:
        name = (
            item
            if isinstance(item, str)
            else (item.get("name") or item.get("id"))
            if isinstance(item, dict)
            else None
        )
        if isinstance(name, str) and name not in names:
            names.append(name)
    return tuple(names)


# -- one stream ------------------------------------------------------------------------------------


class _Retry(Exception):
    """The connection broke before the segment's first audio: try it again."""


class VllmOmniStream(SynthesisStream):
    """One utterance: segments go upstream one by one, PCM comes back as AudioChunks."""

    def __init__(self, engine: VllmOmniEngine, request: SynthesisRequest, fields: dict[str, Any]) -> None:
        self.request_id = request.request_id
        self.request = request
        self.channel = ChunkChannel()
        self.samples_out = 0
        self.task: asyncio.Task[None] | None = None
        self._engine = engine
        self._fields = fields  # session.config / request body fields, bar the per-segment language
        self._segments: deque[TextSegment] = deque()
        self._wake = asyncio.Event()
        self._text_closed = False
        self._stopped = False
        self._ws: ClientConnection | None = None
        self._ws_config: tuple[str, bool] | None = None  # (language, word_timestamps) sent
        self.ticket: Ticket[VllmOmniStream] | None = None  # its admission (set by the engine's open)

    # -- SynthesisStream -------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"vllm-omni {self.request_id}")
        # a task cancelled before its first step never enters _run (nor its cleanup): the place
        # is given back here too (forget does it once)
        self.task.add_done_callback(lambda _: self._engine.forget(self))

    def push(self, segment: TextSegment) -> None:
        if self._text_closed:
            raise InvalidRequest("text pushed after close_text()")
        if segment.language and segment.language != "Auto":
            self._engine._check_language(segment.language)
        if segment.text.strip():
            self._segments.append(segment)
            self._wake.set()

    def close_text(self) -> None:
        self._text_closed = True
        self._wake.set()

    def cancel(self) -> None:
        """Stop at once: the upstream socket (or response) is closed by the task's cleanup."""
        if self._stopped:
            return
        self._stopped = True
        self.channel.close()
        self._drop_connection()
        if self.task is not None:
            self.task.cancel()
        else:  # still queued: no task of its own to leave the engine
            self._engine.forget(self)

    def listen(self, listener: ChunkListener) -> bool:
        self.channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self.channel.__aiter__()

    def queue_position(self) -> QueuePosition | None:
        return None if self.ticket is None else self._engine.admission.position(self.ticket)

    def queue_wait_s(self) -> float:
        return 0.0 if self.ticket is None else self.ticket.waited_s

    def abort(self, error: EngineError) -> None:
        if not self._stopped:
            self._stopped = True
            self.channel.fail(error)
            self._drop_connection()
            if self.task is not None:
                self.task.cancel()
            else:  # still queued: no task of its own to leave the engine
                self._engine.forget(self)

    # -- the stream's task -------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                if not self._segments:
                    if self._text_closed:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._engine._slots.acquire(self.request.priority, resuming=self.samples_out > 0)
                try:
                    while self._segments:
                        began, samples = time.monotonic(), self.samples_out
                        generating = self._engine._slots.active
                        await self._speak(self._segments[0])
                        self._engine.measured(
                            generating, time.monotonic() - began, (self.samples_out - samples) / SAMPLE_RATE
                        )
                        self._segments.popleft()
                finally:
                    self._engine._slots.release()
            self._stopped = True
            self._engine.forget(self)  # done for admission; the socket closes below
            self.channel.put(
                AudioChunk(self.request_id, np.zeros(0, np.float32), self.samples_out, final=True)
            )
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            error = exc if isinstance(exc, EngineError) else EngineError(f"vllm-omni: {exc}")
            if not self._stopped:
                self._stopped = True
                self.channel.fail(error)
        finally:
            await self._close_connection()
            self._engine.forget(self)

    async def _speak(self, segment: TextSegment) -> None:
        """One segment, retried on a fresh connection while none of its audio has been sent."""
        config = self._engine.config
        last = "no attempt made"
        for attempt in range(config.reconnect_attempts + 1):
            if attempt:
                self._engine.reconnects += 1
                await asyncio.sleep(backoff_s(attempt, config.backoff_initial_s, config.backoff_max_s))
            try:
                if self._engine.transport == "websocket" and self.request.speed == 1.0:
                    await self._speak_ws(segment)
                else:
                    await self._speak_http(segment)
                return
            except _Retry as problem:
                last = str(problem)
                await self._close_connection()
                self._engine.suspect()
        self._engine.mark_down(last)
        raise UpstreamLost(f"vLLM-Omni unreachable after {config.reconnect_attempts + 1} attempts: {last}")

    # -- WebSocket --------------------------------------------------------------------------------------
    async def _connection(self, language: str) -> ClientConnection | None:
        """The open session with `language` configured; None where the server has no WebSocket route."""
        config = self._engine.config
        if self._ws is None:
            headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
            try:
                self._ws = await websockets.connect(
                    config.ws_url,
                    open_timeout=config.connect_timeout_s,
                    close_timeout=1.0,
                    max_size=None,
                    ping_interval=None,
                    additional_headers=headers,
                )
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (403, 404):
                    self._engine.websocket_absent()
                    return None
                if status in (429, 503):
                    raise upstream_error(f"WebSocket handshake answered {status}", status) from exc
                raise _Retry(f"WebSocket handshake answered {status}") from exc
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                raise _Retry(f"cannot connect: {exc.__class__.__name__}: {exc}") from exc
            self._ws_config = None
        wanted = (language, self._engine.word_timestamps)
        if self._ws_config != wanted:  # sticky upstream; replaced between utterances
            await self._send(
                {
                    "type": "session.config",
                    **self._fields,
                    "language": language,
                    "response_format": "pcm",
                    "stream_audio": True,
                    "split_granularity": "none",
                    "word_timestamps": self._engine.word_timestamps,
                }
            )
            self._ws_config = wanted
        return self._ws

    async def _send(self, message: dict[str, Any]) -> None:
        assert self._ws is not None
        try:
            await self._ws.send(json.dumps(message))
        except ConnectionClosed as exc:
            raise _Retry(f"connection closed while sending ({exc})") from exc

    async def _speak_ws(self, segment: TextSegment) -> None:
        language = (
            segment.language if segment.language and segment.language != "Auto" else self._fields["language"]
        )
        ws = await self._connection(language)
        if ws is None:
            return await self._speak_http(segment)
        await self._send({"type": "input.text", "text": segment.text})
        await self._send({"type": "input.done"})
        audio = _SegmentAudio(self, segment)
        error: str | None = None
        config = self._engine.config
        while True:
            timeout = config.stall_timeout_s if audio.samples else config.first_audio_timeout_s
            try:
                frame = await asyncio.wait_for(ws.recv(), timeout)
            except TimeoutError:
                self._drop_connection()
                raise EngineError(f"vLLM-Omni sent nothing for {timeout:g} s") from None
            except ConnectionClosed as exc:
                self._ws = None
                if error is not None:
                    raise self._failure(error) from exc
                if audio.samples:
                    self._engine.suspect()
                    raise UpstreamLost(f"vLLM-Omni closed the stream mid-sentence ({exc})") from exc
                raise _Retry(f"connection closed before audio ({exc})") from exc
            if isinstance(frame, bytes):
                audio.add_pcm(frame)
                continue
            message = json.loads(frame)
            kind = message.get("type")
            if kind == "audio.start":
                audio.begin(int(message.get("sample_rate") or SAMPLE_RATE))
            elif kind == "audio.chunk":
                audio.add_pcm(base64.b64decode(message.get("audio_b64") or ""))
                if isinstance(message.get("timestamps"), list):
                    audio.stamps = message["timestamps"]
            elif kind == "error":
                error = str(message.get("message", "error"))
            elif kind == "session.done":
                break
        if error is not None:
            if _NO_ALIGNER.search(error) and self._engine.word_timestamps and not audio.samples:
                self._engine.aligner_absent()
                return await self._speak_ws(segment)  # again, without word_timestamps
            raise self._failure(error)
        audio.finish()

    def _failure(self, message: str) -> EngineError:
        error = upstream_error(message)
        if isinstance(error, UpstreamCrashed):
            self._engine.mark_down(str(error))
        return error

    def _drop_connection(self) -> None:
        """Close the upstream socket now, without waiting for its closing handshake."""
        ws, self._ws = self._ws, None
        if ws is not None and ws.transport is not None:
            ws.transport.abort()

    async def _close_connection(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 1.0)

    # -- HTTP -------------------------------------------------------------------------------------------
    async def _speak_http(self, segment: TextSegment) -> None:
        language = (
            segment.language if segment.language and segment.language != "Auto" else self._fields["language"]
        )
        body = {
            **self._fields,
            "input": segment.text,
            "language": language,
            "response_format": "pcm",
            "stream": True,
            "stream_format": "audio",
            "speed": self.request.speed,
        }
        audio = _SegmentAudio(self, segment)
        try:
            async with self._engine.http.stream(
                "POST", HTTP_PATH, json=body, timeout=self._engine.config.first_audio_timeout_s
            ) as response:
                if response.status_code != 200:
                    message = _http_error_message(await response.aread())
                    retry_after = _retry_after(response.headers.get("retry-after"))
                    error = upstream_error(message, response.status_code, retry_after)
                    if isinstance(error, UpstreamCrashed):
                        self._engine.mark_down(str(error))
                    raise error
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    await self._read_sse(response, audio)
                else:
                    await self._read_raw(response, audio)
        except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
            if audio.samples:
                self._engine.suspect()
                raise UpstreamLost(
                    f"vLLM-Omni response broke mid-sentence ({exc.__class__.__name__})"
                ) from exc
            raise _Retry(f"{exc.__class__.__name__}: {exc}") from exc
        audio.finish()

    async def _read_raw(self, response: httpx.Response, audio: _SegmentAudio) -> None:
        head = b""
        async for data in response.aiter_bytes():
            if not audio.started:  # stream_format=audio with wav has a 44-byte header first
                head += data
                if len(head) < 44 and head[:4] in (b"RIFF", b"RIF", b"RI", b"R"):
                    continue
                audio.begin(SAMPLE_RATE)
                data, head = (head[44:] if head.startswith(b"RIFF") else head), b""
            audio.add_pcm(data)

    async def _read_sse(self, response: httpx.Response, audio: _SegmentAudio) -> None:
        """Older servers (or stream_format ignored): OpenAI speech.audio.* server-sent events."""
        audio.begin(SAMPLE_RATE)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            kind = event.get("type", "")
            if kind.endswith("audio.delta"):
                audio.add_pcm(base64.b64decode(event.get("audio") or event.get("delta") or ""))
            elif kind.endswith("error"):
                raise self._failure(str(event.get("error") or event.get("message") or event))
            elif kind.endswith("audio.done"):
                break


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


class _SegmentAudio:
    """One segment's audio as it arrives: decoded, sent on, words at the end."""

    def __init__(self, stream: VllmOmniStream, segment: TextSegment) -> None:
        self.stream = stream
        self.segment = segment
        self.origin = stream.samples_out
        self.samples = 0
        self.started = False
        self.stamps: list[dict[str, Any]] | None = None
        self._decoder = _PcmDecoder()

    def begin(self, sample_rate: int) -> None:
        if not self.started:
            self.started = True
            self._decoder = _PcmDecoder(sample_rate)

    def add_pcm(self, data: bytes) -> None:
        self.begin(SAMPLE_RATE)
        self._emit(self._decoder.feed(data))

    def finish(self) -> None:
        self._emit(self._decoder.flush())
        if self.stamps is not None:
            words = aligned_words(self.segment, self.origin, self.stamps)
        else:
            words = estimate_words(self.segment, self.origin, self.samples)
        if words:
            self.stream.channel.put(
                AudioChunk(
                    self.stream.request_id, np.zeros(0, np.float32), self.stream.samples_out, tuple(words)
                )
            )

    def _emit(self, samples: npt.NDArray[np.float32]) -> None:
        if len(samples) and not self.stream._stopped:
            stream = self.stream
            stream.channel.put(
                AudioChunk(stream.request_id, samples.astype(np.float32, copy=False), stream.samples_out)
            )
            stream.samples_out += len(samples)
            self.samples += len(samples)
