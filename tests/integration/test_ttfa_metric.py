"""Time to first audio is counted for every utterance, also for one whose engine makes all of its
audio before the gateway has sent the first packet (a fast engine on a busy machine): the
utterance's end, queued behind its packets, does not lose its start time."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
from websockets.asyncio.client import connect

from engine.api import AudioChunk, ChunkListener, SynthesisRequest, SynthesisStream, TextSegment
from engine.null import NullEngine, NullStream
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client

BURST_CHUNKS = 50  # a second of 20 ms chunks, handed over in one go


class BurstStream(NullStream):
    """Hands its whole utterance (every chunk, then its end) to the gateway in one callback, as an
    engine far faster than real time does between two turns of the gateway's writer."""

    listener: ChunkListener | None = None

    def listen(self, listener: ChunkListener) -> bool:
        self.listener = listener
        return True

    def push(self, segment: TextSegment) -> None:
        pass

    def close_text(self) -> None:
        asyncio.get_running_loop().call_soon(self._burst)

    def _burst(self) -> None:
        assert self.listener is not None
        n = 480
        for i in range(BURST_CHUNKS):
            last = i == BURST_CHUNKS - 1
            samples = np.full(n, 1000, np.int16)
            self.listener.chunk(AudioChunk(self.request_id, samples, i * n, final=last))
        self.listener.end()


class BurstEngine(NullEngine):
    def open(self, request: SynthesisRequest) -> SynthesisStream:
        super().open(request).cancel()  # admission as the null engine has it, then the burst
        return BurstStream(self, request, 0)


def _ttfa_count(metrics: str) -> float:
    match = re.search(r'cadence_ttfa_seconds_count\{endpoint="stream"\} ([0-9.]+)', metrics)
    return float(match.group(1)) if match else 0.0


async def test_an_utterance_made_before_its_first_packet_leaves_counts_its_ttfa() -> None:
    with run_gateway(BurstEngine()) as gateway:
        async with connect(gateway.ws) as ws:
            client = Client(ws)
            for uid in ("u1", "u2", "u3"):
                await client.send(type="speak.append", utterance_id=uid, text="hello there")
                await client.send(type="speak.end", utterance_id=uid)
                done = await client.until("utterance.done", uid)
                assert done["packets"] == BURST_CHUNKS
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{gateway.http}/metrics")).text
            live = (await http.get(f"{gateway.http}/v1/load")).json()["gateway"]
    assert _ttfa_count(metrics) == 3
    assert live["ttfa_utterances_1m"] == 3 and live["ttfa_p50_ms"] is not None
