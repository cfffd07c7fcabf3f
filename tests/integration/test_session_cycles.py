"""A closed session is freed by reference counting alone: nothing of it is left in a reference cycle
for the collector. Cyclic garbage piles up in the oldest generation, and the full collection that
frees it pauses every stream in the process."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.integration.conftest import RunningGateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)

# gateway and uvicorn types one session makes; none may be in a cycle once it is closed
WATCHED = {
    "Session",
    "WebhookSession",
    "SessionProtocol",
    "SendQueue",
    "Utterance",
    "Packetiser",
    "DirectFrameWriter",
    "LenientTextProtocol",
    "StreamResampler",
    "SynthesisRequest",
    "WebSocket",
}


@pytest.fixture
def collector_off() -> Iterator[None]:
    """No automatic collection while the test runs: cyclic garbage stays where the check sees it."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


def cyclic_garbage() -> Counter[str]:
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def one_session(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        # a whole utterance, a barge-in on a second one, and a bad message on the way
        await c.send(type="speak.append", utterance_id="u1", text="Sure, I can help you with that.")
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
        await c.send(type="speak.append", utterance_id="u2", text="It will only take a moment, I promise.")
        await c.send(type="speak.end", utterance_id="u2")
        await c.until("utterance.started", "u2")
        await c.send(type="speak.cancel", utterance_id="u2", played_ms=120)
        await c.until("utterance.interrupted", "u2")
        await ws.send("{not json")
        await c.until("error")


def wait_for_no_sessions(gateway: RunningGateway) -> None:
    deadline = time.monotonic() + 10
    while gateway.server.gateway.sessions:
        assert time.monotonic() < deadline, "the session did not end"
        time.sleep(0.01)
    time.sleep(0.2)  # the connection's own teardown (connection_lost) after the session's


def test_a_closed_session_leaves_no_cyclic_garbage(gateway: RunningGateway, collector_off: None) -> None:
    asyncio.run(one_session(gateway))  # a first session: one-off objects (caches, imports) settle
    wait_for_no_sessions(gateway)
    cyclic_garbage()
    asyncio.run(one_session(gateway))
    wait_for_no_sessions(gateway)
    left = cyclic_garbage()
    assert not {name: n for name, n in left.items() if name in WATCHED}, left.most_common(20)
