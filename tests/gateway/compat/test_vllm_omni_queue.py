"""vLLM-Omni's streaming WebSocket serves a connection's utterances in turn, however many the client
sends ahead: on the wire (real uvicorn, a plain WebSocket client), more utterances than a native
session keeps open at once are queued and spoken in order, and only past the dialect's documented
bound on waiting utterances is one refused, with a typed error, leaving the rest of the socket
working."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from gateway.compat.vllm_omni import MAX_QUEUED_UTTERANCES
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.compat.vllm_omni_wire import CONFIG, pcm_bytes, per_utterance, until_sessions_done, url
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)


async def send_utterance(ws: websockets.ClientConnection, text: str) -> None:
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))


async def test_more_utterances_than_a_session_keeps_open_are_spoken_in_order() -> None:
    """Twelve utterances sent at once, against a native limit of four open at a time."""
    texts = [f"Utterance number {i} here." for i in range(12)]
    with run_gateway(FakeEngine(step_s=0.01), GatewayConfig(max_open_utterances=4)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            for text in texts:
                await send_utterance(ws, text)
            got = await until_sessions_done(ws, len(texts))
    assert [m for m in got if isinstance(m, dict) and m["type"] == "error"] == []
    expected = [(i, pcm_bytes(t), False) for i, t in enumerate(texts)]
    assert per_utterance(got) == expected
    done = [m for m in got if isinstance(m, dict) and m["type"] == "session.done"]
    assert done == [{"type": "session.done", "utterance_index": i, "total_sentences": 1} for i in range(12)]


async def test_past_the_bound_an_utterance_is_refused_with_a_typed_error() -> None:
    """The engine never finishes the open utterances, so every later one waits; the one past the
    bound is refused at once with a typed error, and the socket goes on answering."""
    engine = FakeEngine(stall_after_words=0)
    with run_gateway(engine, GatewayConfig(max_open_utterances=2)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            for i in range(MAX_QUEUED_UTTERANCES + 1):
                await send_utterance(ws, f"Word{i}.")
            error = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert error["type"] == "error" and error["code"] == "too_many_utterances"
            assert str(MAX_QUEUED_UTTERANCES) in error["message"]
            await ws.send(json.dumps({"type": "voice.list"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "voice.list"
    assert len(engine.streams) == 2  # only as many as a native session keeps open reach the engine
