"""Barge-in and pause at the edges of an utterance's audio, over real uvicorn on loopback: the
server's own position estimate (no played_ms, no playback.report) when the pause came before any
packet was sent."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.messages import PacketHeader
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)

# no sentence end and under the clause limit: the segmenter holds it, so no audio is made yet
FIRST = "one two three four five six"
REST = " seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen."


async def first_packet(client: Client, wait_s: float = 10.0) -> PacketHeader:
    deadline = time.monotonic() + wait_s
    while True:
        item = await client.next(max(0.01, deadline - time.monotonic()))
        if isinstance(item, PacketHeader):
            return item


@pytest.mark.parametrize("pause", [False, True])
async def test_a_pause_before_the_first_packet_leaves_the_server_clock_to_start_with_it(
    gateway_factory: GatewayFactory, pause: bool
) -> None:
    """Paused and unpaused while nothing was sent (the agent's text had not come yet), the
    listener has nothing to play until the first packet: the server's estimate runs from that
    packet, as it does without a pause (the control), not from the unpause a second earlier."""
    gateway = gateway_factory(FakeEngine())
    async with connect(gateway.ws) as ws:
        client = Client(ws)
        await client.send(type="speak.append", utterance_id="u1", text=FIRST)
        await client.until("utterance.started", "u1")
        if pause:
            await client.send(type="speak.pause", utterance_id="u1")
            paused = await client.until("utterance.paused", "u1")
            assert (paused["played_ms"], paused["position_source"]) == (0, "server")
            await client.send(type="speak.unpause", utterance_id="u1")
            await client.until("utterance.unpaused", "u1")
        await asyncio.sleep(1.0)  # the rest of the text comes a second later
        await client.send(type="speak.append", utterance_id="u1", text=REST)
        await client.send(type="speak.end", utterance_id="u1")
        await first_packet(client)
        heard_from = time.monotonic()
        await client.until("utterance.done", "u1")  # asap: the whole utterance is sent
        await asyncio.sleep(max(0.0, 0.3 - (time.monotonic() - heard_from)))
        heard_ms = 1000 * (time.monotonic() - heard_from)
        await client.send(type="speak.cancel", utterance_id="u1")
        interrupted = await client.until("utterance.interrupted", "u1")
    assert interrupted["position_source"] == "server"
    duration_ms = client.got.of_type("utterance.done", "u1")[0]["duration_ms"]
    assert duration_ms > 2000  # the cap at what was sent is far above the listener's position
    assert heard_ms - 50 <= interrupted["played_ms"] <= heard_ms + 250
