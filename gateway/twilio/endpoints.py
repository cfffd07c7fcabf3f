"""`WS /v1/twilio` (a call's media stream) and `WS /v1/twilio/control/{callSid}` (its agent's
control channel), and the calls in progress by callSid. With several replicas a `CallRouter`
(gateway.cluster.calls) relays a control channel to the replica that holds the call.

A call belongs to a key: the one its media stream authenticated with (on the upgrade, or, as
Twilio must, in the `start` message's `token` parameter), or, while it waits for its stream, the
one its agent authenticated with. A control channel of another key finds no such call, exactly as
for a callSid that does not exist: each key waits for its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.api import Engine
from gateway.auth import (
    Authenticator,
    AuthError,
    KeyStore,
    Principal,
    TokenSigner,
    auth_deferred,
    authenticate,
    principal_of,
)
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.twilio.call import Call
from gateway.twilio.call_state import AgentSink
from gateway.twilio.vad import TwilioOptions
from gateway.webhooks import WebhookSender

CLOSE_POLICY: Final = 1008
TOKEN_PARAMETER: Final = "token"  # `<Parameter name="token" value="...">`: the stream's credential
START_WAIT_S: Final = 10.0  # a stream let in without credentials must bring them in `start` by then

AgentFrame = str | bytes | None  # a text or binary frame from the agent; None: it has gone


class CallRouter(Protocol):
    """With several replicas: the call directory and the relay of a control channel that lands on
    a replica other than the one holding the call's media stream (gateway.cluster.calls)."""

    def call_started(self, call_sid: str, owner: str) -> None: ...

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
        self.calls: dict[tuple[str, str], Call] = {}  # by (callSid, owner key)
        self.streams: dict[str, Call] = {}  # the calls whose media stream this replica holds
        self.router: CallRouter | None = None
        # the gateway's (the app sets it): checks a stream's `token` parameter
        self.auth = Authenticator(KeyStore(), TokenSigner())
        # whether a key may speak in a voice (gateway.voices.VoiceRegistry.usable_by; the app
        # sets the gateway's registry): a call speaks only its agent's key's registered voices
        self.voice_usable: Callable[[str, str], bool] = lambda key_id, voice: True

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/twilio", self.media_stream),
            WebSocketRoute("/v1/twilio/control/{call_sid}", self.control),
        ]

    def _call(self, call_sid: str, owner: str) -> Call:
        """The call `owner`'s key has under `call_sid`: live, or waiting for its stream (new if none)."""
        call = self.calls.get((call_sid, owner))
        if call is None or call.ended:
            call = Call(call_sid, self.engine, self.config, self.options, self.webhooks, self.metrics)
            call.owner = owner
            self.calls[(call_sid, owner)] = call
        return call

    def owned(self, call_sid: str, owner: str) -> Call | None:
        """The live call of key `owner` whose media stream this replica holds."""
        call = self.streams.get(call_sid)
        return call if call is not None and call.owner == owner and not call.ended else None

    def _forget(self, call: Call) -> None:
        key = (call.call_sid, call.owner)
        if self.calls.get(key) is call and call.twilio is None and call.agent is None:
            del self.calls[key]

    async def media_stream(self, websocket: WebSocket) -> None:
        await websocket.accept()
        call: Call | None = None
        writer: asyncio.Task[None] | None = None
        try:
            start = await self._start_of(websocket)
            owner = await self._stream_owner(websocket, start) if start is not None else None
            if start is None or owner is None:
                return  # gone, or refused: nothing was registered
            call = self._take_stream(websocket, start, owner)
            if call is None:
                await websocket.close(CLOSE_POLICY, "this call already has a media stream")
                return
            writer = asyncio.get_running_loop().create_task(call.write_twilio(websocket))
            await self._follow_stream(websocket, call)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            if call is not None:
                self._end_stream(call)
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            if websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await websocket.close()

    async def _start_of(self, websocket: WebSocket) -> Mapping[str, Any] | None:
        """Twilio's `start` (what comes before it, `connected` or media, is ignored); None when the
        stream left first, or, let in without credentials, did not send it within START_WAIT_S."""
        try:
            async with asyncio.timeout(START_WAIT_S if auth_deferred(websocket.scope) else None):
                while True:
                    message = await next_twilio_message(websocket)
                    if message.get("event") == "start":
                        return message
        except TimeoutError:
            await websocket.close(CLOSE_POLICY, f"no `start` with a {TOKEN_PARAMETER!r} parameter")
            return None

    async def _stream_owner(self, websocket: WebSocket, start: Mapping[str, Any]) -> str | None:
        """The key the stream authenticated with: on the upgrade, or, for a stream let in without
        credentials (Twilio sends no header and drops query strings), the `token` parameter of
        its `start`, checked off the event loop. None once the stream is refused (1008)."""
        if not auth_deferred(websocket.scope):
            return principal_of(websocket).key_id
        credential = token_parameter(start)
        try:
            if credential is None:
                raise AuthError(
                    f'missing credentials: add <Parameter name="{TOKEN_PARAMETER}"> to the <Stream>'
                )
            principal = await authenticate(self.auth, credential)
        except AuthError as exc:
            await websocket.close(CLOSE_POLICY, str(exc)[:120])
            return None
        websocket.scope.setdefault("state", {})["principal"] = principal
        return principal.key_id

    def _take_stream(self, websocket: WebSocket, start: Mapping[str, Any], owner: str) -> Call | None:
        """Register the stream's call under its callSid (None: that call has a stream already)."""
        call_sid = call_sid_of(start)
        if call_sid in self.streams:
            return None
        call = self._call(call_sid, owner)
        self.streams[call_sid] = call
        call.twilio = websocket
        call.on_start(without_token(start))
        if self.router is not None:
            self.router.call_started(call_sid, owner)
        return call

    async def _follow_stream(self, websocket: WebSocket, call: Call) -> None:
        loop = asyncio.get_running_loop()
        while not call.ended:
            call.on_twilio(await next_twilio_message(websocket), loop.time())

    def _end_stream(self, call: Call) -> None:
        call.end("disconnected")
        call.twilio = None
        if self.streams.get(call.call_sid) is call:
            del self.streams[call.call_sid]
        self._forget(call)
        if self.router is not None:
            self.router.call_ended(call.call_sid, call.end_reason or "disconnected")

    async def control(self, websocket: WebSocket) -> None:
        await websocket.accept()
        call_sid = str(websocket.path_params["call_sid"])
        principal = principal_of(websocket)
        if self.router is not None and self.owned(call_sid, principal.key_id) is None:
            await self.router.serve_agent(websocket, call_sid)  # held elsewhere, or not yet started
            return
        call = self._call(call_sid, principal.key_id)
        if call.agent is not None:
            await websocket.close(CLOSE_POLICY, "this call already has an agent")
            return
        self.attach(call, websocket, principal)
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


def call_sid_of(start: Mapping[str, Any]) -> str:
    body = start.get("start")
    return str((body.get("callSid") if isinstance(body, Mapping) else None) or start.get("streamSid") or "")


def _parameters(start: Mapping[str, Any]) -> Mapping[str, Any]:
    body = start.get("start")
    params = body.get("customParameters") if isinstance(body, Mapping) else None
    return params if isinstance(params, Mapping) else {}


def token_parameter(start: Mapping[str, Any]) -> str | None:
    """The credential in a `start`'s custom parameters (`<Parameter name="token">`)."""
    value = _parameters(start).get(TOKEN_PARAMETER)
    return value if isinstance(value, str) and value else None


def without_token(start: Mapping[str, Any]) -> Mapping[str, Any]:
    """`start` without its `token` parameter: a credential is for Cadence, never for the agent (its
    `call.started`) nor the logs."""
    params = _parameters(start)
    if TOKEN_PARAMETER not in params:
        return start
    body = start["start"]
    kept = {k: v for k, v in params.items() if k != TOKEN_PARAMETER}
    return {**start, "start": {**body, "customParameters": kept}}


async def next_twilio_message(websocket: WebSocket) -> Mapping[str, Any]:
    """Twilio's next JSON object (anything else is skipped)."""
    while True:
        try:
            message = json.loads(await websocket.receive_text())
        except ValueError:
            continue
        if isinstance(message, dict):
            return message


async def next_agent_frame(websocket: WebSocket) -> AgentFrame:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        return None
    if message.get("text") is not None:
        return str(message["text"])
    return bytes(message.get("bytes") or b"")
