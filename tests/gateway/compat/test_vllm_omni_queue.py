"""vLLM-Omni's streaming WebSocket serves a connection's utterances in turn, however many the client
sends ahead: on the wire (real uvicorn, a plain WebSocket client), more utterances than a native
session keeps open at once are queued and spoken in order, and only past the dialect's documented
bound on waiting utterances is one refused, with a typed error, leaving the rest of the socket
working."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets

from gateway.compat.vllm_omni import MAX_QUEUED_UTTERANCES
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)

GAP_MS = 40
CONFIG = {"type": "session.config", "voice": "alice", "response_format": "pcm", "stream_audio": True}


def duration_ms(text: str) -> int:
    return sum(word_ms(w) + GAP_MS for w in text.split())


def url(g: RunningGateway) -> str:
    return f"ws://127.0.0.1:{g.port}/v1/audio/speech/stream"


async def send_utterance(ws: websockets.ClientConnection, text: str) -> None:
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))


async def until_sessions_done(ws: websockets.ClientConnection, count: int) -> list[dict[str, Any] | int]:
    """JSON messages as dicts, binary frames as their length, up to the count-th session.done."""
    out: list[dict[str, Any] | int] = []
    while count:
        frame = await asyncio.wait_for(ws.recv(), 20)
        if isinstance(frame, bytes):
            out.append(len(frame))
            continue
        message = json.loads(frame)
        out.append(message)
        count -= message["type"] == "session.done"
    return out


def per_utterance(got: list[dict[str, Any] | int]) -> list[tuple[int, int, bool]]:
    """(utterance_index, PCM bytes between its audio.start and audio.done, audio.done's error)."""
    out, index, pcm = [], -1, 0
    for item in got:
        if isinstance(item, int):
            pcm += item
        elif item["type"] == "audio.start":
            index, pcm = item["utterance_index"], 0
        elif item["type"] == "audio.done":
            assert item["utterance_index"] == index and item["total_bytes"] == pcm
            out.append((index, pcm, item["error"]))
    return out


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
    expected = [(i, duration_ms(t) * 24 * 2, False) for i, t in enumerate(texts)]
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
