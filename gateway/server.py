"""Run the gateway under uvicorn, with an ordered graceful shutdown: stop accepting connections,
drain and close the open sessions with 1001, then let uvicorn finish (lifespan stops the engine)."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

from engine.api import Engine
from gateway.app import Gateway, create_app
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.gc_pauses import GcPauses
from gateway.open_files import raise_open_files_limit
from gateway.session import FRAME_WRITER

log = logging.getLogger("cadence.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth_enabled: bool, insecure: bool) -> str:
    """The start-up line about who can reach the server; raises SystemExit for an open server on
    a non-loopback address unless `insecure` was asked for."""
    if auth_enabled:
        return f"API keys configured: every endpoint but /, /healthz, /readyz and /health needs a key or token ({host})"
    if is_loopback(host):
        return (
            f"no API keys configured: open to anyone on this machine, listening on loopback {host} only "
            "(set CADENCE_API_KEYS or --api-keys-file to serve other hosts)"
        )
    if not insecure:
        raise SystemExit(
            f"refusing to serve {host} without API keys: anyone who can reach it could use the engine. "
            "Configure keys (CADENCE_API_KEYS / --api-keys-file), bind 127.0.0.1, or pass --insecure."
        )
    return f"INSECURE: no API keys configured and listening on {host}: anyone who can reach it may use it"


def frame_header(opcode: int, size: int) -> bytes:
    """The head of one final, unmasked server frame (RFC 6455 5.2) carrying `size` bytes."""
    if size < 126:
        return bytes((0x80 | opcode, size))
    if size < 1 << 16:
        return bytes((0x80 | opcode, 126)) + size.to_bytes(2, "big")
    return bytes((0x80 | opcode, 127)) + size.to_bytes(8, "big")


_BINARY_HEAD: Final = {size: frame_header(0x2, size) for size in range(1 << 12)}  # packets: no allocation


class DirectFrameWriter:
    """Data frames for uvicorn's sans-I/O WebSocket protocol, framed here and written straight to its
    transport: any number of messages in ONE write, without the per-message ASGI `send` (Starlette
    -> uvicorn -> websockets' frame objects). Frames go out uncompressed (RSV1 clear), which RFC 7692
    allows on a connection that negotiated permessage-deflate; the websockets connection state is
    untouched (data frames keep none), so close and ping go through uvicorn."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: WebSocketsSansIOProtocol) -> None:
        self._protocol = protocol

    @property
    def open(self) -> bool:
        """Data frames may go out: accepted, no close sent or received, the peer still there."""
        p = self._protocol
        return (
            p.handshake_complete
            and not p.close_sent
            and not p.disconnected
            and p.initial_response is None
            and p.conn.state is State.OPEN
            and not p.transport.is_closing()
        )

    @property
    def writable(self) -> bool:
        """False while the transport's buffer is over its high-water mark (the client reads slowly)."""
        return self._protocol.writable.is_set()

    async def wait_writable(self) -> None:
        await self._protocol.writable.wait()

    def write(self, messages: Iterable[bytes | str]) -> None:
        """Binary (bytes) and text (str, UTF-8; raises UnicodeEncodeError first) messages, in order."""
        parts: list[bytes] = []
        for message in messages:
            if isinstance(message, str):
                data = message.encode()
                parts += (frame_header(0x1, len(data)), data)
            else:
                parts += (_BINARY_HEAD.get(len(message)) or frame_header(0x2, len(message)), message)
        if parts:
            self._protocol.transport.write(b"".join(parts))


class LenientTextProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, except that a text frame which is not valid UTF-8 reaches the
    app (its bad bytes as surrogate escapes) instead of closing the socket with 1007: the session
    answers it with an `invalid_message` error and goes on, like any other bad message. An accepted
    upgrade's scope carries a DirectFrameWriter (extension FRAME_WRITER) for the session's frames."""

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = b"".join(self.frames)
            try:
                data.decode()
            except UnicodeDecodeError:
                self.frames = []
                self.queue.put_nowait(
                    {"type": "websocket.receive", "text": data.decode("utf-8", "surrogateescape")}
                )
                if not self.read_paused:
                    self.read_paused = True
                    self.transport.pause_reading()
                return
        super().send_receive_event_to_app()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # only an upgrade that is going ahead has one
        if scope is not None and not self.close_sent:
            scope["extensions"][FRAME_WRITER] = DirectFrameWriter(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        # the writer holds this protocol, which holds the scope: drop it, so the closed
        # connection is freed at once instead of waiting for a full collection
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"].pop(FRAME_WRITER, None)


# net container allocations between two young collections (CPython: 700). Streams make and drop
# thousands of objects a second (packets, messages): with CPython's threshold the collector runs
# many times a second and promotes objects that would have died young, which then fill the older
# generations and bring long full collections; ten times the threshold lets most of them die first
YOUNG_GC_THRESHOLD = int(os.environ.get("CADENCE_GC_YOUNG_THRESHOLD", "7000"))
# middle-generation collections before a full one (CPython: 10). A full collection walks every live
# object, and at hundreds of streams its pause can outlast the lead of a stream's first chunks, so
# that streams run dry. A session's objects are freed by reference counting (no cycles), so little
# is left for a full collection to find: it runs seldom
FULL_GC_AFTER = int(os.environ.get("CADENCE_GC_FULL_AFTER", "100"))


def settle_garbage_collector() -> None:
    """Once started: what is alive now (modules, app, engine) moves where the cyclic collector never
    looks again, so its collections while streams run scan only what the streams made (every packet
    in flight waits through a collection), and the youngest generation (and, when
    CADENCE_GC_FULL_AFTER says so, the oldest) is collected less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, gc.get_threshold()[1], FULL_GC_AFTER)


class GatewayServer(uvicorn.Server):
    """uvicorn.Server whose shutdown closes our sessions with 1001 (uvicorn's own would be 1012)."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, *, freeze_gc: bool = False) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.freeze_gc = freeze_gc
        self.gc_pauses: GcPauses | None = None
        self.on_started: Callable[[], None] | None = None  # once serving (a supervising parent's cue)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM start the orderly shutdown, as in uvicorn, but are not raised again
        once it is done: the drain is what they ask for, so the process then ends with status 0
        (uvicorn's re-raise ends it by the signal, 143, or with a KeyboardInterrupt traceback)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.freeze_gc and self.started:
            settle_garbage_collector()
            # the collector's pauses, timed from now on (a hook of the whole process: served only)
            self.gc_pauses = GcPauses().install()
            self.gateway.metrics.watch_gc(self.gc_pauses)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting
        await self.gateway.close_sessions()
        await super().shutdown(sockets)
        if self.gc_pauses is not None:
            self.gc_pauses.uninstall()


def build_server(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: GatewayConfig | None = None,
    *,
    auth: Authenticator | None = None,
    insecure: bool = False,
    freeze_gc: bool = False,
    **uvicorn_options: Any,
) -> GatewayServer:
    """The server; `freeze_gc` (a process of its own: `serve`) settles the garbage collector once started."""
    config = config or GatewayConfig()
    app = create_app(engine, config, auth)
    gateway_state: Gateway = app.state.gateway
    exposure = check_exposure(host, gateway_state.auth.enabled, insecure)
    (log.warning if exposure.startswith("INSECURE") else log.info)(exposure)
    print(f"cadence: {exposure}", flush=True)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ws=LenientTextProtocol,
        ws_max_size=config.max_message_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=int(config.drain_timeout_s) + 5,
        **uvicorn_options,
    )
    gateway: Gateway = app.state.gateway
    return GatewayServer(uv_config, gateway, freeze_gc=freeze_gc)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: GatewayConfig | None = None,
    log_level: str = "info",
    insecure: bool = False,
) -> None:
    """Serve until SIGINT / SIGTERM."""
    raise_open_files_limit()
    build_server(engine, host, port, config, insecure=insecure, freeze_gc=True, log_level=log_level).run()
