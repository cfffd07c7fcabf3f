"""What gateway/server.py relies on in uvicorn's sans-I/O WebSocket protocol, which is not uvicorn's
public API: the attributes and methods LenientTextProtocol and DirectFrameWriter read, override or
call, each with the type and meaning the gateway assumes. pyproject.toml pins uvicorn to the range
this passes on; an upgrade that renames or repurposes any of them fails here first (and not
silently in the transport). The second half exercises them over a real loopback connection."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.protocol import State
from websockets.server import ServerProtocol

from gateway.server import DirectFrameWriter, LenientTextProtocol
from gateway.session import FRAME_WRITER

pytestmark = pytest.mark.timeout(30)


def test_the_overridden_methods_keep_their_signatures() -> None:
    expected = {
        "send_receive_event_to_app": ["self"],
        "handle_connect": ["self", "event"],
        "connection_lost": ["self", "exc"],
        "handle_text": ["self", "event"],  # sets curr_msg_data_type and frames
        "handle_cont": ["self", "event"],
        "pause_writing": ["self"],  # clears `writable`
        "resume_writing": ["self"],  # sets it
    }
    for name, parameters in expected.items():
        method = getattr(WebSocketsSansIOProtocol, name)
        assert list(inspect.signature(method).parameters) == parameters, name
    assert LenientTextProtocol.__mro__[1] is WebSocketsSansIOProtocol


@pytest.fixture
async def fresh_protocol() -> WebSocketsSansIOProtocol:
    config = uvicorn.Config(Starlette(), ws=LenientTextProtocol, lifespan="off")
    config.load()
    return LenientTextProtocol(config, ServerState(), {}, asyncio.get_running_loop())


async def test_the_state_the_gateway_reads_exists_with_its_types(fresh_protocol: Any) -> None:
    p = fresh_protocol
    # DirectFrameWriter.open
    assert p.handshake_complete is False and p.close_sent is False and p.disconnected is False
    assert p.initial_response is None  # a response sent instead of the upgrade, once there is one
    assert isinstance(p.conn, ServerProtocol) and p.conn.state is State.CONNECTING
    assert hasattr(p, "transport")  # the asyncio.Transport once connection_made runs
    # DirectFrameWriter.writable / wait_writable
    assert isinstance(p.writable, asyncio.Event) and p.writable.is_set()
    p.pause_writing()
    assert not p.writable.is_set()
    p.resume_writing()
    assert p.writable.is_set()
    # LenientTextProtocol.send_receive_event_to_app
    assert p.curr_msg_data_type in ("text", "bytes")
    assert p.frames == [] and isinstance(p.frames, list)
    assert isinstance(p.queue, asyncio.Queue)
    assert p.read_paused is False


# -- over a real connection -----------------------------------------------------------------------

seen: dict[str, Any] = {}


async def endpoint(websocket: WebSocket) -> None:
    writer = websocket.scope["extensions"].get(FRAME_WRITER)
    seen["writer_before_accept"] = writer
    await websocket.accept()
    assert isinstance(writer, DirectFrameWriter)
    protocol = writer._protocol
    seen.update(
        protocol=protocol,
        open_after_accept=writer.open,
        writable=writer.writable,
        state=protocol.conn.state,
        transport_closing=protocol.transport.is_closing(),
        handshake_complete=protocol.handshake_complete,
    )
    writer.write([b"\x01\x02\x03", "text after binary", b"\x04" * 5000])
    seen["received"] = await websocket.receive_text()  # not UTF-8: reaches the app all the same
    await websocket.send_text("still open")
    message = await websocket.receive()
    seen["last"] = message["type"]
    seen["open_after_close"] = writer.open
    seen["scope"] = websocket.scope


@contextmanager
def served() -> Iterator[int]:
    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, ws=LenientTextProtocol, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield int(server.servers[0].sockets[0].getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(10)


async def test_the_transport_over_a_real_connection() -> None:
    seen.clear()
    with served() as port:
        async with websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
            frames = [await asyncio.wait_for(ws.recv(), 5) for _ in range(3)]
            assert frames == [b"\x01\x02\x03", "text after binary", b"\x04" * 5000]  # in order, whole
            await ws.send(b"bad \xff utf-8", text=True)
            assert await asyncio.wait_for(ws.recv(), 5) == "still open"
        deadline = time.monotonic() + 5
        while "open_after_close" not in seen:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    # the upgrade's scope carried the writer from handle_connect on; once accepted it may write
    assert isinstance(seen["writer_before_accept"], DirectFrameWriter)
    assert seen["open_after_accept"] is True and seen["writable"] is True
    assert seen["state"] is State.OPEN and seen["transport_closing"] is False
    assert seen["handshake_complete"] is True
    assert seen["received"] == "bad \udcff utf-8"  # the bad byte as a surrogate escape
    assert seen["last"] == "websocket.disconnect" and seen["open_after_close"] is False
    protocol = seen["protocol"]
    assert protocol.close_sent or protocol.disconnected or protocol.conn.state is not State.OPEN
    # connection_lost let the writer go (it holds the protocol, which holds the scope)
    deadline = time.monotonic() + 5
    while FRAME_WRITER in seen["scope"]["extensions"]:
        assert time.monotonic() < deadline, "the writer was not dropped"
        await asyncio.sleep(0.01)
