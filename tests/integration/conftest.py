"""Run the real gateway under uvicorn on a free loopback port, in a background thread with its own
event loop (like uvicorn's run_server() test helper), for tests that talk to it over sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from engine.api import Engine
from gateway.config import GatewayConfig
from gateway.server import GatewayServer, build_server
from tests.fakes import FakeEngine


@dataclass
class RunningGateway:
    server: GatewayServer
    engine: Engine
    port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def stop(self) -> None:
        self.server.should_exit = True


@contextmanager
def run_gateway(
    engine: Engine, config: GatewayConfig | None = None, **options: Any
) -> Iterator[RunningGateway]:
    server = build_server(engine, "127.0.0.1", 0, config, log_level="warning", lifespan="on", **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningGateway(server, engine, port)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


GatewayFactory = Callable[..., RunningGateway]


@pytest.fixture
def gateway_factory() -> Iterator[GatewayFactory]:
    """Start gateways with a given engine and config; all are stopped after the test."""
    stack: list[contextmanager[RunningGateway]] = []  # type: ignore[valid-type]

    def start(
        engine: Engine | None = None, config: GatewayConfig | None = None, **options: Any
    ) -> RunningGateway:
        manager = run_gateway(engine or FakeEngine(), config, **options)
        stack.append(manager)
        return manager.__enter__()

    yield start
    for manager in reversed(stack):
        manager.__exit__(None, None, None)


@pytest.fixture
def gateway(gateway_factory: GatewayFactory) -> RunningGateway:
    return gateway_factory()
