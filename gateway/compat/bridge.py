"""A dialect's socket over native sessions: the one state machine (gateway.protocol, run by
gateway.session) under every dialect.

A `NativeLink` is a `/v1/stream` session whose client is the dialect, not a socket: the dialect
sends it native client messages (`session.start`, `speak.append`, ...) and hears its native
frames (JSON messages, binary audio packets), through the ASGI interface of a Starlette
WebSocket, so the session runs exactly as it does for a native client (quotas, pacing, flow
control, barge-in, shutdown). A dialect translates in both directions and nothing else; it keeps
no state machine of its own beyond the names it maps (its context ids -> utterance ids).

`DialectSocket` is the outer socket: it reads the client's frames, writes the dialect's frames
(one writer at a time), opens links (one per distinct set of session settings: a dialect whose
contexts differ in voice or format gets one link each) and ends them when the client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import Message, Scope
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.api import EngineInfo
from gateway.auth import Authenticator, AuthError, Principal, authenticate
from gateway.bodies import off_loop_if_large
from gateway.compat.voices import VoiceAliases
from gateway.messages import PacketHeader, encode, unpack_packet

log = logging.getLogger("cadence.compat")

ServeNative = Callable[[WebSocket], Awaitable[None]]  # gateway.app.Gateway.stream
NativeMessage = dict[str, Any]


@dataclass(frozen=True)
class Compat:
    """What every dialect's endpoint needs from the gateway."""

    serve_native: ServeNative
    engine_of: Callable[[], EngineInfo]  # the engine's info now (an upstream engine may learn it late)
    aliases: VoiceAliases
    auth: Authenticator
    # the native sessions' max_open_utterances (GatewayConfig): a dialect that queues utterances
    # opens no more than this many at once on one native session
    max_open_utterances: int = 8
    # the native sessions' max_text_chars (GatewayConfig): what an utterance's text may hold
    max_text_chars: int = 20_000

    @property
    def engine(self) -> EngineInfo:
        return self.engine_of()

    def voice(self, name: str | None) -> str | None:
        return self.aliases.resolve(name, self.engine)


FRAME_WRITER_KEY = "cadence.frame_writer"  # gateway.session.FRAME_WRITER: a link writes through ASGI


class NativeLink:
    """One native session driven by a dialect. `on_message` hears its JSON messages, `on_audio`
    its packets; both are awaited before the session sends its next frame (so a slow outer socket
    slows the session, as a slow native client would)."""

    def __init__(
        self,
        key: object,
        scope: Scope,
        on_message: Callable[[NativeLink, NativeMessage], Awaitable[None]],
        on_audio: Callable[[NativeLink, PacketHeader, bytes], Awaitable[None]],
        on_closed: Callable[[NativeLink], Awaitable[None]],
    ) -> None:
        self.key = key
        self.on_message = on_message
        self.on_audio = on_audio
        self.on_closed = on_closed
        self.closed = False
        self.close_code: int | None = None
        self.close_reason = ""
        self.output: Mapping[str, Any] = {}  # session.started's output
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._inbox.put_nowait({"type": "websocket.connect"})
        inner = dict(scope)
        extensions = dict(scope.get("extensions") or {})
        extensions.pop(FRAME_WRITER_KEY, None)  # frames go through `_send`, one by one
        inner["extensions"] = extensions
        inner["state"] = dict(scope.get("state") or {})
        self.websocket = WebSocket(inner, self._receive, self._send)
        self.task: asyncio.Task[None] | None = None

    def set_principal(self, principal: Principal) -> None:
        self.websocket.scope["state"]["principal"] = principal

    def send(self, message: NativeMessage) -> None:
        """A native client message; ignored once the session has ended."""
        if not self.closed:
            self._inbox.put_nowait({"type": "websocket.receive", "text": encode(message)})

    def disconnect(self, code: int = 1000) -> None:
        """The client is gone: the session ends and cancels its engine streams."""
        if not self.closed:
            self.closed = True
            self._inbox.put_nowait({"type": "websocket.disconnect", "code": code})

    async def _receive(self) -> Message:
        return await self._inbox.get()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.send":
            text = message.get("text")
            if text is not None:
                parsed = json.loads(text)
                if parsed.get("type") == "session.started":
                    self.output = parsed.get("output") or {}
                await self.on_message(self, parsed)
            else:
                header, payload = unpack_packet(bytes(message.get("bytes") or b""))
                await self.on_audio(self, header, payload)
        elif kind == "websocket.close":
            self.close_code = int(message.get("code") or 1000)
            self.close_reason = str(message.get("reason") or "")
            if not self.closed:
                self.closed = True
                self._inbox.put_nowait({"type": "websocket.disconnect", "code": self.close_code})
            await self.on_closed(self)


class DialectSocket:
    """The client's socket, speaking a dialect. Subclasses implement `on_text` (a client text
    frame), `on_link_message` / `on_link_audio` (native output) and may override `on_binary`,
    `on_link_closed` and `finished`."""

    def __init__(self, websocket: WebSocket, compat: Compat) -> None:
        self.websocket = websocket
        self.compat = compat
        self.serve_native = compat.serve_native
        self.links: dict[object, NativeLink] = {}
        self._write_lock = asyncio.Lock()
        self._closing = False
        self._socket_closed = asyncio.Event()

    # -- what the dialect implements ---------------------------------------------------------
    async def on_text(self, text: str) -> None:
        raise NotImplementedError

    async def on_binary(self, data: bytes) -> None:
        """Binary frames from the client: ignored unless the dialect takes them."""

    async def on_link_message(self, link: NativeLink, message: NativeMessage) -> None:
        raise NotImplementedError

    async def on_link_audio(self, link: NativeLink, header: PacketHeader, payload: bytes) -> None:
        raise NotImplementedError

    async def on_link_closed(self, link: NativeLink) -> None:
        """A native session ended (its own close, after session.end or a policy close)."""

    async def finished(self) -> None:
        """The client is gone or the socket is closing: last words, if any."""

    # -- who is calling ----------------------------------------------------------------------
    @property
    def auth_pending(self) -> bool:
        """The middleware let this socket in without credentials, for its first message to bring."""
        state = self.websocket.scope.get("state") or {}
        return bool(state.get("auth_deferred")) and "principal" not in state

    async def authenticate(self, credential: str | None) -> str | None:
        """Authenticate a credential from a message; None on success, else why not."""
        try:
            principal = await authenticate(self.compat.auth, credential)
        except AuthError as exc:
            return str(exc)
        self.websocket.scope.setdefault("state", {})["principal"] = principal
        return None

    # -- links -------------------------------------------------------------------------------
    def open_link(self, key: object, start: NativeMessage) -> NativeLink:
        """A new native session, started with `start` (a session.start message)."""
        link = NativeLink(
            key, self.websocket.scope, self.on_link_message, self.on_link_audio, self._link_closed
        )
        link.send(start)
        self.links[key] = link
        link.task = asyncio.get_running_loop().create_task(self._run_link(link), name=f"compat link {key}")
        return link

    async def _run_link(self, link: NativeLink) -> None:
        try:
            await self.serve_native(link.websocket)
        except Exception:
            log.exception("a compatible session's native session failed")
        finally:
            link.closed = True
            if self.links.get(link.key) is link:
                del self.links[link.key]

    async def _link_closed(self, link: NativeLink) -> None:
        if self.links.get(link.key) is link:
            del self.links[link.key]
        await self.on_link_closed(link)

    # -- the client's socket -----------------------------------------------------------------
    async def send_json(self, message: Mapping[str, Any]) -> None:
        await self.send_text(json.dumps(message, ensure_ascii=False, separators=(",", ":")))

    async def send_text(self, text: str) -> None:
        async with self._write_lock:
            if self.websocket.application_state is WebSocketState.CONNECTED and not self._closing:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.websocket.send_text(text)

    async def send_bytes(self, data: bytes) -> None:
        async with self._write_lock:
            if self.websocket.application_state is WebSocketState.CONNECTED and not self._closing:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.websocket.send_bytes(data)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the client's socket (after what is being written); the links end with it."""
        if not self._closing:
            self._closing = True
            asyncio.get_running_loop().create_task(self._close(code, reason))

    async def _close(self, code: int, reason: str) -> None:
        # after the frame being written, unless the client has stopped taking bytes
        locked = False
        with contextlib.suppress(TimeoutError):
            locked = await asyncio.wait_for(self._write_lock.acquire(), 1.0)
        try:
            if self.websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.websocket.close(code, reason[:120])
        finally:
            if locked:
                self._write_lock.release()
            self._socket_closed.set()

    async def run(self) -> None:
        """Serve the (accepted) socket until the client leaves or the dialect closes it."""
        reader = asyncio.get_running_loop().create_task(self._read())
        closer = asyncio.get_running_loop().create_task(self._socket_closed.wait())
        try:
            await asyncio.wait({reader, closer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, closer):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self._closing = True
            await self.finished()
            links = list(self.links.values())
            for link in links:
                link.disconnect()
            tasks = [link.task for link in links if link.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=5.0)
            if self.websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.websocket.close()

    async def _read(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text, data = message.get("text"), message.get("bytes")
            if text is not None:
                await self.on_text(text)
            elif data is not None:
                await self.on_binary(data)


async def read_frame(text: str) -> dict[str, Any] | None:
    """A client frame as a JSON object, or None when it is not one (a large one parsed off the loop)."""
    return await off_loop_if_large(parse_object, text)


def parse_object(text: str) -> dict[str, Any] | None:
    """A client frame as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
