"""The soak client reports how a session ended: the server's close code and reason, the phase,
the session and utterance, so a failed soak says why."""

from __future__ import annotations

import asyncio
import json
import random
import time

from websockets.asyncio.server import ServerConnection, serve

from bench.soak import Tally, _drift, session
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory
from tests.integration.wsclient import Client, connect


async def _closes_after_start(ws: ServerConnection) -> None:
    start = json.loads(await ws.recv())
    assert start["type"] == "session.start"
    await ws.recv()  # the first utterance's text
    await ws.close(1008, "client too slow: a send blocked for 11 s")


async def test_a_server_close_is_recorded_with_its_code_and_reason() -> None:
    async with serve(_closes_after_start, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        tally = Tally()
        await session(
            f"ws://127.0.0.1:{port}/v1/stream", 7, time.monotonic() + 5, tally, random.Random(1), 0.0
        )
    assert tally.errors == {"ConnectionClosedError": 1}
    [detail] = tally.details
    assert detail["close_code"] == 1008 and detail["close_reason"].startswith("client too slow")
    assert detail["session"] == 7 and detail["utterance"] == 1 and detail["phase"] == "utterance"


def test_history_entries_are_capped_per_session_and_drift_is_relative() -> None:
    tally = Tally()
    cap = GatewayConfig().history_size
    tally.finished.update({0: cap - 1, 1: cap + 100})
    assert tally.history_entries() == (cap - 1) + cap
    assert _drift(105.0, 100.0) == 0.05 and _drift(None, 100.0) is None and _drift(1.0, 0.0) is None


async def test_failed_and_finished_utterances_leave_no_per_utterance_state(
    gateway_factory: GatewayFactory,
) -> None:
    engine = FakeEngine(fail_after_words=2)
    gw = gateway_factory(engine)
    async with connect(gw.ws) as ws:
        c = Client(ws)
        for i in range(30):
            uid = f"u{i}"
            text = "one two three four" if i % 2 else "one"  # odd ones fail in the engine
            await c.send(type="speak.append", utterance_id=uid, text=text, flush=True)
            await c.send(type="speak.end", utterance_id=uid)
            if i % 2:
                assert (await c.until("error", uid))["code"] == "internal"
            else:
                await c.until("utterance.done", uid)
        [live] = gw.server.gateway.sessions
        for _ in range(50):  # the last failure's actions run on the server's loop
            if not live.protocol.active_count:
                break
            await asyncio.sleep(0.02)
        assert live.protocol.active_count == 0
        assert not live._clocks and not live._streams and not live._pulls and not live._stream_t0
        assert len(live.protocol._history) == min(30, GatewayConfig().history_size)
