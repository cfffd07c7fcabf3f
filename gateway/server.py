"""Run the gateway under uvicorn, with an ordered graceful shutdown: stop accepting connections,
drain and close the open sessions with 1001, then let uvicorn finish (lifespan stops the engine)."""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from engine.api import Engine
from gateway.app import Gateway, create_app
from gateway.config import GatewayConfig


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
    **uvicorn_options: Any,
) -> GatewayServer:
    config = config or GatewayConfig()
    app = create_app(engine, config)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
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
    log_level: str = "info",
) -> None:
    """Serve until SIGINT / SIGTERM."""
    build_server(engine, host, port, config, log_level=log_level).run()
