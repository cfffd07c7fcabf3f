"""The session protocol's state, and the steps of an utterance's life that its parts share.

The state: the session's settings and its utterances (active, by stream handle, paused, and a short
history of finished ones). The shared steps: a word's times, the trailer behind the last packet,
retiring an utterance to the history, the end of the session, an error message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.api import EngineInfo
from gateway.config import GatewayConfig
from gateway.errors import CLOSE_NORMAL
from gateway.messages import (
    Alignment,
    ErrorCode,
    ErrorMessage,
    Pacing,
    ProtocolError,
    Timestamps,
    Word,
    whole_ms,
)
from gateway.packets import OutputFormat, Packetiser
from gateway.protocol.actions import Action, Close, SendControl, SendTrailer
from gateway.protocol.utterance import Status, Utterance
from gateway.quotas import QuotaError, Quotas


class ProtocolState:
    """What every part of `SessionProtocol` reads and changes (gateway.protocol.session_protocol
    lists the parts)."""

    def __init__(
        self,
        session_id: str,
        engine: EngineInfo,
        config: GatewayConfig,
        *,
        key_id: str = "anonymous",
        allowed_voices: frozenset[str] | None = None,
        voice_usable: Callable[[str], bool] | None = None,
        quotas: Quotas | None = None,
        now: float = 0.0,
    ) -> None:
        self.session_id = session_id
        self.key_id = key_id
        self.allowed_voices = allowed_voices  # a scoped token's voices (None = any)
        # whether the key may speak in a voice (gateway.voices.VoiceRegistry.usable_by); None: any
        self.voice_usable = voice_usable
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
        self.pause_timeout_ms = config.pause_timeout_ms
        self.started = False
        self.ending = False  # session.end received
        self.shutting_down = False
        self.closed = False
        self._active: dict[str, Utterance] = {}
        self._history: OrderedDict[str, Utterance] = OrderedDict()
        self._streams: dict[int, Utterance] = {}
        self._paused: dict[str, Utterance] = {}  # paused ones (a delivered one may be, too)
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

    # -- an utterance's life, shared by the parts ---------------------------------------------
    def _release_quota(self, utt: Utterance) -> None:
        if utt.quota_held and self.quotas is not None:
            utt.quota_held = False
            self.quotas.end_utterance(self.key_id)

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
        if utt.pause is not None:
            utt.pause.trailer = True  # behind the kept packets, at the unpause
            return []
        return [self._trailer(utt)]

    def _trailer(self, utt: Utterance) -> SendTrailer:
        return SendTrailer(
            utt.stream,
            {
                "type": "utterance.done",
                "utterance_id": utt.utterance_id,
                "duration_ms": utt.packetiser.duration_ms,
                "packets": utt.packetiser.packets,
            },
        )

    def _retire(self, utt: Utterance) -> None:
        """Move a finished utterance to the history, without the state only a live one needs."""
        self._release_quota(utt)
        utt.packetiser = _spent(utt.packetiser)
        self._active.pop(utt.utterance_id, None)
        self._streams.pop(utt.stream, None)
        self._remember(utt)

    def _remember(self, utt: Utterance) -> None:
        self._history[utt.utterance_id] = utt
        while len(self._history) > self.config.history_size:
            self._history.popitem(last=False)

    def _maybe_finish_session(self) -> list[Action]:
        if not self.ending or self._active or self._paused or self.closed:
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
            error["retry_after_ms"] = whole_ms(retry_after)
        return SendControl(error)

    def _refusal(self, exc: ProtocolError) -> SendControl:
        """The `error` for a refused message; a quota's says when a retry may be accepted."""
        retry_after = exc.retry_after_s if isinstance(exc, QuotaError) else None
        return self._error(exc.code, exc.message, exc.utterance_id, retry_after)


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
