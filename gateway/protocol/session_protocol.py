"""`SessionProtocol`: the client's messages in, actions out; its timeouts and its shutdown.

Its parts, one module each, every one building on `ProtocolState` (gateway.protocol.state):
`Admission` opens utterances, `Playback` follows the listener's position, `Fences` interrupts and
pauses, `EngineFeedback` takes the engine's audio. This class dispatches the client's messages to
them.
"""

from __future__ import annotations

from gateway.bargein import resume_offset
from gateway.errors import CLOSE_GOING_AWAY, CLOSE_NORMAL, CLOSE_TOO_BIG
from gateway.languages import languages_open_at
from gateway.messages import (
    ClientMessage,
    PlaybackReport,
    ProtocolError,
    SessionEnd,
    SessionStart,
    SpeakAppend,
    SpeakCancel,
    SpeakEnd,
    SpeakFlush,
    SpeakPause,
    SpeakResume,
    SpeakUnpause,
    decode,
    validate_output,
)
from gateway.packets import OutputFormat
from gateway.protocol.actions import Action, CancelStream, CloseText, OpenStream, Purge, PushText, SendControl
from gateway.protocol.admission import Admission
from gateway.protocol.engine_feedback import EngineFeedback
from gateway.protocol.utterance import Status

_CLOCK_SLACK_S = 0.002  # a timer may fire this much before its time


class SessionProtocol(EngineFeedback, Admission):
    """One session's state machine: its methods take what happened and return the actions
    (gateway.protocol.actions) for the caller to run, in order."""

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
            out.append(self._refusal(exc))
        return out

    def _dispatch(self, message: ClientMessage, now: float) -> list[Action]:
        if isinstance(message, SpeakAppend):
            return self._append(message, now)
        if isinstance(message, SpeakFlush):
            return self._flush(message.utterance_id, close=False)
        if isinstance(message, SpeakEnd):
            return self._flush(message.utterance_id, close=True)
        if isinstance(message, SpeakCancel):
            return self.cancel(message.utterance_id, now, played_ms=message.played_ms)
        if isinstance(message, SpeakPause):
            return self.pause(message.utterance_id, now, played_ms=message.played_ms)
        if isinstance(message, SpeakUnpause):
            return self.unpause(message.utterance_id, now)
        if isinstance(message, SpeakResume):
            return self._resume(message, now)
        if isinstance(message, PlaybackReport):
            return self._report(message, now)
        if isinstance(message, SessionEnd):
            return self._session_end()
        raise ProtocolError("unknown_type", f"unhandled message {message.type}")

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
                utt.status = Status.TEXT_CLOSED
                out += self._give_text(utt, utt.segmenter.flush(), close=True)
        for utt in list(self._paused.values()):
            if utt.pause is not None and now + _CLOCK_SLACK_S >= utt.pause.deadline:
                out += self._interrupt(utt, None, now)
        # a paused utterance is in progress: it waits for its unpause or its own timeout
        if not self._active and not self._paused and now - self.last_message_at > self.config.idle_timeout_s:
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
        for utt in list(self._paused.values()):
            self._end_pause(utt)
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
        if message.pause_timeout_ms is not None:
            self.pause_timeout_ms = message.pause_timeout_ms
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
            if uid in self._history or uid in self._paused:
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
            segments += utt.segmenter.flush(final=False)
        return out + self._give_text(utt, segments)

    def _flush(self, uid: str, close: bool) -> list[Action]:
        utt = self._active.get(uid)
        if utt is None:
            if uid in self._history:
                raise ProtocolError("utterance_closed", f"utterance {uid!r} has ended", uid)
            raise ProtocolError("unknown_utterance", f"no utterance {uid!r}", uid)
        if utt.status is not Status.OPEN:
            return []  # a second speak.end (or a flush after it) changes nothing
        if close:
            utt.status = Status.TEXT_CLOSED
        return self._give_text(utt, utt.segmenter.flush(final=close), close)

    def _resume(self, message: SpeakResume, now: float) -> list[Action]:
        uid, source_id = message.utterance_id, message.from_utterance
        source = self._history.get(source_id) or self._active.get(source_id)
        if source is None:
            raise ProtocolError("unknown_utterance", f"no utterance {source_id!r}", uid)
        if source.cut is None:
            raise ProtocolError("not_interrupted", f"utterance {source_id!r} was not interrupted", uid)
        if uid in self._active or uid in self._history or uid in self._paused:
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

    def _session_end(self) -> list[Action]:
        self.ending = True
        out: list[Action] = []
        for utt in self._active.values():
            if utt.status is Status.OPEN:
                utt.status = Status.TEXT_CLOSED
                out += self._give_text(utt, utt.segmenter.flush(), close=True)
        return out + self._maybe_finish_session()
