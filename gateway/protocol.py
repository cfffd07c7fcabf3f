"""The session state machine, without I/O: client frames, engine chunks and send confirmations in;
actions out (messages and packets to send, engine calls to make, the socket to close).

The caller (gateway.session) runs the actions in order. Two send lanes: *control* messages go out
ahead of queued audio; the *audio* lane carries packets and each utterance's `utterance.done`
behind its last packet. `Purge(stream)` drops a stream's queued audio: with the
`utterance.interrupted` that follows on the control lane it forms the fence.

Life of an utterance: OPEN (text accepted) -> TEXT_CLOSED (speak.end) -> GENERATED (last packet
made) -> DELIVERED (utterance.done sent); or INTERRUPTED / FAILED from any active state. Finished
utterances stay in a short history so that a late speak.cancel and speak.resume still work; a
retired utterance keeps its text, words and figures but not its resampler state.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from engine.api import AudioChunk, EngineInfo, QueuePosition, SynthesisRequest, TextSegment
from gateway.bargein import Cut, Report, cut_at, played_position, resume_offset
from gateway.config import GatewayConfig
from gateway.errors import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_TOO_BIG,
    error_code,
    public_message,
    retry_after_s,
)
from gateway.languages import languages_open_at, normalise_language
from gateway.messages import (
    Alignment,
    ClientMessage,
    ErrorCode,
    ErrorMessage,
    Pacing,
    PlaybackReport,
    ProtocolError,
    ServerMessage,
    SessionEnd,
    SessionStart,
    SpeakAppend,
    SpeakCancel,
    SpeakEnd,
    SpeakFlush,
    SpeakResume,
    Timestamps,
    UtteranceQueued,
    UtteranceStarted,
    Word,
    decode,
    validate_output,
)
from gateway.packets import OutputFormat, Packet, Packetiser, is_mono_float32
from gateway.quotas import QuotaExceeded, Quotas
from gateway.segmenter import UtteranceText

# -- actions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendControl:
    """A JSON message, sent ahead of queued audio."""

    message: ServerMessage


@dataclass(slots=True)
class SendAudio:
    """A chunk's packets, in order, for the audio lane (one action per chunk, not per packet)."""

    stream: int
    packets: list[Packet]


@dataclass(frozen=True, slots=True)
class SendTrailer:
    """A JSON message in the audio lane, after the stream's queued packets (utterance.done)."""

    stream: int
    message: ServerMessage


@dataclass(frozen=True, slots=True)
class Purge:
    """Drop every queued audio-lane item of this stream."""

    stream: int


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Call engine.open(request) and report back with open_succeeded / open_failed."""

    utterance_id: str
    request: SynthesisRequest


@dataclass(frozen=True, slots=True)
class PushText:
    utterance_id: str
    segment: TextSegment


@dataclass(frozen=True, slots=True)
class CloseText:
    utterance_id: str


@dataclass(frozen=True, slots=True)
class CancelStream:
    utterance_id: str


@dataclass(frozen=True, slots=True)
class Close:
    """Close the socket once the control messages before it are sent."""

    code: int
    reason: str = ""


Action = (
    SendControl | SendAudio | SendTrailer | Purge | OpenStream | PushText | CloseText | CancelStream | Close
)


# -- state ------------------------------------------------------------------------------------


class Status(enum.Enum):
    OPEN = "open"
    TEXT_CLOSED = "text_closed"
    GENERATED = "generated"
    DELIVERED = "delivered"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        return self in _ACTIVE


# module constants: an enum member looked up through its class costs a dictionary walk per packet
_ACTIVE: tuple[Status, ...] = (Status.OPEN, Status.TEXT_CLOSED, Status.GENERATED)
_RECEIVING: tuple[Status, ...] = (Status.OPEN, Status.TEXT_CLOSED)  # taking engine audio


@dataclass(slots=True)
class Utterance:
    utterance_id: str
    stream: int
    segmenter: UtteranceText
    packetiser: Packetiser
    request: SynthesisRequest
    status: Status = Status.OPEN
    opened: bool = False  # the engine admitted it
    quota_held: bool = False  # counted in the key's utterances in progress
    last_text_at: float = 0.0  # when text last arrived (text_timeout_s)
    text: str = ""
    words: list[Word] = field(default_factory=list)
    engine_samples: int = 0  # engine-rate samples received
    sent_samples: int = 0  # output-rate samples sent to the client
    first_sent_at: float | None = None
    report: Report | None = None
    cut: Cut | None = None
    interrupted: ServerMessage | None = None
    resumed_from: str | None = None
    text_offset: int = 0

    @property
    def sent_ms(self) -> int:
        return round(self.sent_samples * 1000 / self.packetiser.format.sample_rate)


class SessionProtocol:
    def __init__(
        self,
        session_id: str,
        engine: EngineInfo,
        config: GatewayConfig,
        *,
        key_id: str = "anonymous",
        allowed_voices: frozenset[str] | None = None,
        quotas: Quotas | None = None,
        now: float = 0.0,
    ) -> None:
        self.session_id = session_id
        self.key_id = key_id
        self.allowed_voices = allowed_voices  # a scoped token's voices (None = any)
        self.quotas = quotas
        self.last_message_at = now
        self.utterances_opened = 0
        self.engine = engine
        self.config = config
        self.output = OutputFormat(
            config.default_encoding, config.default_sample_rate, config.default_packet_ms
        )
        self.voice: str | None = None
        self.language = "Auto"
        self.instructions: str | None = None
        self.timestamps: Timestamps = "word"
        self.pacing: Pacing = "asap"
        self.alignment: Alignment = "async"
        self.webhook_url: str | None = None  # session.start: where interruptions are POSTed
        self.started = False
        self.ending = False  # session.end received
        self.shutting_down = False
        self.closed = False
        self._active: dict[str, Utterance] = {}
        self._history: OrderedDict[str, Utterance] = OrderedDict()
        self._streams: dict[int, Utterance] = {}
        self._next_stream = 1

    # -- queries ------------------------------------------------------------------------------
    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def word_alignment(self) -> str:
        """What an engine with a forced aligner should do: "sync", "async", or "off" (no timestamps)."""
        return "off" if self.timestamps == "none" else self.alignment

    def utterance(self, utterance_id: str) -> Utterance | None:
        return self._active.get(utterance_id) or self._history.get(utterance_id)

    def by_stream(self, stream: int) -> Utterance | None:
        return self._streams.get(stream)

    # -- client input -------------------------------------------------------------------------
    def receive_text(self, frame: str, now: float) -> list[Action]:
        if len(frame) > self.config.max_message_bytes or len(frame.encode("utf-8", "surrogatepass")) > (
            self.config.max_message_bytes
        ):
            return self._close(CLOSE_TOO_BIG, "message too big")
        try:
            message = decode(frame)
        except ProtocolError as exc:
            return [self._error(exc.code, exc.message, exc.utterance_id)]
        return self.receive_message(message, now)

    def receive_binary(self, frame: bytes) -> list[Action]:
        if len(frame) > self.config.max_message_bytes:
            return self._close(CLOSE_TOO_BIG, "message too big")
        return [self._error("binary_not_supported", "binary frames from the client are not accepted")]

    def receive_message(self, message: ClientMessage, now: float) -> list[Action]:
        if self.closed:
            return []
        self.last_message_at = now
        if isinstance(message, SessionStart):
            return self._session_start(message)
        out = self._ensure_started()
        try:
            out += self._dispatch(message, now)
        except ProtocolError as exc:
            out.append(self._error(exc.code, exc.message, exc.utterance_id))
        return out

    def _dispatch(self, message: ClientMessage, now: float) -> list[Action]:
        if isinstance(message, SpeakAppend):
            return self._append(message, now)
        if isinstance(message, SpeakFlush):
            return self._flush(message.utterance_id, close=False)
        if isinstance(message, SpeakEnd):
            return self._flush(message.utterance_id, close=True)
        if isinstance(message, SpeakCancel):
            return self._cancel(message, now)
        if isinstance(message, SpeakResume):
            return self._resume(message, now)
        if isinstance(message, PlaybackReport):
            return self._report(message, now)
        if isinstance(message, SessionEnd):
            return self._session_end()
        raise ProtocolError("unknown_type", f"unhandled message {message.type}")

    # -- engine feedback ----------------------------------------------------------------------
    def open_succeeded(self, utterance_id: str, queued: QueuePosition | None = None) -> list[Action]:
        """The engine took the utterance; `queued`: it waits for admission there first."""
        utt = self._active.get(utterance_id)
        if utt is None:
            return []
        utt.opened = True
        started: UtteranceStarted = {
            "type": "utterance.started",
            "utterance_id": utterance_id,
            "stream": utt.stream,
        }
        if utt.resumed_from is not None:
            started["resumed_from"] = utt.resumed_from
            started["text_offset"] = utt.text_offset
        if queued is None:
            return [SendControl(started)]
        waiting: UtteranceQueued = {
            "type": "utterance.queued",
            "utterance_id": utterance_id,
            "position": queued.position,
            "expected_wait_ms": round(1000 * queued.expected_wait_s),
        }
        return [SendControl(started), SendControl(waiting)]

    def open_failed(self, utterance_id: str, exc: BaseException) -> list[Action]:
        """The engine refused the utterance: forget it (the id may be used again)."""
        utt = self._active.pop(utterance_id, None)
        if utt is not None:
            self._streams.pop(utt.stream, None)
            self._release_quota(utt)
        return [
            self._error(error_code(exc), public_message(exc), utterance_id, retry_after_s(exc)),
            *self._maybe_finish_session(),
        ]

    def receive_chunk(self, utterance_id: str, chunk: AudioChunk) -> list[Action]:
        utt = self._active.get(utterance_id)
        if utt is None or utt.status not in _RECEIVING:
            return []  # after the fence, or after the last packet: dropped
        out: list[Action] = []
        if chunk.words:
            rate = self.engine.sample_rate
            new_words = [
                self._word(utt, w.text, w.start_sample, w.end_sample, w.char_start, w.char_end, rate)
                for w in chunk.words
            ]
            if self.timestamps == "word":
                out.append(
                    SendControl(
                        {
                            "type": "words",
                            "utterance_id": utterance_id,
                            "source": chunk.words[0].source,
                            "words": [w.to_wire() for w in new_words],
                        }
                    )
                )
        samples = chunk.samples  # float32, or int16 PCM (the packetiser takes either)
        if samples.dtype != np.int16 and not is_mono_float32(samples):
            samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        gap = chunk.sample_offset - utt.engine_samples
        if gap > 0:  # the engine skipped samples: keep the timeline with silence
            samples = np.concatenate((np.zeros(gap, dtype=samples.dtype), samples.reshape(-1)))
        elif gap < 0:  # overlap with audio already sent: drop the repeated part
            samples = samples[min(-gap, len(samples)) :]
        utt.engine_samples += len(samples)
        packets = utt.packetiser.push(samples, final=chunk.final)
        if packets:
            out.append(SendAudio(utt.stream, packets))
        if chunk.final:
            out += self._generated(utt)
        return out

    def stream_ended(self, utterance_id: str) -> list[Action]:
        """The engine's iteration ended; finish the utterance if no final chunk came."""
        utt = self._active.get(utterance_id)
        if utt is None or utt.status not in _RECEIVING:
            return []
        out: list[Action] = [SendAudio(utt.stream, utt.packetiser.push(np.zeros(0, np.float32), True))]
        return out + self._generated(utt)

    def stream_failed(self, utterance_id: str, exc: BaseException) -> list[Action]:
        utt = self._active.get(utterance_id)
        if utt is None:
            return []
        utt.status = Status.FAILED
        self._retire(utt)
        return [
            Purge(utt.stream),
            self._error(error_code(exc), public_message(exc), utterance_id, retry_after_s(exc)),
            *self._maybe_finish_session(),
        ]

    def packet_sent(self, stream: int, packet: Packet, now: float) -> list[Action]:
        """`packet` and every packet of its stream before it went out (told of a run's last alone)."""
        utt = self._streams.get(stream)
        if utt is not None:
            if utt.first_sent_at is None:
                utt.first_sent_at = now
            end = packet.sample_offset + packet.samples
            if end > utt.sent_samples:
                utt.sent_samples = end
        return []

    def trailer_sent(self, stream: int) -> list[Action]:
        """utterance.done went out (after the last packet): the utterance is delivered."""
        utt = self._streams.get(stream)
        if utt is None or utt.status is not Status.GENERATED:
            return []
        utt.status = Status.DELIVERED
        self._retire(utt)
        return self._maybe_finish_session()

    # -- shutdown -----------------------------------------------------------------------------
    def tick(self, now: float) -> list[Action]:
        """Timeouts, called about once a second: an utterance whose text stays open without news
        for `text_timeout_s` is ended as by speak.end (its audio completes, its engine slot frees);
        a session with nothing in progress and no message for `idle_timeout_s` closes."""
        if self.closed:
            return []
        out: list[Action] = []
        for utt in list(self._active.values()):
            if utt.status is Status.OPEN and now - utt.last_text_at > self.config.text_timeout_s:
                out += [PushText(utt.utterance_id, s) for s in utt.segmenter.flush()]
                utt.status = Status.TEXT_CLOSED
                out.append(CloseText(utt.utterance_id))
        if not self._active and now - self.last_message_at > self.config.idle_timeout_s:
            out += self._close(CLOSE_NORMAL, "idle timeout")
        return out

    def begin_shutdown(self) -> None:
        """New utterances are refused from now on; open ones may finish."""
        self.shutting_down = True

    def abort(self, code: int = CLOSE_GOING_AWAY, reason: str = "server shutting down") -> list[Action]:
        """Stop every utterance (no fence messages) and close the socket."""
        out: list[Action] = []
        for utt in list(self._active.values()):
            utt.status = Status.FAILED
            if utt.opened:
                out.append(CancelStream(utt.utterance_id))
            out.append(Purge(utt.stream))
            self._retire(utt)
        return out + self._close(code, reason)

    # -- message handlers ---------------------------------------------------------------------
    def _session_start(self, message: SessionStart) -> list[Action]:
        if self.started:
            return [self._error("session_started", "session.start must be the first message")]
        req = message.output
        encoding = req.encoding or self.config.default_encoding
        default_rate = 8000 if encoding in ("mulaw", "alaw") else self.config.default_sample_rate
        rate = req.sample_rate or default_rate
        packet_ms = req.packet_ms or self.config.default_packet_ms
        try:
            validate_output(encoding, rate, packet_ms)
        except ProtocolError as exc:
            return [self._error(exc.code, exc.message)]
        self.output = OutputFormat(encoding, rate, packet_ms)
        self.voice = message.voice
        self.language = message.language or "Auto"
        self.instructions = message.instructions
        self.timestamps = message.timestamps
        self.pacing = message.pacing
        self.alignment = message.alignment
        self.webhook_url = message.webhook_url
        return self._ensure_started()

    def _ensure_started(self) -> list[Action]:
        if self.started:
            return []
        self.started = True
        return [
            SendControl(
                {
                    "type": "session.started",
                    "session_id": self.session_id,
                    "output": self.output.to_wire(),
                    "engine": {"name": self.engine.name, "model": self.engine.model},
                }
            )
        ]

    def _append(self, message: SpeakAppend, now: float) -> list[Action]:
        uid = message.utterance_id
        out: list[Action] = []
        utt = self._active.get(uid)
        if utt is None:
            if uid in self._history:
                raise ProtocolError("utterance_closed", f"utterance {uid!r} has ended", uid)
            self._check_can_open(uid, len(message.text), self.voice)
            self._take_quota(uid, len(message.text), now)
            utt = self._new_utterance(
                uid, forced_frames=message.forced_frames, max_wait_ms=message.max_wait_ms
            )
            utt.quota_held = self.quotas is not None
            out.append(OpenStream(uid, utt.request))
        elif utt.status is not Status.OPEN:
            raise ProtocolError("utterance_closed", f"utterance {uid!r} takes no more text", uid)
        else:
            if len(utt.text) + len(message.text) > self.config.max_text_chars:
                raise ProtocolError(
                    "text_too_long",
                    f"an utterance holds at most {self.config.max_text_chars} characters",
                    uid,
                )
            if self.quotas is not None:
                self.quotas.take_chars(self.key_id, len(message.text), now, uid)
        utt.last_text_at = now
        utt.text += message.text
        segments = utt.segmenter.feed(message.text)
        if message.flush:
            segments += utt.segmenter.flush()
        return out + [PushText(uid, s) for s in segments]

    def _flush(self, uid: str, close: bool) -> list[Action]:
        utt = self._active.get(uid)
        if utt is None:
            if uid in self._history:
                raise ProtocolError("utterance_closed", f"utterance {uid!r} has ended", uid)
            raise ProtocolError("unknown_utterance", f"no utterance {uid!r}", uid)
        if utt.status is not Status.OPEN:
            return []  # a second speak.end (or a flush after it) changes nothing
        out: list[Action] = [PushText(uid, s) for s in utt.segmenter.flush()]
        if close:
            utt.status = Status.TEXT_CLOSED
            out.append(CloseText(uid))
        return out

    def _cancel(self, message: SpeakCancel, now: float) -> list[Action]:
        if message.utterance_id is None:
            out: list[Action] = []
            for utt in list(self._active.values()):
                out += self._interrupt(utt, None, now)
            return out
        uid = message.utterance_id
        target = self.utterance(uid)
        if target is None:
            raise ProtocolError("unknown_utterance", f"no utterance {uid!r}", uid)
        return self._interrupt(target, message.played_ms, now)

    def _interrupt(self, utt: Utterance, client_ms: int | None, now: float) -> list[Action]:
        if utt.interrupted is not None:
            return [SendControl(utt.interrupted)]  # idempotent: the same answer again
        out: list[Action] = []
        if utt.status.active:
            if utt.opened:
                out.append(CancelStream(utt.utterance_id))
            out.append(Purge(utt.stream))
        played, source = played_position(
            client_ms=client_ms,
            report=utt.report,
            first_sent_at=utt.first_sent_at,
            sent_ms=utt.sent_ms,
            now=now,
        )
        cut = cut_at(utt.words, utt.text, played)
        utt.cut = cut
        utt.interrupted = {
            "type": "utterance.interrupted",
            "utterance_id": utt.utterance_id,
            "played_ms": played,
            "position_source": source,
            "last_word": cut.last_word.to_wire() if cut.last_word else None,
            "partial_word": cut.partial_word.to_wire() if cut.partial_word else None,
            "spoken_text": cut.spoken_text,
            "unspoken_text": cut.unspoken_text,
        }
        was_active = utt.status.active
        utt.status = Status.INTERRUPTED
        if was_active:
            self._retire(utt)
        out.append(SendControl(utt.interrupted))
        return out + self._maybe_finish_session()

    def _resume(self, message: SpeakResume, now: float) -> list[Action]:
        uid, source_id = message.utterance_id, message.from_utterance
        source = self._history.get(source_id) or self._active.get(source_id)
        if source is None:
            raise ProtocolError("unknown_utterance", f"no utterance {source_id!r}", uid)
        if source.cut is None:
            raise ProtocolError("not_interrupted", f"utterance {source_id!r} was not interrupted", uid)
        if uid in self._active or uid in self._history:
            raise ProtocolError("utterance_exists", f"utterance {uid!r} already exists", uid)
        offset = resume_offset(source.words, source.text, source.cut)
        text = source.text[offset:]
        self._check_can_open(uid, len(text), source.request.voice)
        self._take_quota(uid, len(text), now)
        utt = self._new_utterance(
            uid, request=source.request, open_languages=languages_open_at(source.text, offset)
        )
        utt.resumed_from, utt.text_offset, utt.text = source_id, offset, text
        utt.quota_held = self.quotas is not None
        segments = utt.segmenter.feed(text) + utt.segmenter.flush()
        utt.status = Status.TEXT_CLOSED
        return [OpenStream(uid, utt.request), *(PushText(uid, s) for s in segments), CloseText(uid)]

    def _report(self, message: PlaybackReport, now: float) -> list[Action]:
        utt = self.utterance(message.utterance_id)
        if utt is None:
            raise ProtocolError(
                "unknown_utterance", f"no utterance {message.utterance_id!r}", message.utterance_id
            )
        utt.report = Report(message.played_ms, now)
        return []

    def _session_end(self) -> list[Action]:
        self.ending = True
        out: list[Action] = []
        for utt in self._active.values():
            if utt.status is Status.OPEN:
                out += [PushText(utt.utterance_id, s) for s in utt.segmenter.flush()]
                utt.status = Status.TEXT_CLOSED
                out.append(CloseText(utt.utterance_id))
        return out + self._maybe_finish_session()

    # -- helpers ------------------------------------------------------------------------------
    def _check_can_open(self, uid: str, text_chars: int, voice: str | None) -> None:
        if self.ending:
            raise ProtocolError("invalid_message", "the session is ending", uid)
        if self.shutting_down:
            raise ProtocolError("shutting_down", "the server is shutting down", uid)
        if len(self._active) >= self.config.max_open_utterances:
            raise ProtocolError(
                "too_many_utterances", f"at most {self.config.max_open_utterances} open utterances", uid
            )
        if text_chars > self.config.max_text_chars:
            raise ProtocolError(
                "text_too_long", f"an utterance holds at most {self.config.max_text_chars} characters", uid
            )
        if self.allowed_voices is not None and voice is not None and voice not in self.allowed_voices:
            raise ProtocolError("unauthorized", f"this token may not use voice {voice!r}", uid)
        if self.utterances_opened >= self.config.max_utterances_per_session:
            raise QuotaExceeded(
                f"at most {self.config.max_utterances_per_session} utterances per session", uid
            )

    def _take_quota(self, uid: str, text_chars: int, now: float) -> None:
        """Count a new utterance against the key (in progress, characters); raises when over."""
        if self.quotas is not None:
            self.quotas.begin_utterance(self.key_id, uid)
            try:
                self.quotas.take_chars(self.key_id, text_chars, now, uid)
            except ProtocolError:
                self.quotas.end_utterance(self.key_id)
                raise
        self.utterances_opened += 1

    def _release_quota(self, utt: Utterance) -> None:
        if utt.quota_held and self.quotas is not None:
            utt.quota_held = False
            self.quotas.end_utterance(self.key_id)

    def _new_utterance(
        self,
        uid: str,
        request: SynthesisRequest | None = None,
        open_languages: tuple[str, ...] = (),
        forced_frames: int | None = None,
        max_wait_ms: int | None = None,
    ) -> Utterance:
        stream = self._allocate_stream()
        if request is None:
            request = SynthesisRequest(
                request_id=f"{self.session_id}/{uid}",
                voice=self.voice,
                language=normalise_language(self.language),
                instructions=self.instructions,
                forced_frames=forced_frames,
                max_wait_s=None if max_wait_ms is None else max_wait_ms / 1000,
            )
        else:
            request = SynthesisRequest(
                request_id=f"{self.session_id}/{uid}",
                voice=request.voice,
                language=request.language,
                instructions=request.instructions,
                max_wait_s=request.max_wait_s,
            )
        utt = Utterance(
            utterance_id=uid,
            stream=stream,
            segmenter=UtteranceText(
                request.language,
                self.config.segment_max_chars,
                self.config.segment_clause_min_chars,
                open_languages=open_languages,
            ),
            packetiser=Packetiser(stream, self.output, self.engine.sample_rate),
            request=request,
        )
        self._active[uid] = utt
        self._streams[stream] = utt
        return utt

    def _allocate_stream(self) -> int:
        """Handles count up and are not reused while the 16-bit space lasts."""
        for _ in range(0xFFFF):
            stream = self._next_stream
            self._next_stream = self._next_stream % 0xFFFF + 1
            if stream not in self._streams:
                return stream
        raise ProtocolError("too_many_utterances", "no free stream handle")

    def _word(self, utt: Utterance, text: str, start: int, end: int, c0: int, c1: int, rate: int) -> Word:
        word = Word(
            index=len(utt.words),
            text=text,
            start_ms=round(start * 1000 / rate),
            end_ms=round(end * 1000 / rate),
            char_start=c0,
            char_end=c1,
        )
        utt.words.append(word)
        return word

    def _generated(self, utt: Utterance) -> list[Action]:
        utt.status = Status.GENERATED
        return [
            SendTrailer(
                utt.stream,
                {
                    "type": "utterance.done",
                    "utterance_id": utt.utterance_id,
                    "duration_ms": utt.packetiser.duration_ms,
                    "packets": utt.packetiser.packets,
                },
            )
        ]

    def _retire(self, utt: Utterance) -> None:
        """Move a finished utterance to the history, without the state only a live one needs."""
        self._release_quota(utt)
        utt.packetiser = _spent(utt.packetiser)
        self._active.pop(utt.utterance_id, None)
        self._streams.pop(utt.stream, None)
        self._history[utt.utterance_id] = utt
        while len(self._history) > self.config.history_size:
            self._history.popitem(last=False)

    def _maybe_finish_session(self) -> list[Action]:
        if not self.ending or self._active or self.closed:
            return []
        return [SendControl({"type": "session.ended"}), *self._close(CLOSE_NORMAL, "session ended")]

    def _close(self, code: int, reason: str) -> list[Action]:
        if self.closed:
            return []
        self.closed = True
        return [Close(code, reason)]

    def _error(
        self, code: ErrorCode, message: str, utterance_id: str | None = None, retry_after: float | None = None
    ) -> SendControl:
        error: ErrorMessage = {"type": "error", "code": code, "message": message}
        if utterance_id is not None and _is_utf8(utterance_id):  # a lone surrogate cannot go on the wire
            error["utterance_id"] = utterance_id
        if retry_after is not None:
            error["retry_after_ms"] = round(1000 * retry_after)
        return SendControl(error)


def _spent(packetiser: Packetiser) -> Packetiser:
    """A finished packetiser's figures without its resampler (a soxr stream holds 70-110 KB)."""
    spent = Packetiser(packetiser.stream, packetiser.format, packetiser.format.sample_rate)
    spent.samples_out, spent.packets, spent.finished = packetiser.samples_out, packetiser.packets, True
    return spent


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
