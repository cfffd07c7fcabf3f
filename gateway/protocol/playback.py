"""Where the listener is: the sends the caller confirms, the client's playback reports, and the
played position they give at a fence.
"""

from __future__ import annotations

from gateway.bargein import Report, played_position
from gateway.messages import PlaybackReport, PositionSource, ProtocolError
from gateway.packets import Packet
from gateway.protocol.actions import Action
from gateway.protocol.state import ProtocolState
from gateway.protocol.utterance import Status, Utterance


class Playback(ProtocolState):
    """The part of `SessionProtocol` that follows the listener's position."""

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

    def _report(self, message: PlaybackReport, now: float) -> list[Action]:
        utt = self.utterance(message.utterance_id)
        if utt is None:
            raise ProtocolError(
                "unknown_utterance", f"no utterance {message.utterance_id!r}", message.utterance_id
            )
        utt.report = Report(message.played_ms, now)
        return []

    def _position(self, utt: Utterance, client_ms: int | None, now: float) -> tuple[int, PositionSource]:
        report, since, start = utt.report, utt.first_sent_at, 0
        clock = utt.clock
        if clock is not None:  # unpaused: the listener went on from the paused position then
            since, start = clock.at, clock.played_ms
            if report is not None and report.at < clock.at:
                report = None
        return played_position(
            client_ms=client_ms,
            report=report,
            first_sent_at=since,
            sent_ms=utt.sent_ms,
            now=now,
            start_ms=start,
        )
