"""vLLM-Omni's streaming WebSocket over native sessions that refuse messages (real uvicorn, a plain
WebSocket client): an error that refuses one message about an utterance under way (`text_too_long`
on a later append, `utterance_closed` after the native text timeout) is reported in that
utterance's turn and the utterance goes on to its audio; an error that refuses the utterance's
opening fails it alone, and none of its later text reaches the engine; a native session that ends
under queued utterances fails the ones it held and the rest are spoken on a new one. In every case
no more utterances are open on a native session than it allows, so none is refused for that."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets

from clients.client import MESSAGE_REFUSED_CODES as CLIENT_REFUSED_CODES
from gateway.config import GatewayConfig
from gateway.messages import MESSAGE_REFUSED_CODES
from tests.fakes import FakeEngine
from tests.gateway.compat.vllm_omni_wire import (
    CONFIG,
    pcm_bytes,
    per_utterance,
    send_text,
    sentence_texts,
    until_sessions_done,
    url,
)
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)


def errors(got: list[dict[str, Any] | int]) -> list[dict[str, Any]]:
    return [m for m in got if isinstance(m, dict) and m["type"] == "error"]


def spoken(engine: FakeEngine) -> list[str]:
    return ["".join(s.text for s in stream.pushed).strip() for stream in engine.streams]


async def test_a_refused_append_is_reported_and_its_utterance_goes_on() -> None:
    """One open utterance per native session: the dialect must not take the refusal of an append
    for the end of its utterance, or it would open the next one beside it (refused) and drop the
    first one's audio."""
    engine = FakeEngine(step_s=0.005)
    first, second = "Hello there friend.", "Second one here."
    with run_gateway(engine, GatewayConfig(max_open_utterances=1, max_text_chars=40)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, first, " " + "x" * 30)
            await send_text(ws, second)
            got = await until_sessions_done(ws, 2, 8)
    assert per_utterance(got) == [(0, pcm_bytes(first), False), (1, pcm_bytes(second), False)]
    (error,) = errors(got)
    assert error["code"] == "text_too_long" and "40" in error["message"]
    kinds = [m["type"] if isinstance(m, dict) else "audio" for m in got]
    assert kinds.index("error") < kinds.index("audio.done")  # in the first utterance's turn
    assert spoken(engine) == [first, second]


async def test_text_after_the_native_text_timeout_is_reported_not_dropped() -> None:
    """The native session ends an utterance whose text stays open past text_timeout_s; text sent
    for it later is refused with utterance_closed, which the client hears, while the audio already
    made stays whole."""
    engine = FakeEngine()
    first = "Hello there."
    with run_gateway(engine, GatewayConfig(text_timeout_s=0.2)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, first, done=False)
            await asyncio.sleep(2.5)  # the session's tick runs about once a second
            await send_text(ws, " more words.")
            got = await until_sessions_done(ws, 1, 8)
    assert per_utterance(got) == [(0, pcm_bytes(first), False)]
    (error,) = errors(got)
    assert error["code"] == "utterance_closed"


async def test_a_refused_opening_fails_its_utterance_and_keeps_its_later_text_off_the_engine() -> None:
    """The second utterance waits behind the first; when its turn comes, its first text is refused
    (too long), so it fails, and its later text must not open a native utterance of its own that
    the dialect does not count (the third would then be refused beside it)."""
    engine = FakeEngine(step_s=0.005)
    first, third = "First one here.", "Third one here."
    with run_gateway(engine, GatewayConfig(max_open_utterances=1, max_text_chars=40)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, first)
            await send_text(ws, "y" * 50, " short words.")
            await send_text(ws, third)
            got = await until_sessions_done(ws, 3, 8)
    assert per_utterance(got) == [
        (0, pcm_bytes(first), False),
        (1, 0, True),
        (2, pcm_bytes(third), False),
    ]
    (error,) = errors(got)
    assert error["message"].startswith("Generation failed for utterance 1, sentence 0:")
    assert spoken(engine) == [first, third]


async def test_a_native_session_that_ends_fails_what_it_held_and_the_queue_goes_on() -> None:
    """A text frame within the socket's size limit is a native frame over it once wrapped in a
    speak.append: the native session closes (1009). Its utterance fails instead of waiting forever,
    and the utterance queued behind it is spoken on a new native session."""
    engine = FakeEngine(step_s=0.005)
    config = GatewayConfig(max_open_utterances=1)
    frame = json.dumps({"type": "input.text", "text": ""})
    big = "a " * ((config.max_message_bytes - len(frame)) // 2)
    second = "After the big one."
    with run_gateway(engine, config) as g:
        async with websockets.connect(url(g), max_size=None) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, big)
            await send_text(ws, second)
            got = await until_sessions_done(ws, 2, 8)
            assert sentence_texts(got) == {0: "", 1: second}  # the failed one was never spoken
            await ws.send(json.dumps({"type": "voice.list"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "voice.list"
    assert per_utterance(got) == [(0, 0, True), (1, pcm_bytes(second), False)]
    (error,) = errors(got)
    assert error["message"].startswith("Generation failed for utterance 0, sentence 0:")
    assert spoken(engine) == [second]


def test_the_gateway_and_its_client_agree_on_which_errors_refuse_one_message() -> None:
    assert MESSAGE_REFUSED_CODES == CLIENT_REFUSED_CODES
