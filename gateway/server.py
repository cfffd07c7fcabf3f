"""Run the gateway under uvicorn, with an ordered graceful shutdown: stop accepting connections,
drain and close the open sessions with 1001, then let uvicorn finish (lifespan stops the engine)."""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from engine.api import Engine
from gateway.app import Gateway, create_app
from gateway.auth import Authenticator
from gateway.config import GatewayConfig

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
        return f"API keys configured: every endpoint but /, /healthz and /readyz needs a key or token ({host})"
    if is_loopback(host):
        return (f"no API keys configured: open to anyone on this machine, listening on loopback {host} only "
                "(set CADENCE_API_KEYS or --api-keys-file to serve other hosts)")
    if not insecure:
        raise SystemExit(
            f"refusing to serve {host} without API keys: anyone who can reach it could use the engine. "
            "Configure keys (CADENCE_API_KEYS / --api-keys-file), bind 127.0.0.1, or pass --insecure."
        )
    return f"INSECURE: no API keys configured and listening on {host}: anyone who can reach it may use it"


class LenientTextProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, except that a text frame which is not valid UTF-8 reaches the
    app (its bad bytes as surrogate escapes) instead of closing the socket with 1007: the session
    answers it with an `invalid_message` error and goes on, like any other bad message."""

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = b"".join(self.frames)
            try:
                data.decode()
            except UnicodeDecodeError:
                self.frames = []
                self.queue.put_nowait({"type": "websocket.receive", "text": data.decode("utf-8", "surrogateescape")})
                if not self.read_paused:
                    self.read_paused = True
                    self.transport.pause_reading()
                return
        super().send_receive_event_to_app()


class GatewayServer(uvicorn.Server):
    """uvicorn.Server whose shutdown closes our sessions with 1001 (uvicorn's own would be 1012)."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting
        await self.gateway.close_sessions()
        await super().shutdown(sockets)


def build_server(
    engine: Engine, host: str = "127.0.0.1", port: int = 8000, config: GatewayConfig | None = None,
    *, auth: Authenticator | None = None, insecure: bool = False, **uvicorn_options: Any,
) -> GatewayServer:
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
    return GatewayServer(uv_config, gateway)


def serve(
    engine: Engine, host: str = "127.0.0.1", port: int = 8000, config: GatewayConfig | None = None,
    log_level: str = "info", insecure: bool = False,
) -> None:
    """Serve until SIGINT / SIGTERM."""
    build_server(engine, host, port, config, insecure=insecure, log_level=log_level).run()
