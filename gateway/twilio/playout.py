"""The line's audio out to Twilio: one utterance after the other, each frame followed by the marks
of the words that end in it; a mark that comes back is a playback report, and between marks the
caller's position is extrapolated at real time.
"""

from __future__ import annotations

from typing import Any

from starlette.websockets import WebSocket

from gateway.messages import PlaybackReport, encode
from gateway.packets import Packet
from gateway.twilio.call_state import CallState
from gateway.twilio.line import Mark, PhoneUtterance, UtteranceDone, mark_name
from gateway.twilio.media import FRAME_SAMPLES, RATE, twilio_message


class Playout(CallState):
    """The part of `Call` that writes the Twilio socket and follows the marks."""

    def _on_mark(self, name: str, now: float) -> None:
        """A mark came back: a playback report (the audio before it has been heard)."""
        if self._voided[name]:  # a voided mark's echo, ahead of any later mark of that name
            self._voided[name] -= 1
            if not self._voided[name]:
                del self._voided[name]
            return
        mark = self._marks.pop(name, None)
        if mark is None:
            return  # voided by a clear, or not ours
        line = mark.utterance
        line.anchor = (mark.position, now)
        while line.sent and line.sent[0].end_sample < mark.position - FRAME_SAMPLES:
            line.sent.popleft()  # heard: never sent again (a frame kept for a fence just before)
        if mark.index is not None:
            line.heard_index = max(line.heard_index, mark.index)
        elif line.live:
            line.state, line.on_line = "played", False
            self.to_agent({"type": "utterance.played", "utterance_id": line.utterance_id})
        if self.protocol.utterance(line.utterance_id) is not None:
            report = PlaybackReport(line.utterance_id, mark.position * 1000 // RATE)
            self._run(self.protocol.receive_message(report, now))

    async def write_twilio(self, websocket: WebSocket) -> None:
        """The one writer of the Twilio socket: clears first, then the utterances' media in order."""
        while not self.ended:
            if self.stream_sid is None:
                await self._sleep()
                continue
            if self._to_twilio:
                await websocket.send_text(encode(self._to_twilio.popleft()))
                continue
            line = self._playing()
            if line is None or not line.queue:
                await self._sleep()
                continue
            item = line.queue.popleft()
            if isinstance(item, UtteranceDone):
                done = {k: item.message[k] for k in ("type", "utterance_id", "duration_ms")}
                self.to_agent(done)
                self._run(self.protocol.trailer_sent(line.stream))
                continue
            line.sent.append(item)  # before the send: a pause meanwhile sends it again
            line.on_line = True
            await websocket.send_text(encode(twilio_message(self.stream_sid, "media", payload=item.payload)))
            now = self.loop.time()
            if not line.ttfa_counted and line.first_text_at is not None:
                self._count_ttfa(line, now)
            self._run(self.protocol.packet_sent(line.stream, item, now))
            if line.live and not line.paused and not self._to_twilio:
                for message in self._after_packet(line, item, now):
                    await websocket.send_text(encode(message))

    def _count_ttfa(self, line: PhoneUtterance, now: float) -> None:
        """Its first frame is on the line: time from its first text, or from when the line was
        free for it if the utterance before it was still being sent then."""
        assert line.first_text_at is not None
        started = max(line.first_text_at, self.line_free_at)
        self.metrics.ttfa.labels("twilio").observe(now - started)
        line.ttfa_counted = True

    def _playing(self) -> PhoneUtterance | None:
        """The utterance whose audio goes on the line now: the first live one not fully sent (none
        while that one is paused: the others wait behind it)."""
        for line in self.utterances.values():
            if line.live and (not line.all_sent or line.queue):  # (its utterance.done may wait)
                return None if line.paused else line
        return None

    def _after_packet(self, line: PhoneUtterance, packet: Packet, now: float) -> list[dict[str, Any]]:
        """Bookkeeping after a media frame went out; the marks that follow it."""
        if line.anchor is None:
            line.anchor = (line.resume_from, now)
        line.sent_samples = packet.end_sample
        out = []
        while line.next_mark < len(line.word_ends) and (
            packet.last or line.word_ends[line.next_mark] <= packet.end_sample
        ):
            out.append(self._mark(line, line.next_mark, packet.end_sample))
            line.next_mark += 1
        if packet.last:
            out.append(self._mark(line, None, packet.end_sample))
            line.all_sent = True
            self.line_free_at = now
        return out

    def _mark(self, line: PhoneUtterance, index: int | None, position: int) -> dict[str, Any]:
        name = mark_name(line.utterance_id, index)
        self._marks[name] = Mark(line, index, position)
        return twilio_message(self.stream_sid, "mark", name=name)

    def _played_samples(self, line: PhoneUtterance, now: float) -> int:
        """Between the last mark back and the next one out: extrapolated at real time from the
        last mark's return (or from the first frame sent), capped at the next mark's place."""
        if line.anchor is None:
            return line.resume_from
        base, since = line.anchor
        cap = min([m.position for m in self._marks.values() if m.utterance is line] + [line.sent_samples])
        estimate = base + int(max(0.0, now - since) * RATE)
        return max(base, min(estimate, cap))
