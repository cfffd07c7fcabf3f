"""The wire schema of `WS /v1/stream`, version 1 (see docs/protocol.md). Standard library only, so
that clients can import it without the server's dependencies.

Client messages decode into frozen dataclasses tagged with a `Literal` type; `decode()` is the one
entry point and raises `ProtocolError` carrying the protocol's error code. Server messages are
TypedDicts (they are built by the server and read by clients as plain JSON objects). Binary frames
are audio packets: a 12-byte little-endian header (`PacketHeader`) and the payload.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, NotRequired, TypedDict

PROTOCOL_VERSION: Final = 1

Encoding = Literal["pcm_s16le", "pcm_f32le", "mulaw", "alaw"]
ENCODINGS: Final[tuple[Encoding, ...]] = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw")
SAMPLE_RATES: Final = (8000, 16000, 22050, 24000, 44100, 48000)
PACKET_MS: Final = (10, 20, 40, 60, 80, 100)
TELEPHONY_ENCODINGS: Final = ("mulaw", "alaw")  # G.711: 8 kHz only
BYTES_PER_SAMPLE: Final[dict[Encoding, int]] = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}

Timestamps = Literal["word", "none"]
Pacing = Literal["asap", "realtime"]
Alignment = Literal["sync", "async"]  # with a forced aligner: audio waits for its words, or not
PositionSource = Literal["client", "report", "server", "marks"]  # "marks": Twilio's echoed marks
WordSource = Literal["aligner", "engine", "estimate"]

MAX_ID_CHARS: Final = 128

# Error codes sent in `error` messages (docs/protocol.md lists when each is used).
ErrorCode = Literal[
    "invalid_message",  # not JSON, not an object, a field of the wrong type or value
    "unknown_type",  # a `type` this server does not know
    "binary_not_supported",  # a binary frame from the client
    "unsupported_output",  # an encoding / rate / packet size the server does not offer
    "session_started",  # session.start after the session has begun
    "unknown_voice",
    "invalid_request",  # the engine refused the request's parameters
    "invalid_audio",
    "text_too_long",  # past max_text_chars, or more than the key's whole characters per minute
    "unknown_utterance",
    "utterance_closed",  # text for an utterance that has ended or been interrupted
    "utterance_exists",  # speak.resume into an id already used
    "not_interrupted",  # speak.resume from an utterance that was not interrupted
    "not_paused",  # speak.unpause of an utterance that is not paused
    "too_many_utterances",
    "quota_exceeded",  # a per-key or per-session limit on what is open or was opened
    "rate_limited",  # the key's characters per minute
    "overloaded",
    "shutting_down",
    "unauthorized",
    "call_not_found",  # Twilio control channel: no media stream for the callSid (or it has ended)
    "call_lost",  # Twilio control channel: the replica holding the call stopped answering
    "internal",
]
# errors that refuse one message about an utterance the engine has taken and leave it going
# (protocol.md); the same codes before its `utterance.started` refuse to open it. A session answers
# an utterance's opening append before it reads the next message, so `utterance.started` or the
# refusal comes first
MESSAGE_REFUSED_CODES: Final[frozenset[ErrorCode]] = frozenset(
    {"text_too_long", "rate_limited", "utterance_closed", "not_paused", "utterance_exists", "invalid_message"}
)


def whole_ms(seconds: float) -> int:
    """A wait as `retry_after_ms`: whole ms, rounded up, so a client that waits exactly this long is
    not early (the inner round keeps float noise, 700.0000000001, from adding a millisecond)."""
    return max(0, math.ceil(round(1000 * seconds, 6)))


class ProtocolError(Exception):
    """A client message the server cannot accept; answered with an `error`, the session goes on."""

    def __init__(self, code: ErrorCode, message: str, utterance_id: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.utterance_id = utterance_id


# -- client -> server -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutputRequest:
    """The client's wish for the audio format; None = the server's default."""

    encoding: Encoding | None = None
    sample_rate: int | None = None
    packet_ms: int | None = None


@dataclass(frozen=True, slots=True)
class SessionStart:
    type: Literal["session.start"] = "session.start"
    voice: str | None = None
    language: str | None = None
    instructions: str | None = None
    output: OutputRequest = OutputRequest()
    timestamps: Timestamps = "word"
    pacing: Pacing = "asap"
    webhook_url: str | None = None  # each utterance.interrupted is also POSTed here (signed)
    alignment: Alignment = "async"
    pause_timeout_ms: int | None = None  # a paused utterance is interrupted after this (None: the server's)


@dataclass(frozen=True, slots=True)
class SpeakAppend:
    utterance_id: str
    text: str
    flush: bool = False
    # benchmark option `"bench": {"forced_frames": N}`: the engine produces exactly N codec frames
    # (benchmarks with random weights, whose text does not end the audio); read on the utterance's
    # first append
    forced_frames: int | None = None
    # the longest the utterance may wait in the engine's queue for admission (ms; 0: admitted at
    # once or refused); read on its first append
    max_wait_ms: int | None = None
    type: Literal["speak.append"] = "speak.append"


@dataclass(frozen=True, slots=True)
class SpeakFlush:
    utterance_id: str
    type: Literal["speak.flush"] = "speak.flush"


@dataclass(frozen=True, slots=True)
class SpeakEnd:
    utterance_id: str
    type: Literal["speak.end"] = "speak.end"


@dataclass(frozen=True, slots=True)
class SpeakCancel:
    utterance_id: str | None = None  # None = every active utterance of the session
    played_ms: int | None = None
    type: Literal["speak.cancel"] = "speak.cancel"


@dataclass(frozen=True, slots=True)
class SpeakResume:
    utterance_id: str
    from_utterance: str
    type: Literal["speak.resume"] = "speak.resume"


@dataclass(frozen=True, slots=True)
class SpeakPause:
    utterance_id: str | None = None  # None = every active utterance of the session
    played_ms: int | None = None
    type: Literal["speak.pause"] = "speak.pause"


@dataclass(frozen=True, slots=True)
class SpeakUnpause:
    utterance_id: str | None = None  # None = every paused utterance of the session
    type: Literal["speak.unpause"] = "speak.unpause"


@dataclass(frozen=True, slots=True)
class PlaybackReport:
    utterance_id: str
    played_ms: int
    type: Literal["playback.report"] = "playback.report"


@dataclass(frozen=True, slots=True)
class SessionEnd:
    type: Literal["session.end"] = "session.end"


ClientMessage = (
    SessionStart
    | SpeakAppend
    | SpeakFlush
    | SpeakEnd
    | SpeakCancel
    | SpeakResume
    | SpeakPause
    | SpeakUnpause
    | PlaybackReport
    | SessionEnd
)


# -- server -> client -------------------------------------------------------------------------


class OutputInfo(TypedDict):
    encoding: Encoding
    sample_rate: int
    packet_ms: int
    samples_per_packet: int


class EngineInfoMessage(TypedDict):
    name: str
    model: str


class SessionStarted(TypedDict):
    type: Literal["session.started"]
    session_id: str
    output: OutputInfo
    engine: EngineInfoMessage


class UtteranceStarted(TypedDict):
    type: Literal["utterance.started"]
    utterance_id: str
    stream: int
    resumed_from: NotRequired[str]  # speak.resume: the interrupted utterance
    text_offset: NotRequired[int]  # speak.resume: where this text starts in that one's text


class UtteranceQueued(TypedDict):
    """The engine is at capacity: the utterance waits for admission (its audio comes later)."""

    type: Literal["utterance.queued"]
    utterance_id: str
    position: int  # 1: admitted next
    expected_wait_ms: int


class WordInfo(TypedDict):
    index: int
    text: str
    start_ms: int
    end_ms: int
    char_start: int
    char_end: int


@dataclass(frozen=True, slots=True)
class Word:
    """A word on the utterance's timeline, in ms, with its span in the client's text."""

    index: int
    text: str
    start_ms: int
    end_ms: int
    char_start: int
    char_end: int

    def to_wire(self) -> WordInfo:
        return {
            "index": self.index,
            "text": self.text,
            "start_ms": self.start_ms,
            "end_ms": self.end_ms,
            "char_start": self.char_start,
            "char_end": self.char_end,
        }


class Words(TypedDict):
    type: Literal["words"]
    utterance_id: str
    source: WordSource
    words: list[WordInfo]


class UtteranceDone(TypedDict):
    type: Literal["utterance.done"]
    utterance_id: str
    duration_ms: int
    packets: int
    queued_ms: NotRequired[int]  # how long it waited in the engine's queue, when it did


class UtteranceInterrupted(TypedDict):
    type: Literal["utterance.interrupted"]
    utterance_id: str
    played_ms: int
    position_source: PositionSource
    last_word: WordInfo | None
    partial_word: WordInfo | None
    spoken_text: str
    unspoken_text: str


class UtterancePaused(TypedDict):
    """speak.pause answered: the same report as utterance.interrupted, but the utterance goes on
    after speak.unpause (a fence until then)."""

    type: Literal["utterance.paused"]
    utterance_id: str
    played_ms: int
    position_source: PositionSource
    last_word: WordInfo | None
    partial_word: WordInfo | None
    spoken_text: str
    unspoken_text: str


class UtteranceUnpaused(TypedDict):
    type: Literal["utterance.unpaused"]
    utterance_id: str


class ErrorMessage(TypedDict):
    type: Literal["error"]
    code: ErrorCode
    message: str
    utterance_id: NotRequired[str]
    # overloaded, rate_limited: when a retry may be admitted; quota_exceeded for a key's count: a hint
    retry_after_ms: NotRequired[int]


class SessionEnded(TypedDict):
    type: Literal["session.ended"]


ServerMessage = (
    SessionStarted
    | UtteranceStarted
    | UtteranceQueued
    | Words
    | UtteranceDone
    | UtteranceInterrupted
    | UtterancePaused
    | UtteranceUnpaused
    | ErrorMessage
    | SessionEnded
)


def encode(message: Mapping[str, Any]) -> str:
    """A message as one compact JSON text frame."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


def encode_client(message: ClientMessage) -> str:
    """A client message as JSON (fields left at None are omitted)."""
    fields: dict[str, Any] = {"type": message.type}
    for name in message.__slots__:
        value = getattr(message, name)
        if name == "type" or value is None:
            continue
        if isinstance(value, OutputRequest):
            value = {k: getattr(value, k) for k in value.__slots__ if getattr(value, k) is not None}
        fields[name] = value
    return encode(fields)


# -- audio packets ----------------------------------------------------------------------------

_HEADER = struct.Struct("<BBHII")
HEADER_BYTES: Final = _HEADER.size  # 12
FLAG_LAST: Final = 0x01


@dataclass(frozen=True, slots=True)
class PacketHeader:
    stream: int
    seq: int
    sample_offset: int
    flags: int = 0
    version: int = PROTOCOL_VERSION

    @property
    def last(self) -> bool:
        return bool(self.flags & FLAG_LAST)

    def pack(self) -> bytes:
        return _HEADER.pack(
            self.version, self.flags, self.stream, self.seq & 0xFFFFFFFF, self.sample_offset & 0xFFFFFFFF
        )


def unpack_packet(frame: bytes) -> tuple[PacketHeader, bytes]:
    """Split a binary frame into its header and payload."""
    if len(frame) < HEADER_BYTES:
        raise ValueError(f"a packet has at least {HEADER_BYTES} bytes, got {len(frame)}")
    version, flags, stream, seq, offset = _HEADER.unpack_from(frame)
    return PacketHeader(stream, seq, offset, flags, version), frame[HEADER_BYTES:]


# -- decoding ---------------------------------------------------------------------------------


class _Fields:
    """Typed access to a raw message object; every failure is a ProtocolError."""

    def __init__(self, raw: dict[str, Any], kind: str) -> None:
        self.raw = raw
        self.kind = kind
        uid = raw.get("utterance_id")
        self.utterance_id = uid if isinstance(uid, str) else None

    def fail(self, message: str, code: ErrorCode = "invalid_message") -> ProtocolError:
        return ProtocolError(code, f"{self.kind}: {message}", self.utterance_id)

    def text(self, name: str, *, required: bool = False, max_chars: int | None = None) -> str | None:
        value = self.raw.get(name)
        if value is None:
            if required:
                raise self.fail(f"`{name}` is required")
            return None
        if not isinstance(value, str):
            raise self.fail(f"`{name}` must be a string")
        if not _is_valid_unicode(value):
            raise self.fail(f"`{name}` is not valid UTF-8 text")
        if max_chars is not None and not 0 < len(value) <= max_chars:
            raise self.fail(f"`{name}` must have 1 to {max_chars} characters")
        return value

    def ident(self, name: str) -> str:
        value = self.text(name, required=True, max_chars=MAX_ID_CHARS)
        assert value is not None
        return value

    def optional_ident(self, name: str) -> str | None:
        if self.raw.get(name) is None:
            return None
        return self.ident(name)

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"`{name}` must be true or false")
        return value

    def milliseconds(self, name: str, *, required: bool = False) -> int | None:
        value = self.raw.get(name)
        if value is None:
            if required:
                raise self.fail(f"`{name}` is required")
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise self.fail(f"`{name}` must be a number of milliseconds")
        if value < 0 or value > 2**31:
            raise self.fail(f"`{name}` must be between 0 and 2^31")
        return int(value)

    def choice(self, name: str, options: tuple[str, ...], default: str) -> str:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if value not in options:
            raise self.fail(f"`{name}` must be one of {', '.join(options)}")
        assert isinstance(value, str)
        return value


def _is_valid_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes
        return False
    return True


def validate_output(encoding: str, sample_rate: int, packet_ms: int) -> None:
    """Raise ProtocolError('unsupported_output') unless the server offers this format."""
    if encoding not in ENCODINGS:
        raise ProtocolError("unsupported_output", f"encoding must be one of {', '.join(ENCODINGS)}")
    if sample_rate not in SAMPLE_RATES:
        raise ProtocolError("unsupported_output", f"sample_rate must be one of {SAMPLE_RATES}")
    if encoding in TELEPHONY_ENCODINGS and sample_rate != 8000:
        raise ProtocolError("unsupported_output", f"{encoding} is 8000 Hz only")
    if packet_ms not in PACKET_MS:
        raise ProtocolError("unsupported_output", f"packet_ms must be one of {PACKET_MS}")


def _output_request(f: _Fields) -> OutputRequest:
    raw = f.raw.get("output")
    if raw is None:
        return OutputRequest()
    if not isinstance(raw, dict):
        raise f.fail("`output` must be an object")
    encoding, rate, packet = raw.get("encoding"), raw.get("sample_rate"), raw.get("packet_ms")
    if encoding is not None and encoding not in ENCODINGS:
        raise f.fail(f"output.encoding must be one of {', '.join(ENCODINGS)}", "unsupported_output")
    for name, value, options in (("sample_rate", rate, SAMPLE_RATES), ("packet_ms", packet, PACKET_MS)):
        if value is not None and (isinstance(value, bool) or value not in options):
            raise f.fail(f"output.{name} must be one of {options}", "unsupported_output")
    if encoding in TELEPHONY_ENCODINGS and rate is not None and rate != 8000:
        raise f.fail(f"{encoding} is 8000 Hz only", "unsupported_output")
    # a JSON number may come as 24000.0: the packetiser cuts and slices by these, so they are ints
    return OutputRequest(
        encoding, None if rate is None else int(rate), None if packet is None else int(packet)
    )


def _session_start(f: _Fields) -> SessionStart:
    return SessionStart(
        voice=f.text("voice", max_chars=MAX_ID_CHARS),
        language=f.text("language", max_chars=64),
        instructions=f.text("instructions"),
        output=_output_request(f),
        timestamps="word" if f.choice("timestamps", ("word", "none"), "word") == "word" else "none",
        pacing="realtime" if f.choice("pacing", ("asap", "realtime"), "asap") == "realtime" else "asap",
        webhook_url=_webhook_url(f),
        alignment="sync" if f.choice("alignment", ("sync", "async"), "async") == "sync" else "async",
        pause_timeout_ms=_pause_timeout(f),
    )


MAX_PAUSE_TIMEOUT_MS: Final = 600_000


def _pause_timeout(f: _Fields) -> int | None:
    value = f.milliseconds("pause_timeout_ms")
    if value is not None and not 0 < value <= MAX_PAUSE_TIMEOUT_MS:
        raise f.fail(f"`pause_timeout_ms` must be from 1 to {MAX_PAUSE_TIMEOUT_MS}")
    return value


MAX_URL_CHARS: Final = 2048


def _webhook_url(f: _Fields) -> str | None:
    url = f.text("webhook_url", max_chars=MAX_URL_CHARS)
    if url is not None and (problem := webhook_url_problem(url)) is not None:
        raise f.fail(problem)
    return url


def webhook_url_problem(url: object) -> str | None:
    """Why `url` cannot serve as a `webhook_url` (None when it can): the rules of `session.start`,
    for the places that take one outside a message (a Twilio stream parameter)."""
    if not isinstance(url, str):
        return "`webhook_url` must be a string"
    if not _is_valid_unicode(url):
        return "`webhook_url` is not valid UTF-8 text"
    if not 0 < len(url) <= MAX_URL_CHARS:
        return f"`webhook_url` must have 1 to {MAX_URL_CHARS} characters"
    if not (url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0):
        return "`webhook_url` must be an http:// or https:// URL"
    return None


def _speak_append(f: _Fields) -> SpeakAppend:
    uid = f.ident("utterance_id")
    text = f.text("text", required=True)
    assert text is not None
    return SpeakAppend(uid, text, f.flag("flush", False), _forced_frames(f), f.milliseconds("max_wait_ms"))


MAX_FORCED_FRAMES: Final = 8192


def _forced_frames(f: _Fields) -> int | None:
    bench = f.raw.get("bench")
    if bench is None:
        return None
    value = bench.get("forced_frames") if isinstance(bench, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_FORCED_FRAMES:
        raise f.fail(f"`bench.forced_frames` must be an integer from 1 to {MAX_FORCED_FRAMES}")
    return value


def _speak_cancel(f: _Fields) -> SpeakCancel:
    return SpeakCancel(f.optional_ident("utterance_id"), f.milliseconds("played_ms"))


def _speak_pause(f: _Fields) -> SpeakPause:
    return SpeakPause(f.optional_ident("utterance_id"), f.milliseconds("played_ms"))


def _playback_report(f: _Fields) -> PlaybackReport:
    played = f.milliseconds("played_ms", required=True)
    assert played is not None
    return PlaybackReport(f.ident("utterance_id"), played)


_DECODERS: Final[dict[str, Callable[[_Fields], ClientMessage]]] = {
    "session.start": _session_start,
    "speak.append": _speak_append,
    "speak.flush": lambda f: SpeakFlush(f.ident("utterance_id")),
    "speak.end": lambda f: SpeakEnd(f.ident("utterance_id")),
    "speak.cancel": _speak_cancel,
    "speak.resume": lambda f: SpeakResume(f.ident("utterance_id"), f.ident("from_utterance")),
    "speak.pause": _speak_pause,
    "speak.unpause": lambda f: SpeakUnpause(f.optional_ident("utterance_id")),
    "playback.report": _playback_report,
    "session.end": lambda f: SessionEnd(),
}


def decode(frame: str | bytes) -> ClientMessage:
    """One client text frame -> a typed message. Unknown fields are ignored."""
    if isinstance(frame, bytes | bytearray):
        try:
            frame = bytes(frame).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("invalid_message", "the frame is not valid UTF-8") from None
    elif not _is_valid_unicode(frame):
        raise ProtocolError("invalid_message", "the frame is not valid UTF-8")
    try:
        raw = json.loads(frame)
    except (ValueError, RecursionError):
        raise ProtocolError("invalid_message", "the frame is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_message", "a message is a JSON object")
    kind = raw.get("type")
    if not isinstance(kind, str):
        uid = raw.get("utterance_id")
        raise ProtocolError(
            "invalid_message", "a message needs a string `type`", uid if isinstance(uid, str) else None
        )
    decoder = _DECODERS.get(kind)
    if decoder is None:
        shown = kind[:40] if _is_valid_unicode(kind) else "?"
        uid = raw.get("utterance_id")  # every error names the utterance its message named
        raise ProtocolError(
            "unknown_type", f"unknown message type {shown!r}", uid if isinstance(uid, str) else None
        )
    return decoder(_Fields(raw, kind))
