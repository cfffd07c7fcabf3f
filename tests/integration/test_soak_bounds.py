"""The soak client reports how a session ended: the server's close code and reason, the phase,
the session and utterance, so a failed soak says why."""

from __future__ import annotations

import json
import random
import time

from websockets.asyncio.server import ServerConnection, serve

from scripts.soak import Tally, _drift, session


async def _closes_after_start(ws: ServerConnection) -> None:
    start = json.loads(await ws.recv())
    assert start["type"] == "session.start"
    await ws.recv()  # the first utterance's text
    await ws.close(1008, "client too slow: a send blocked for 11 s")


async def test_a_server_close_is_recorded_with_its_code_and_reason() -> None:
    async with serve(_closes_after_start, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        tally = Tally()
        await session(f"ws://127.0.0.1:{port}/v1/stream", 7, time.monotonic() + 5, tally, random.Random(1), 0.0)
    assert tally.errors == {"ConnectionClosedError": 1}
    [detail] = tally.details
    assert detail["close_code"] == 1008 and detail["close_reason"].startswith("client too slow")
    assert detail["session"] == 7 and detail["utterance"] == 1 and detail["phase"] == "utterance"


def test_history_entries_are_capped_per_session_and_drift_is_relative() -> None:
    tally = Tally()
    tally.finished.update({0: 3, 1: 100})
    assert tally.history_entries() == 3 + 32
    assert _drift(105.0, 100.0) == 0.05 and _drift(None, 100.0) is None and _drift(1.0, 0.0) is None
