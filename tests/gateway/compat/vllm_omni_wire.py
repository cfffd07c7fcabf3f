"""What the vLLM-Omni dialect's wire tests share: the session config, the fake engine's PCM length
for a text, sending an utterance's text, and reading a connection's messages up to its n-th
`session.done` (and the sentence each `audio.start` names)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets

from tests.fakes import word_ms
from tests.integration.conftest import RunningGateway

GAP_MS = 40  # the fake engine's pause after each word
BYTES_PER_MS = 24 * 2  # 24 kHz s16le
CONFIG = {"type": "session.config", "voice": "alice", "response_format": "pcm", "stream_audio": True}


def pcm_bytes(text: str) -> int:
    """The PCM the fake engine speaks for `text`."""
    return sum(word_ms(w) + GAP_MS for w in text.split()) * BYTES_PER_MS


def url(g: RunningGateway) -> str:
    return f"ws://127.0.0.1:{g.port}/v1/audio/speech/stream"


async def until_sessions_done(
    ws: websockets.ClientConnection, count: int, timeout_s: float = 20.0
) -> list[dict[str, Any] | int]:
    """JSON messages as dicts, binary frames as their length, up to the count-th session.done."""
    out: list[dict[str, Any] | int] = []
    while count:
        frame = await asyncio.wait_for(ws.recv(), timeout_s)
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


async def send_text(ws: websockets.ClientConnection, *pieces: str, done: bool = True) -> None:
    """Each piece as an `input.text`, then (with `done`) the utterance's `input.done`."""
    for piece in pieces:
        await ws.send(json.dumps({"type": "input.text", "text": piece}))
    if done:
        await ws.send(json.dumps({"type": "input.done"}))


def sentence_texts(got: list[dict[str, Any] | int]) -> dict[int, str]:
    """Each utterance's `sentence_text`, by its index."""
    return {
        m["utterance_index"]: m["sentence_text"]
        for m in got
        if isinstance(m, dict) and m["type"] == "audio.start"
    }
