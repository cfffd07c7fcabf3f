"""Opening an utterance: the session's limits and the key's quotas first, then its engine request,
its text segmenter, its packetiser and its stream handle.
"""

from __future__ import annotations

from engine.api import SynthesisRequest
from gateway.languages import normalise_language
from gateway.messages import ProtocolError
from gateway.packets import Packetiser
from gateway.protocol.state import ProtocolState
from gateway.protocol.utterance import Utterance
from gateway.quotas import QuotaExceeded
from gateway.segmenter import UtteranceText


class Admission(ProtocolState):
    """The part of `SessionProtocol` that opens utterances (speak.append's first text, speak.resume)."""

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
        if voice is not None and self.voice_usable is not None and not self.voice_usable(voice):
            raise ProtocolError("unknown_voice", f"unknown voice {voice!r}", uid)
        if self.utterances_opened >= self.config.max_utterances_per_session:
            # no retry hint: a connection's count of utterances only grows, so no wait lets this one in
            raise QuotaExceeded(
                f"at most {self.config.max_utterances_per_session} utterances per session",
                uid,
                retry_after_s=None,
            )

    def _take_quota(self, uid: str, text_chars: int, now: float) -> None:
        """Count a new utterance against the key (in progress, characters); raises when over."""
        if self.quotas is not None:
            # text no budget can hold is refused before a busy count: a client told to retry in a
            # second would only be refused for good then
            self.quotas.check_fits(self.key_id, text_chars, uid)
            self.quotas.begin_utterance(self.key_id, uid)
            try:
                self.quotas.take_chars(self.key_id, text_chars, now, uid)
            except ProtocolError:
                self.quotas.end_utterance(self.key_id)
                raise
        self.utterances_opened += 1

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
                # known at open: an engine with a forced aligner counts only the streams that want
                # its words towards the aligner's share in admission
                word_alignment=self.word_alignment,
            )
        else:
            request = SynthesisRequest(
                request_id=f"{self.session_id}/{uid}",
                voice=request.voice,
                language=request.language,
                instructions=request.instructions,
                max_wait_s=request.max_wait_s,
                word_alignment=self.word_alignment,
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
