"""Barge-in and pause on the line: where the caller is in each utterance stopped, from the marks
back before the `clear` that empties Twilio's buffer; the session protocol does the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.messages import ProtocolError
from gateway.protocol import Action
from gateway.twilio.line import BargeInBy, PhoneUtterance
from gateway.twilio.media import RATE, twilio_message
from gateway.twilio.playout import Playout


class BargeIn(Playout):
    """The part of `Call` that interrupts and pauses (from the caller's speech or the agent)."""

    def interrupt(self, utterance_id: str | None, by: BargeInBy, now: float) -> None:
        """Stop `utterance_id` (None: every live one); clear Twilio's buffer when it holds audio
        of it (which stops every utterance with audio there) and report what was heard."""
        live = [u for u in self.utterances.values() if u.live]
        if utterance_id is None:
            targets = live
        else:
            target = self._line(utterance_id)
            if not target.live:
                if target.report is not None:
                    self.to_agent(target.report)  # the same report again (and no second webhook)
                return
            targets = [target]
        for line, (played_ms, heard) in self._stop_listening(targets, live, now):
            line.by = by
            self._stop_one(self.protocol.cancel, line, now, played_ms, heard)
        self._wake.set()

    def pause(self, utterance_id: str | None, by: BargeInBy, now: float) -> None:
        """Pause `utterance_id` (None: every live one); as `interrupt`, a `clear` pauses every
        utterance with audio in Twilio's buffer. What the caller did not hear is sent again at the
        unpause."""
        live = [u for u in self.utterances.values() if u.live]
        if utterance_id is None:
            targets = [u for u in live if not u.paused]
        else:
            target = self._line(utterance_id)
            if not target.live:
                raise ProtocolError("utterance_closed", f"utterance {utterance_id!r} has ended", utterance_id)
            if target.paused:
                self._run(self.protocol.pause(utterance_id, now))  # the same answer again
                return
            targets = [target]
        for line, (played_ms, heard) in self._stop_listening(targets, live, now):
            line.by = by
            self._stop_one(self.protocol.pause, line, now, played_ms, heard)
        self._wake.set()

    def _stop_one(
        self,
        stop: Callable[..., list[Action]],
        line: PhoneUtterance,
        now: float,
        played_ms: int | None,
        heard: int | None,
    ) -> None:
        """One utterance's part of a barge-in or pause (`protocol.cancel` / `protocol.pause`): a
        refusal (an utterance the protocol no longer knows) goes to the agent, the others go on."""
        try:
            actions = stop(line.utterance_id, now, played_ms=played_ms, heard_index=heard, source="marks")
        except ProtocolError as exc:
            self._error(exc.code, exc.message, exc.utterance_id)
            return
        self._run(actions)

    def _stop_listening(
        self, targets: list[PhoneUtterance], live: list[PhoneUtterance], now: float
    ) -> list[tuple[PhoneUtterance, tuple[int | None, int | None]]]:
        """Where the caller is in each target, from the marks back before the `clear` that this
        sends when a target has audio in Twilio's buffer (the other utterances there join the
        targets: clear empties the whole buffer). A paused one's position is the protocol's."""
        clear = any(u.on_line for u in targets)
        if clear:
            targets = list(dict.fromkeys(targets + [u for u in live if u.on_line]))
        positions: list[tuple[int | None, int | None]] = []
        for line in targets:
            if line.paused:
                positions.append((None, None))
                continue
            played_ms = self._played_samples(line, now) * 1000 // RATE
            positions.append((played_ms, line.heard_index))
            line.fence = played_ms * RATE // 1000 if line.on_line else None
        if clear:
            self._to_twilio.append(twilio_message(self.stream_sid, "clear"))
            cleared = {u for u in targets if u.on_line}
            self._void(lambda m: m.utterance in cleared)
            for line in cleared:
                line.on_line = False
        return list(zip(targets, positions, strict=True))
