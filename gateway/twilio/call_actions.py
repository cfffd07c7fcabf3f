"""The session protocol's actions on the line, and the engine streams they open: audio and
utterance.done into a line's queue, events to the agent (and the interruption webhook), a pause's
frames handed back, the engine's chunks pulled (or held while throttled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from engine.api import EngineError
from gateway.packets import Packet
from gateway.protocol import (
    Action,
    CancelStream,
    CloseText,
    Hold,
    OpenStream,
    Purge,
    PushText,
    SendAudio,
    SendControl,
    SendTrailer,
    Throttle,
    WakeAt,
)
from gateway.twilio.barge_in import BargeIn
from gateway.twilio.line import PhoneUtterance, UtteranceDone
from gateway.twilio.media import RATE, packet_from
from gateway.webhooks import interruption_payload

log = logging.getLogger("cadence.twilio")


class CallActions(BargeIn):
    """The part of `Call` that runs the protocol's actions."""

    def _run(self, actions: list[Action]) -> None:
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, SendAudio):
                line = self._streams.get(action.stream)
                if line is not None and line.live:
                    line.queue.extend(action.packets)
                    self._wake.set()
            elif isinstance(action, SendControl):
                self._to_agent_from_protocol(action.message)
            elif isinstance(action, SendTrailer):
                line = self._streams.get(action.stream)
                if line is not None and line.live:
                    line.queue.append(UtteranceDone(action.message))
                    self._wake.set()
            elif isinstance(action, Purge):
                line = self._streams.get(action.stream)
                if line is not None:
                    line.queue.clear()
            elif isinstance(action, OpenStream):
                pending.extendleft(reversed(self._open(action)))
            elif isinstance(action, PushText):
                pending.extendleft(reversed(self._push(action)))
            elif isinstance(action, CloseText):
                line = self.utterances.get(action.utterance_id)
                if line is not None:
                    with contextlib.suppress(Exception):
                        line.engine_stream.close_text()
            elif isinstance(action, CancelStream):
                line = self.utterances.get(action.utterance_id)
                if line is not None:
                    self._end_engine(line)
            elif isinstance(action, Hold):
                pending.extendleft(reversed(self._hold(action)))
            elif isinstance(action, Throttle):
                self._throttle(action)
            elif isinstance(action, WakeAt):
                self.loop.call_at(action.at, self._tick)
            # Unhold: the line is not paced; Close: the call lasts as long as Twilio's stream

    def _to_agent_from_protocol(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        line = self.utterances.get(str(message.get("utterance_id", "")))
        if kind == "utterance.started":
            self.to_agent({"type": kind, "utterance_id": message["utterance_id"]})
        elif kind == "words":
            if line is not None:
                line.word_ends += [w["end_ms"] * RATE // 1000 for w in message["words"]]
            self.to_agent(message)
        elif kind == "utterance.interrupted":
            report = {**message, "by": line.by if line is not None else "agent"}
            if line is not None:
                line.report = report
                self._stop(line, "interrupted")
            self.to_agent(report)
            if self.webhook_url is not None:
                payload = interruption_payload(report, self.call_sid, call_sid=self.call_sid)
                self.webhooks.submit(self.webhook_url, "utterance.interrupted", payload)
        elif kind == "utterance.paused":
            if line is not None:
                line.paused = True
            self.to_agent({**message, "by": line.by if line is not None else "agent"})
        elif kind == "utterance.unpaused":
            if line is not None:
                line.paused, line.fence = False, None
                self._wake.set()
            self.to_agent(message)
        elif kind == "error":
            self.metrics.errors.labels(message["code"]).inc()
            self.to_agent(message)

    def _hold(self, action: Hold) -> list[Action]:
        """A pause: the line's queued frames, and after a clear the frames sent from the fence on,
        go back to the protocol (the end mark and utterance.done with them)."""
        line = self.utterances.get(action.utterance_id)
        if line is None:
            return []
        packets: list[Packet] = []
        if line.fence is not None:  # Twilio's buffer was emptied: from the fence on, again
            packets = [packet_from(p, line.fence) for p in line.sent if p.end_sample > line.fence]
            line.resume_from = line.fence
            line.next_mark = line.heard_index + 1
            line.all_sent = False
        queued = list(line.queue)
        packets += [p for p in queued if isinstance(p, Packet)]
        trailer = any(isinstance(p, UtteranceDone) for p in queued)
        line.queue.clear()
        line.sent.clear()
        line.anchor = None if line.fence is not None else line.anchor
        line.paused = True
        return self.protocol.held(action.utterance_id, packets, trailer)

    def _throttle(self, action: Throttle) -> None:
        line = self.utterances.get(action.utterance_id)
        if line is None:
            return
        if action.on:
            if line.gate is None:
                line.gate = asyncio.Event()
        elif line.gate is not None:
            line.gate.set()
            line.gate = None

    def _tick(self) -> None:
        if not self.ended:
            self._run(self.protocol.tick(self.loop.time()))
            self._wake.set()

    # -- engine audio -------------------------------------------------------------------------
    def _open(self, action: OpenStream) -> list[Action]:
        uid = action.utterance_id
        try:
            engine_stream = self.engine.open(action.request)
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine.open failed")
            return self.protocol.open_failed(uid, exc)
        utt = self.protocol.utterance(uid)
        assert utt is not None
        line = PhoneUtterance(uid, utt.stream, engine_stream)
        self.utterances.pop(uid, None)  # an id used again goes to the end of the line
        self.utterances[uid] = line
        self._streams[utt.stream] = line
        line.pull = self.loop.create_task(self._pull(line))
        self.metrics.utterances.labels("twilio").inc()
        return self.protocol.open_succeeded(uid)

    def _push(self, action: PushText) -> list[Action]:
        line = self.utterances.get(action.utterance_id)
        if line is None or not line.live:
            return []
        if line.first_text_at is None:
            line.first_text_at = self.loop.time()
        try:
            line.engine_stream.push(action.segment)
        except Exception as exc:
            self._stop(line, "failed")
            return self.protocol.stream_failed(action.utterance_id, exc)
        return []

    async def _pull(self, line: PhoneUtterance) -> None:
        uid = line.utterance_id
        try:
            async for chunk in line.engine_stream:
                if line.gate is not None:
                    await line.gate.wait()
                if not line.live:
                    return
                self._run(self.protocol.receive_chunk(uid, chunk))
            self._run(self.protocol.stream_ended(uid))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine stream of %s failed", uid)
            if line.live:
                self._stop(line, "failed")
                self._run(self.protocol.stream_failed(uid, exc))
