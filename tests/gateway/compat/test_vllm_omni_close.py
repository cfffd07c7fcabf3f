"""vLLM-Omni's streaming WebSocket on the ways an utterance ends early (real uvicorn, a plain
WebSocket client): `session.close` that cuts the utterance being sent while it still takes text
closes its `audio.start` with an `audio.done` (the bytes sent, `error: true`) and a `session.done`
before the close, and an utterance that was never begun is dropped without a word; the file
encoder of an utterance is freed however it ends, failed or cut included."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
import websockets

from gateway.compat import vllm_omni
from gateway.compat.encoding import StreamEncoder
from tests.fakes import FakeEngine
from tests.gateway.compat.vllm_omni_wire import CONFIG, pcm_bytes, per_utterance, until_sessions_done, url
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)


async def until_closed(
    ws: websockets.ClientConnection, timeout_s: float = 10.0
) -> list[dict[str, Any] | int]:
    """JSON messages as dicts, binary frames as their length, up to the server's close."""
    out: list[dict[str, Any] | int] = []
    try:
        while True:
            frame = await asyncio.wait_for(ws.recv(), timeout_s)
            out.append(len(frame) if isinstance(frame, bytes) else json.loads(frame))
    except websockets.ConnectionClosedOK:
        return out


async def until_audio(ws: websockets.ClientConnection) -> list[dict[str, Any] | int]:
    """Up to the first audio frame: the utterance's audio.start has gone out by then."""
    out: list[dict[str, Any] | int] = []
    while True:
        frame = await asyncio.wait_for(ws.recv(), 10)
        if isinstance(frame, bytes):
            return out + [len(frame)]
        out.append(json.loads(frame))


def kinds(got: list[dict[str, Any] | int]) -> list[str]:
    return [m["type"] if isinstance(m, dict) else "audio" for m in got]


async def test_session_close_cutting_the_utterance_being_sent_closes_its_audio_start() -> None:
    """The engine stalls after the first word, so the utterance has begun (audio.start and some
    audio sent) and cannot finish when session.close comes before its input.done."""
    engine = FakeEngine(stall_after_words=1)
    with run_gateway(engine) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there friend. And"}))
            got = await until_audio(ws)
            await ws.send(json.dumps({"type": "session.close"}))
            got += await until_closed(ws)
            assert ws.close_code == 1000
    assert per_utterance(got) == [(0, sum(m for m in got if isinstance(m, int)), True)]
    assert kinds(got)[-3:] == ["error", "audio.done", "session.done"]
    error, done = got[-3], got[-1]
    assert isinstance(error, dict) and error["message"].startswith("Generation failed for utterance 0")
    assert done == {"type": "session.done", "utterance_index": 0, "total_sentences": 1}
    assert engine.streams[0].cancelled


async def test_session_close_sends_ended_utterances_whole_and_cuts_the_one_begun_after_them() -> None:
    """The first utterance is ended and spoken whole; the second, still taking text, is cut in its
    turn with its audio.done and session.done."""
    first = "First one here."
    engine = FakeEngine(step_s=0.01)
    with run_gateway(engine) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": first}))
            await ws.send(json.dumps({"type": "input.done"}))
            got = await until_sessions_done(ws, 1)
            await ws.send(json.dumps({"type": "input.text", "text": "Second one is longer than that. And"}))
            got += await until_audio(ws)
            await ws.send(json.dumps({"type": "session.close"}))
            got += await until_closed(ws)
    cut = per_utterance(got)
    assert cut[0] == (0, pcm_bytes(first), False)
    assert cut[1][0] == 1 and cut[1][2] is True and len(cut) == 2
    done = [m for m in got if isinstance(m, dict) and m["type"] == "session.done"]
    assert [m["utterance_index"] for m in done] == [0, 1]


async def test_session_close_drops_an_utterance_not_begun_without_a_word() -> None:
    """session.close comes while the first, ended utterance is still being made: it is sent whole,
    and the text after it, whose turn has not come, gets nothing."""
    engine = FakeEngine(step_s=0.01)
    with run_gateway(engine) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": "One two."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await ws.send(json.dumps({"type": "input.text", "text": "Never begun here."}))
            await ws.send(json.dumps({"type": "session.close"}))
            got = await until_closed(ws)
    assert per_utterance(got) == [(0, pcm_bytes("One two."), False)]
    assert [m for m in got if isinstance(m, dict) and m.get("utterance_index") == 1] == []


class _CountedEncoder(StreamEncoder):
    """A StreamEncoder that says whether it was freed: by finish() (its file written) or close()."""

    made: list[_CountedEncoder] = []
    # the second utterance's audio goes into its file: its audio.start has gone out by then
    second_audio = threading.Event()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.freed = False
        self.number = len(self.made)
        self.made.append(self)

    def encode(self, pcm: Any) -> bytes:
        if self.number == 1 and len(pcm):
            self.second_audio.set()
        return super().encode(pcm)

    def finish(self) -> bytes:
        self.freed = True
        return super().finish()

    def close(self) -> None:
        self.freed = True
        super().close()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[_CountedEncoder]:
    made: list[_CountedEncoder] = []
    monkeypatch.setattr(_CountedEncoder, "made", made)
    monkeypatch.setattr(_CountedEncoder, "second_audio", threading.Event())
    monkeypatch.setattr(vllm_omni, "StreamEncoder", _CountedEncoder)
    return made


FILE_CONFIG = {**CONFIG, "stream_audio": False, "response_format": "mp3"}


async def test_a_failed_utterances_encoder_is_freed(counted: list[_CountedEncoder]) -> None:
    """The engine fails the first utterance; the socket stays open past its audio.done, so only
    the dialect's end of the utterance can free its muxer (not the connection's end)."""
    with run_gateway(FakeEngine(fail_after_words=1, step_s=0.005)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(FILE_CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there friend."}))
            await ws.send(json.dumps({"type": "input.done"}))
            got = await until_sessions_done(ws, 1)
            assert per_utterance(got) == [(0, 0, True)]
            assert [e.freed for e in counted] == [True]


async def test_encoders_are_freed_on_every_end(counted: list[_CountedEncoder]) -> None:
    """Spoken whole, then one cut by session.close after its audio began."""
    with run_gateway(FakeEngine(step_s=0.01)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(FILE_CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": "First one."}))
            await ws.send(json.dumps({"type": "input.done"}))
            got = await until_sessions_done(ws, 1)
            await ws.send(json.dumps({"type": "input.text", "text": "Second one is longer than that. And"}))
            assert await asyncio.to_thread(_CountedEncoder.second_audio.wait, 10)
            await ws.send(json.dumps({"type": "session.close"}))
            got += await until_closed(ws)
    assert [(i, err) for i, _, err in per_utterance(got)] == [(0, False), (1, True)]
    assert len(counted) == 2 and all(e.freed for e in counted)
