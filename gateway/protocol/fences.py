"""Barge-in and pause: the fences of a stream.

speak.cancel interrupts: the engine stream is cancelled, `Purge` drops the stream's queued audio and
`utterance.interrupted` (where the listener stopped, the words heard and unheard) follows on the
control lane. speak.pause fences the stream like speak.cancel (`Hold` takes its queued audio back,
`utterance.paused` goes on the control lane), but the engine goes on and its audio is kept, up to
`pause_buffer_ms`; past that the stream is throttled and its text withheld. speak.unpause sends
what was kept, from the first sample after the fence; a pause that outlives its timeout (`WakeAt`
asks for the tick) becomes an interruption at the paused position.
"""

from __future__ import annotations

from engine.api import TextSegment
from gateway.bargein import Report, cut_at
from gateway.messages import PositionSource, ProtocolError, UtterancePaused
from gateway.packets import Packet
from gateway.protocol.actions import (
    Action,
    CancelStream,
    CloseText,
    Hold,
    Purge,
    PushText,
    SendAudio,
    SendControl,
    Throttle,
    Unhold,
    WakeAt,
)
from gateway.protocol.playback import Playback
from gateway.protocol.utterance import Pause, Status, Utterance


class Fences(Playback):
    """The part of `SessionProtocol` that interrupts, pauses and unpauses utterances."""

    # -- barge-in (also driven directly by the Twilio endpoint) --------------------------------
    def cancel(
        self,
        utterance_id: str | None,
        now: float,
        *,
        played_ms: int | None = None,
        heard_index: int | None = None,
        source: PositionSource | None = None,
    ) -> list[Action]:
        """speak.cancel. `heard_index` bounds the last word heard, `source` names where a given
        `played_ms` came from (the Twilio endpoint's marks); raises ProtocolError."""
        if utterance_id is None:
            out: list[Action] = []
            for utt in list({**self._active, **self._paused}.values()):
                out += self._interrupt(utt, None, now)
            return out
        target = self.utterance(utterance_id) or self._paused.get(utterance_id)
        if target is None:
            raise ProtocolError("unknown_utterance", f"no utterance {utterance_id!r}", utterance_id)
        return self._interrupt(target, played_ms, now, heard_index, source)

    def pause(
        self,
        utterance_id: str | None,
        now: float,
        *,
        played_ms: int | None = None,
        heard_index: int | None = None,
        source: PositionSource | None = None,
    ) -> list[Action]:
        """speak.pause (arguments as for `cancel`); raises ProtocolError."""
        if utterance_id is None:
            out: list[Action] = []
            for utt in list(self._active.values()):
                if utt.pause is None:
                    out += self._pause(utt, None, now, None, None)
            return out
        target = self._paused.get(utterance_id) or self.utterance(utterance_id)
        if target is None:
            raise ProtocolError("unknown_utterance", f"no utterance {utterance_id!r}", utterance_id)
        if target.status is Status.INTERRUPTED or target.status is Status.FAILED:
            raise ProtocolError("utterance_closed", f"utterance {utterance_id!r} has ended", utterance_id)
        return self._pause(target, played_ms, now, heard_index, source)

    def unpause(self, utterance_id: str | None, now: float) -> list[Action]:
        """speak.unpause; raises ProtocolError."""
        if utterance_id is None:
            out: list[Action] = []
            for utt in list(self._paused.values()):
                out += self._unpause(utt, now)
            return out
        target = self._paused.get(utterance_id) or self.utterance(utterance_id)
        if target is None:
            raise ProtocolError("unknown_utterance", f"no utterance {utterance_id!r}", utterance_id)
        if target.pause is None:
            raise ProtocolError("not_paused", f"utterance {utterance_id!r} is not paused", utterance_id)
        return self._unpause(target, now)

    def held(self, utterance_id: str, packets: list[Packet], trailer: bool) -> list[Action]:
        """What a `Hold` took back: the stream's packets after the fence, in order, and whether its
        utterance.done was among them."""
        utt = self._paused.get(utterance_id)
        if utt is None or utt.pause is None:
            return []
        pause = utt.pause
        pause.held[:0] = packets
        pause.held_samples += sum(p.samples for p in packets)
        pause.trailer = pause.trailer or trailer
        return self._check_full(utt)

    def _interrupt(
        self,
        utt: Utterance,
        client_ms: int | None,
        now: float,
        heard_index: int | None = None,
        given_source: PositionSource | None = None,
    ) -> list[Action]:
        if utt.interrupted is not None:
            return [SendControl(utt.interrupted)]  # idempotent: the same answer again
        out: list[Action] = []
        pause = utt.pause
        self._end_pause(utt)
        if utt.status.active:
            if utt.opened:
                out.append(CancelStream(utt.utterance_id))
            out.append(Purge(utt.stream))
        source: PositionSource
        if pause is not None and client_ms is None:  # the listener stopped where it paused
            played, source, heard_index = pause.played_ms, pause.source, pause.heard_index
        else:
            played, source = self._position(utt, client_ms, now)
            if given_source is not None and client_ms is not None:
                source = given_source
        cut = cut_at(utt.words, utt.text, played, heard_index)
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
        elif utt.utterance_id not in self._history:  # paused past its place in the history
            self._remember(utt)
        out.append(SendControl(utt.interrupted))
        return out + self._maybe_finish_session()

    def _pause(
        self,
        utt: Utterance,
        client_ms: int | None,
        now: float,
        heard_index: int | None,
        given_source: PositionSource | None,
    ) -> list[Action]:
        if utt.pause is not None:
            return [SendControl(utt.pause.message)]  # idempotent: the same answer again
        played, source = self._position(utt, client_ms, now)
        if given_source is not None and client_ms is not None:
            source = given_source
        cut = cut_at(utt.words, utt.text, played, heard_index)
        message: UtterancePaused = {
            "type": "utterance.paused",
            "utterance_id": utt.utterance_id,
            "played_ms": played,
            "position_source": source,
            "last_word": cut.last_word.to_wire() if cut.last_word else None,
            "partial_word": cut.partial_word.to_wire() if cut.partial_word else None,
            "spoken_text": cut.spoken_text,
            "unspoken_text": cut.unspoken_text,
        }
        deadline = now + self.pause_timeout_ms / 1000.0
        utt.pause = Pause(message, played, source, heard_index, deadline)
        self._paused[utt.utterance_id] = utt
        return [Hold(utt.utterance_id, utt.stream), SendControl(message), WakeAt(deadline)]

    def _unpause(self, utt: Utterance, now: float) -> list[Action]:
        pause = utt.pause
        assert pause is not None
        self._end_pause(utt)
        if utt.first_sent_at is not None:
            # the listener goes on from the paused position now; with nothing sent yet it has
            # nothing to play, and its clock starts with the first packet, as without a pause
            utt.clock = Report(pause.played_ms, now)
        rate = utt.packetiser.format.sample_rate
        out: list[Action] = [
            SendControl({"type": "utterance.unpaused", "utterance_id": utt.utterance_id}),
            Unhold(utt.stream, pause.played_ms * rate // 1000),
        ]
        if pause.held:
            out.append(SendAudio(utt.stream, pause.held))
        if pause.trailer:
            out.append(self._trailer(utt))
        if pause.throttled:
            out.append(Throttle(utt.utterance_id, False))
        segments, close = pause.withheld, pause.close_withheld
        if segments or close:
            out += self._give_text(utt, segments, close)
        return out + self._maybe_finish_session()

    def _keep(self, utt: Utterance, packets: list[Packet]) -> list[Action]:
        """Packets made while paused: kept for the unpause."""
        pause = utt.pause
        assert pause is not None
        pause.held += packets
        pause.held_samples += sum(p.samples for p in packets)
        return self._check_full(utt)

    def _check_full(self, utt: Utterance) -> list[Action]:
        pause = utt.pause
        assert pause is not None
        bound = self.config.pause_buffer_ms * utt.packetiser.format.sample_rate // 1000
        if pause.throttled or pause.held_samples < bound:
            return []
        pause.throttled = True
        return [Throttle(utt.utterance_id, True)]

    def _give_text(self, utt: Utterance, segments: list[TextSegment], close: bool = False) -> list[Action]:
        """Text for the engine, or for later while the utterance is paused with its buffer full."""
        pause = utt.pause
        if pause is not None and pause.throttled:
            pause.withheld += segments
            pause.close_withheld = pause.close_withheld or close
            return []
        out: list[Action] = [PushText(utt.utterance_id, s) for s in segments]
        if close:
            out.append(CloseText(utt.utterance_id))
        return out

    def _end_pause(self, utt: Utterance) -> None:
        utt.pause = None
        self._paused.pop(utt.utterance_id, None)
