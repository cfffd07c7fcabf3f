"""The page's live load panel in real Chromium: it polls GET /v1/load every second and shows the
server's figures (engine load, KV blocks, batches, step times, sessions and the gateway's median
time to first audio over the last minute once an utterance has been spoken, and the engine's
admission: its measured capacity within its bound, the queue, its waits and the refusals)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.admission import QUEUE_WAIT_BOUNDS_S
from engine.api import AdmissionFigures, EngineLoad
from engine.espeak.engine import EspeakEngine
from tests.integration.conftest import RunningGateway, run_gateway

FIGURES = {
    "kv_blocks_in_use": 3.0,
    "kv_blocks_total": 8.0,
    "batch_decode": 5.0,
    "batch_prefill": 2.0,
    "batch_codec": 4.0,
    "step_ms_decode": 7.25,
    "step_ms_prefill": 11.5,
    "step_ms_codec": 3.0,
    "ttfa_p50_ms": 42.0,
}


ADMISSION = AdmissionFigures(
    capacity=48,
    max_streams=200,
    admitted=0,
    queued=3,
    queue_limit=64,
    admitted_total=120,
    queued_total=30,
    refused={"queue_full": 5, "max_wait": 2, "wait_expired": 1},
    wait_bounds_s=QUEUE_WAIT_BOUNDS_S,
    wait_counts=(0,) * len(QUEUE_WAIT_BOUNDS_S) + (30,),
    wait_sum_s=9.0,
    wait_p50_s=0.2504,
    wait_p90_s=0.9,
)


class FiguredEspeak(EspeakEngine):
    """eSpeak reporting fixed engine figures, so the panel's rendering of each can be checked."""

    def load(self) -> EngineLoad:
        return dataclasses.replace(super().load(), extra=dict(FIGURES), admission=ADMISSION)


@pytest.fixture
def figured_gateway() -> Iterator[RunningGateway]:
    with run_gateway(FiguredEspeak()) as running:
        yield running


def test_load_panel_shows_the_servers_figures(page: Any, figured_gateway: RunningGateway) -> None:
    server = httpx.get(f"{figured_gateway.http}/v1/load").json()
    assert server["engine"]["figures"] == FIGURES and server["gateway"]["ttfa_p50_ms"] is None
    page.goto(f"{figured_gateway.http}/")
    page.wait_for_function(
        "window.cadence !== undefined && (cadence.state.loadPolls || 0) >= 2", timeout=5_000
    )
    capacity = server["engine"]["capacity"]
    assert page.inner_text("#load-active") == f"0 / {capacity}"
    assert page.inner_text("#load-queued") == "0"
    assert server["engine"]["admission"]["queue_wait_p50_ms"] == 250.4
    assert page.inner_text("#load-capacity") == "48 / 200"
    assert page.inner_text("#load-queue") == "3 / 64"
    assert page.inner_text("#load-queue-wait") == "250 ms / 900 ms"
    assert page.inner_text("#load-refused") == "5 / 2 / 1"
    assert page.inner_text("#load-kv") == "3 / 8"
    assert page.inner_text("#load-batch") == "5 / 2 / 4"
    assert page.inner_text("#load-step") == "7.3 / 11.5 / 3 ms"
    assert page.inner_text("#load-engine-ttfa") == "42 ms"
    assert page.inner_text("#load-ttfa") == "–"  # nothing spoken yet

    page.select_option("#language", "English")
    page.fill("#text", "The quick brown fox jumps over the lazy dog.")
    page.click("#speak")
    page.wait_for_function("cadence.state.current && cadence.state.current.finished", timeout=20_000)
    # the session shows up while open; the median appears at the next poll after the first packet
    page.wait_for_function("cadence.state.load.gateway.ttfa_p50_ms !== null", timeout=5_000)
    assert page.inner_text("#load-sessions").startswith("1 / ")
    after = httpx.get(f"{figured_gateway.http}/v1/load").json()["gateway"]
    assert after["ttfa_utterances_1m"] == 1
    shown = page.inner_text("#load-ttfa")
    assert page.evaluate("cadence.state.load.gateway.ttfa_p50_ms") == after["ttfa_p50_ms"]
    assert shown == f"{math.floor(after['ttfa_p50_ms'] + 0.5)} ms"  # the server's figure, as served
    assert 0 < after["ttfa_p50_ms"] < 5000


def test_the_page_shows_its_utterance_waiting_for_admission(page: Any) -> None:
    """With the engine's one slot held by another client, the page's utterance is queued: the
    status says where and for about how long, and says admitted when its audio comes."""
    from websockets.sync.client import connect

    from engine.null import NullEngine

    with run_gateway(NullEngine(max_streams=1, queue_limit=4)) as gateway, connect(gateway.ws) as holder:
        holder.send(json.dumps({"type": "speak.append", "utterance_id": "hold", "text": "x " * 200}))
        while not (isinstance(m := holder.recv(), str) and json.loads(m)["type"] == "utterance.started"):
            pass
        page.goto(f"{gateway.http}/")
        page.wait_for_function("window.cadence !== undefined")
        page.fill("#text", "Hello there.")
        page.click("#speak")
        page.wait_for_function("cadence.state.current && cadence.state.current.queued", timeout=10_000)
        assert page.inner_text("#status").startswith("queued: position 1, about ")
        assert page.evaluate("cadence.state.current.ttfaMs") is None  # no audio while it waits
        holder.send(json.dumps({"type": "speak.cancel", "utterance_id": "hold"}))
        page.wait_for_function("cadence.state.current.ttfaMs !== null", timeout=10_000)
        assert page.inner_text("#status") == "admitted"
