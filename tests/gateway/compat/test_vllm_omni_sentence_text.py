"""vLLM-Omni's `audio.start` names the sentence being spoken in `sentence_text`: only the text the
engine was given, over real uvicorn and a plain WebSocket client. An `input.text` the native
session refuses (past `max_text_chars`) is not in it, whether the refusal comes back before the
utterance's next text goes on or after (text released at once when a queued utterance is
admitted), and an utterance that failed before any audio (its opening refused, its native session
closed under it) names no text (test_vllm_omni_refusals: the native session closing)."""

from __future__ import annotations

import json

import pytest
import websockets

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.compat.vllm_omni_wire import (
    CONFIG,
    per_utterance,
    send_text,
    sentence_texts,
    until_sessions_done,
    url,
)
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)


def spoken(engine: FakeEngine) -> list[str]:
    return ["".join(s.text for s in stream.pushed).strip() for stream in engine.streams]


async def test_a_refused_later_input_text_is_not_in_the_sentence_text() -> None:
    engine = FakeEngine(step_s=0.005)
    first = "Hello there friend."
    with run_gateway(engine, GatewayConfig(max_text_chars=40)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, first, " " + "x" * 30)
            got = await until_sessions_done(ws, 1, 8)
    assert [m["code"] for m in got if isinstance(m, dict) and m["type"] == "error"] == ["text_too_long"]
    assert spoken(engine) == [first]
    assert sentence_texts(got) == {0: first}


async def test_text_refused_among_pieces_released_together_is_the_one_left_out() -> None:
    """The second utterance waits behind the first (one open per native session), so its text is
    kept until it is admitted and then goes on all at once: the refusal of its middle piece comes
    back after its last piece went on, and the last one, which fits, is spoken."""
    engine = FakeEngine(step_s=0.005)
    first = "A first sentence that takes a little while to say."
    opening, too_long, last = "Second one.", " " + "x" * 50, " Bye now."
    with run_gateway(engine, GatewayConfig(max_open_utterances=1, max_text_chars=60)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, first)
            await send_text(ws, opening, too_long, last)
            got = await until_sessions_done(ws, 2, 8)
    assert [m["code"] for m in got if isinstance(m, dict) and m["type"] == "error"] == ["text_too_long"]
    assert spoken(engine) == [first, opening + last]
    assert sentence_texts(got) == {0: first, 1: opening + last}


async def test_an_utterance_whose_opening_is_refused_names_no_text() -> None:
    engine = FakeEngine(step_s=0.005)
    first, third = "First one here.", "Third one here."
    with run_gateway(engine, GatewayConfig(max_open_utterances=1, max_text_chars=40)) as g:
        async with websockets.connect(url(g)) as ws:
            await ws.send(json.dumps(CONFIG))
            await send_text(ws, first)
            await send_text(ws, "y" * 50, " short words.")
            await send_text(ws, third)
            got = await until_sessions_done(ws, 3, 8)
    assert [(index, failed) for index, _, failed in per_utterance(got)] == [(0, False), (1, True), (2, False)]
    assert spoken(engine) == [first, third]
    assert sentence_texts(got) == {0: first, 1: "", 2: third}
