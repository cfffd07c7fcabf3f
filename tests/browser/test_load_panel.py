"""The page's live load panel in real Chromium: it polls GET /v1/load every second and shows the
server's figures (engine load, KV blocks, batches, step times, sessions and the gateway's median
time to first audio over the last minute once an utterance has been spoken)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.api import EngineLoad
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


class FiguredEspeak(EspeakEngine):
    """eSpeak reporting fixed engine figures, so the panel's rendering of each can be checked."""

    def load(self) -> EngineLoad:
        return dataclasses.replace(super().load(), extra=dict(FIGURES))


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
