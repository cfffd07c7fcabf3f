"""One phone call: the events of its two sockets, and its end.

Its parts, one module each, every one building on `CallState` (gateway.twilio.call_state, with the
channel to the agent): `Playout` writes the line's audio and follows the marks, `BargeIn` stops
and pauses utterances with `clear`, `CallActions` runs the session protocol's actions and pulls
the engine's audio. `Call` takes what Twilio and the agent send.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gateway.messages import (
    ProtocolError,
    SessionEnd,
    SessionStart,
    SpeakAppend,
    SpeakCancel,
    SpeakEnd,
    SpeakFlush,
    SpeakPause,
    SpeakUnpause,
    decode,
    webhook_url_problem,
)
from gateway.twilio.call_actions import CallActions
from gateway.twilio.media import inbound_pcm
from gateway.twilio.vad import EnergyVad

log = logging.getLogger("cadence.twilio")


class Call(CallActions):
    """One phone call: the Twilio socket, the agent's socket (either may come first) and the
    utterances being spoken on the line, in order. The agent's messages, the engine's audio and
    the echoed marks go through a `SessionProtocol` (the one of `/v1/stream`); this class is its
    I/O: it plays one utterance after the other, sends marks and `clear`, and maps the
    protocol's answers onto the control channel's messages."""

    # -- the Twilio side ----------------------------------------------------------------------
    def on_start(self, message: Mapping[str, Any]) -> None:
        # Twilio sends objects here; anything else says nothing, and the call goes on with defaults
        start = message.get("start")
        start = start if isinstance(start, Mapping) else {}
        self.stream_sid = str(message.get("streamSid") or start.get("streamSid") or "")
        params = start.get("customParameters")
        params = params if isinstance(params, Mapping) else {}
        self.start_info = {**start, "customParameters": dict(params)}
        self.options = self.options.with_parameters(params)
        self.vad = EnergyVad(
            self.options.vad_threshold_dbfs, self.options.vad_attack_ms, self.options.vad_hang_ms
        )
        self.protocol.voice = params.get("voice") or self.protocol.voice
        self.protocol.language = params.get("language") or self.protocol.language
        url = params.get("webhook_url")
        self.parameter_errors = []
        if url is not None:
            # held to session.start's rules; one that breaks them is not used, and the agent
            # hears why as it would from its own session.start
            problem = webhook_url_problem(url)
            if problem is None:
                self.webhook_url = url
            else:
                self.parameter_errors.append({"type": "error", "code": "invalid_message", "message": problem})
        self.announce_call()
        self._wake.set()

    def on_twilio(self, message: Mapping[str, Any], now: float) -> None:
        event = message.get("event")
        if event in ("media", "mark", "dtmf"):
            body = message.get(event) or {}
            if not isinstance(body, Mapping):
                # one malformed event is dropped alone: the call and the events after it go on
                log.warning(
                    "call %s: Twilio %s event whose %r is not an object, ignored", self.call_sid, event, event
                )
                return
        if event == "media":
            self._on_media(body, now)
        elif event == "mark":
            self._on_mark(str(body.get("name", "")), now)
        elif event == "dtmf":
            self.to_agent({"type": "dtmf", "digit": str(body.get("digit", ""))})
        elif event == "stop":
            self.end("stop")

    def _on_media(self, media: Mapping[str, Any], now: float) -> None:
        pcm = inbound_pcm(media)
        if pcm is None:
            return
        change = self.vad.feed(pcm)
        if change == "start":
            self.to_agent({"type": "speech.started"})
            if self.options.barge_in_on_speech and any(u.live for u in self.utterances.values()):
                self.interrupt(None, "caller", now)
        elif change == "stop":
            self.to_agent({"type": "speech.stopped"})

    def on_agent(self, frame: str) -> None:
        try:
            message = decode(frame)
            now = self.loop.time()
            if isinstance(message, SessionStart):
                self.protocol.voice = message.voice or self.protocol.voice
                self.protocol.language = message.language or self.protocol.language
                self.protocol.instructions = message.instructions or self.protocol.instructions
                self.webhook_url = message.webhook_url or self.webhook_url
                if message.pause_timeout_ms is not None:
                    self.protocol.pause_timeout_ms = message.pause_timeout_ms
            elif isinstance(message, SpeakAppend | SpeakFlush | SpeakEnd | SpeakUnpause):
                self._run(self.protocol.receive_message(message, now))
            elif isinstance(message, SpeakCancel):
                self.interrupt(message.utterance_id, "agent", now)
            elif isinstance(message, SpeakPause):
                self.pause(message.utterance_id, "agent", now)
            elif isinstance(message, SessionEnd):
                self.detach_agent()
            else:
                raise ProtocolError(
                    "unknown_type", f"{message.type} is not offered on the Twilio control channel"
                )
        except ProtocolError as exc:
            self._error(exc.code, exc.message, exc.utterance_id)

    # -- the end ------------------------------------------------------------------------------
    def end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.end_reason = reason
        for line in self.utterances.values():
            if line.live:
                self._stop(line, "failed")
        self._run(self.protocol.abort())
        self.to_agent({"type": "call.ended", "call_sid": self.call_sid, "reason": reason})
        self._to_agent.put_nowait(None)
        self._wake.set()
        self._done.set()
