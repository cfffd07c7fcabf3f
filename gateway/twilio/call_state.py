"""A call's state, its channel to the agent, and the steps its parts share (gateway.twilio.call
lists the parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Literal, Protocol

from starlette.websockets import WebSocket

from engine.api import Engine
from gateway.auth import Principal
from gateway.config import GatewayConfig
from gateway.messages import ProtocolError, encode
from gateway.metrics import GatewayMetrics
from gateway.protocol import Action, SessionProtocol
from gateway.twilio.line import Mark, PhoneUtterance
from gateway.twilio.media import FRAME_MS, RATE
from gateway.twilio.vad import EnergyVad, TwilioOptions
from gateway.webhooks import WebhookSender


class AgentSink(Protocol):
    """Where a call's events for its agent go: the agent's WebSocket, or a link to the replica
    that holds it (gateway.cluster.calls)."""

    async def send_text(self, data: str) -> None: ...


class CallState:
    """What every part of `Call` reads and changes."""

    def __init__(
        self,
        call_sid: str,
        engine: Engine,
        config: GatewayConfig,
        options: TwilioOptions,
        webhooks: WebhookSender,
        metrics: GatewayMetrics,
    ) -> None:
        self.call_sid = call_sid
        self.engine = engine
        self.config = config
        self.options = options
        self.webhooks = webhooks
        self.metrics = metrics  # the gateway's, with the endpoint label "twilio"
        self.loop = asyncio.get_running_loop()
        line_config = replace(
            config,
            default_encoding="mulaw",
            default_sample_rate=RATE,
            default_packet_ms=FRAME_MS,
            idle_timeout_s=math.inf,  # the call lasts as long as Twilio's stream
            history_size=max(config.history_size, 64),  # a line plays long after the audio is made
        )
        self.protocol = SessionProtocol(f"twilio/{call_sid}", engine.info, line_config, now=self.loop.time())
        self.protocol.started = True  # the control channel has no session.started
        # the key the call belongs to: its media stream's, or, until the stream comes, its
        # agent's; a control channel of another key never reaches it (gateway.twilio.endpoints)
        self.owner = ""
        self.stream_sid: str | None = None
        self.start_info: dict[str, Any] = {}
        self.twilio: WebSocket | None = None
        self.agent: AgentSink | None = None
        self.ended = False
        self.end_reason: str | None = None
        self.webhook_url: str | None = None
        # `error`s about the stream's parameters: told to the agent with call.started, which
        # may attach after the stream started
        self.parameter_errors: list[dict[str, Any]] = []
        self.utterances: dict[str, PhoneUtterance] = {}  # in the order they were opened
        self._streams: dict[int, PhoneUtterance] = {}
        self.line_free_at = self.loop.time()  # when the line last finished sending an utterance
        self.vad = EnergyVad(options.vad_threshold_dbfs, options.vad_attack_ms, options.vad_hang_ms)
        self._marks: dict[str, Mark] = {}  # sent, not yet back, not voided by a clear
        # voided marks whose echo is still to come: Twilio echoes each mark once, and a mark sent
        # since may bear the same name (an unpause, an utterance id used again)
        self._voided: Counter[str] = Counter()
        self._to_twilio: deque[dict[str, Any]] = deque()  # control (clear), ahead of media
        self._to_agent: asyncio.Queue[str | None] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._done = asyncio.Event()

    def _run(self, actions: list[Action]) -> None:
        """Carry out the protocol's actions, in order (gateway.twilio.call_actions)."""
        raise NotImplementedError

    def _call_started(self) -> dict[str, Any]:
        return {
            "type": "call.started",
            "call_sid": self.call_sid,
            "stream_sid": self.stream_sid,
            "custom_parameters": dict(self.start_info.get("customParameters") or {}),
            "media_format": self.start_info.get("mediaFormat"),
        }

    async def _sleep(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _line(self, utterance_id: str) -> PhoneUtterance:
        line = self.utterances.get(utterance_id)
        if line is None:
            raise ProtocolError("unknown_utterance", f"no utterance {utterance_id!r}", utterance_id)
        return line

    def _stop(self, line: PhoneUtterance, state: Literal["interrupted", "failed"]) -> None:
        line.state = state
        line.queue.clear()
        line.sent.clear()
        line.on_line = False
        self._void(lambda m: m.utterance is line)
        self._end_engine(line)

    def _void(self, voided: Callable[[Mark], bool]) -> None:
        """Drop the outstanding marks `voided` picks; their echoes, still to come, are ignored."""
        self._voided.update(k for k, m in self._marks.items() if voided(m))
        self._marks = {k: m for k, m in self._marks.items() if not voided(m)}

    def _end_engine(self, line: PhoneUtterance) -> None:
        with contextlib.suppress(Exception):
            line.engine_stream.cancel()
        if line.gate is not None:
            line.gate.set()
        if line.pull is not None and line.pull is not asyncio.current_task():
            line.pull.cancel()

    # -- the agent side -----------------------------------------------------------------------
    def to_agent(self, message: Mapping[str, Any]) -> None:
        if self.agent is not None:
            self._to_agent.put_nowait(encode(message))

    def attach_agent(
        self, sink: AgentSink, principal: Principal, voice_usable: Callable[[str, str], bool]
    ) -> None:
        """`principal`: the agent's credentials; `voice_usable(key_id, voice)`: whether a key may
        speak in a voice (gateway.voices.VoiceRegistry.usable_by)."""
        self.agent = sink
        self._speak_for(principal, voice_usable)
        self._to_agent = asyncio.Queue()
        if self.stream_sid is not None:
            self.announce_call()

    def announce_call(self) -> None:
        """call.started, then what was wrong with the stream's parameters."""
        self.to_agent(self._call_started())
        for error in self.parameter_errors:
            self.to_agent(error)

    def _speak_for(self, principal: Principal, voice_usable: Callable[[str, str], bool]) -> None:
        """The agent sends the text, so its key owns what the call says: utterances it opens pass
        its token's voice list and speak only that key's registered voices, whoever wrote the
        stream's `voice` parameter, as a `/v1/stream` session of that key would."""
        self.protocol.key_id = principal.key_id
        self.protocol.allowed_voices = principal.voices
        self.protocol.voice_usable = functools.partial(voice_usable, principal.key_id)

    def detach_agent(self) -> None:
        self.agent = None
        self._to_agent.put_nowait(None)

    async def write_agent(self, sink: AgentSink) -> None:
        queue = self._to_agent
        while True:
            item = await queue.get()
            if item is None:
                return
            await sink.send_text(item)

    def _error(self, code: str, message: str, utterance_id: str | None = None) -> None:
        error: dict[str, Any] = {"type": "error", "code": code, "message": message}
        if utterance_id is not None:
            error["utterance_id"] = utterance_id
        self.to_agent(error)
