"""`WS /v1/twilio` (a call's media stream) and `WS /v1/twilio/control/{callSid}` (its agent's
control channel), and the calls in progress by callSid. With several replicas a `CallRouter`
(gateway.cluster.calls) relays a control channel to the replica that holds the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.api import Engine
from gateway.auth import ANONYMOUS, Principal
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.twilio.call import Call
from gateway.twilio.call_state import AgentSink
from gateway.twilio.vad import TwilioOptions
from gateway.webhooks import WebhookSender

CLOSE_POLICY: Final = 1008

AgentFrame = str | bytes | None  # a text or binary frame from the agent; None: it has gone


class CallRouter(Protocol):
    """With several replicas: the call directory and the relay of a control channel that lands on
    a replica other than the one holding the call's media stream (gateway.cluster.calls)."""

    def call_started(self, call_sid: str) -> None: ...

    def call_ended(self, call_sid: str, reason: str) -> None: ...

    async def serve_agent(self, websocket: WebSocket, call_sid: str) -> None: ...


class TwilioGateway:
    """The calls in progress, by callSid, and the two WebSocket endpoints. With a `router`
    (several replicas behind one front) the call directory is kept in Redis and a control channel
    for a call held elsewhere is relayed to its owner."""

    def __init__(
        self,
        engine: Engine,
        config: GatewayConfig,
        webhooks: WebhookSender,
        options: TwilioOptions | None = None,
        *,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.webhooks = webhooks
        self.options = options or TwilioOptions()
        self.metrics = metrics or GatewayMetrics()
        self.calls: dict[str, Call] = {}
        self.router: CallRouter | None = None
        # whether a key may speak in a voice (gateway.voices.VoiceRegistry.usable_by; the app
        # sets the gateway's registry): a call speaks only its agent's key's registered voices
        self.voice_usable: Callable[[str, str], bool] = lambda key_id, voice: True

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/twilio", self.media_stream),
            WebSocketRoute("/v1/twilio/control/{call_sid}", self.control),
        ]

    def _call(self, call_sid: str) -> Call:
        call = self.calls.get(call_sid)
        if call is None or call.ended:
            call = Call(call_sid, self.engine, self.config, self.options, self.webhooks, self.metrics)
            self.calls[call_sid] = call
        return call

    def owned(self, call_sid: str) -> Call | None:
        """The live call whose media stream this replica holds."""
        call = self.calls.get(call_sid)
        return call if call is not None and call.twilio is not None and not call.ended else None

    def _forget(self, call: Call) -> None:
        if self.calls.get(call.call_sid) is call and call.twilio is None and call.agent is None:
            del self.calls[call.call_sid]

    async def media_stream(self, websocket: WebSocket) -> None:
        await websocket.accept()
        loop = asyncio.get_running_loop()
        call: Call | None = None
        writer: asyncio.Task[None] | None = None
        try:
            while True:
                text = await websocket.receive_text()
                try:
                    message = json.loads(text)
                except ValueError:
                    continue
                if not isinstance(message, dict):
                    continue
                if call is None:
                    if message.get("event") != "start":
                        continue  # `connected` (and anything before start)
                    start = message.get("start")
                    call_sid = str(
                        (start.get("callSid") if isinstance(start, dict) else None)
                        or message.get("streamSid")
                        or ""
                    )
                    call = self._call(call_sid)
                    if call.twilio is not None:
                        call = None
                        await websocket.close(CLOSE_POLICY, "this call already has a media stream")
                        return
                    call.twilio = websocket
                    call.on_start(message)
                    writer = loop.create_task(call.write_twilio(websocket))
                    if self.router is not None:
                        self.router.call_started(call_sid)
                    continue
                call.on_twilio(message, loop.time())
                if call.ended:
                    break
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            if call is not None:
                call.end("disconnected")
                call.twilio = None
                self._forget(call)
                if self.router is not None:
                    self.router.call_ended(call.call_sid, call.end_reason or "disconnected")
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            if websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await websocket.close()

    async def control(self, websocket: WebSocket) -> None:
        await websocket.accept()
        call_sid = str(websocket.path_params["call_sid"])
        if self.router is not None and self.owned(call_sid) is None:
            await self.router.serve_agent(websocket, call_sid)  # held elsewhere, or not yet started
            return
        call = self._call(call_sid)
        if call.agent is not None:
            await websocket.close(CLOSE_POLICY, "this call already has an agent")
            return
        self.attach(call, websocket, principal_of(websocket))
        try:
            await self.run_agent(call, websocket, lambda: next_agent_frame(websocket))
        finally:
            if websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await websocket.close()

    def attach(self, call: Call, sink: AgentSink, principal: Principal) -> None:
        """Make `sink` the call's agent, speaking for `principal` (the control channel's
        credentials, wherever the channel landed)."""
        call.attach_agent(sink, principal, self.voice_usable)

    async def run_agent(
        self, call: Call, sink: AgentSink, next_frame: Callable[[], Awaitable[AgentFrame]]
    ) -> None:
        """Serve an agent already attached to `call` (`attach`): its frames go to
        the call, the call's events to `sink`, until either side is done."""
        loop = asyncio.get_running_loop()
        writer = loop.create_task(call.write_agent(sink))
        reader = loop.create_task(self._read_agent(call, next_frame))
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if call.agent is sink:
                call.agent = None
            self._forget(call)

    async def _read_agent(self, call: Call, next_frame: Callable[[], Awaitable[AgentFrame]]) -> None:
        while True:
            frame = await next_frame()
            if frame is None:
                return
            if isinstance(frame, str):
                call.on_agent(frame)
            else:
                call._error("binary_not_supported", "binary frames from the agent are not accepted")

    async def close(self) -> None:
        for call in list(self.calls.values()):
            call.end("server shutting down")


def principal_of(websocket: WebSocket) -> Principal:
    """Who the control channel authenticated as (gateway.auth.AuthMiddleware); without keys
    configured, the anonymous principal."""
    principal = websocket.scope.get("state", {}).get("principal", ANONYMOUS)
    return principal if isinstance(principal, Principal) else ANONYMOUS


async def next_agent_frame(websocket: WebSocket) -> AgentFrame:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        return None
    if message.get("text") is not None:
        return str(message["text"])
    return bytes(message.get("bytes") or b"")
