"""The page's Server load panel in real Chromium while the engine cannot report its load: GET
/v1/load answers 503 `engine_unavailable`, and the panel says the engine is unavailable and clears
its figures (greyed) rather than showing the last ones as if current; when /v1/load answers 200
again the figures come back and the notice goes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.api import EngineLoad
from tests.fakes import FakeEngine
from tests.integration.conftest import RunningGateway, run_gateway

FIGURES = {"batch_decode": 5.0, "batch_prefill": 2.0, "batch_codec": 4.0, "step_ms_codec": 3.0}
FIGURE_CELLS = ("load-active", "load-queued", "load-capacity", "load-batch", "load-step", "load-sessions")


class UnreachableEngine(FakeEngine):
    """A fake engine with fixed figures whose load() raises while `failure` is set, as an engine
    with an unreachable upstream or a worker pool mid-restart does."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: Exception | None = None

    def load(self) -> EngineLoad:
        if self.failure is not None:
            raise self.failure
        return dataclasses.replace(super().load(), extra=dict(FIGURES))


@pytest.fixture
def unreachable() -> Iterator[tuple[RunningGateway, UnreachableEngine]]:
    engine = UnreachableEngine()
    with run_gateway(engine) as running:
        yield running, engine


def _panel_state(page: Any) -> str:
    return str(page.get_attribute("#load-panel", "data-state"))


def test_the_load_panel_says_the_engine_is_unavailable_and_recovers(
    page: Any, unreachable: tuple[RunningGateway, UnreachableEngine]
) -> None:
    gateway, engine = unreachable
    page.goto(f"{gateway.http}/")
    page.wait_for_function(
        "window.cadence !== undefined && (cadence.state.loadPolls || 0) >= 1", timeout=5_000
    )
    assert _panel_state(page) == "live"
    assert page.inner_text("#load-batch") == "5 / 2 / 4"
    assert page.inner_text("#load-active") == f"0 / {engine.options.capacity}"
    assert not page.is_visible("#load-unavailable")
    live_colour = page.eval_on_selector("#load-batch", "e => getComputedStyle(e).color")

    engine.failure = ConnectionError("upstream unreachable")
    answer = httpx.get(f"{gateway.http}/v1/load")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_unavailable"
    page.wait_for_function(
        "document.getElementById('load-panel').dataset.state === 'unavailable'", timeout=5_000
    )
    notice = page.inner_text("#load-unavailable")
    assert page.is_visible("#load-unavailable")
    assert notice.startswith("Engine unavailable") and "ConnectionError" in notice, notice
    for cell in FIGURE_CELLS:  # the last figures are gone, not shown as if current
        assert page.inner_text(f"#{cell}") == "–", cell
    assert page.evaluate("cadence.state.load") is None
    assert page.eval_on_selector("#load-batch", "e => getComputedStyle(e).color") != live_colour  # greyed

    engine.failure = None
    page.wait_for_function("document.getElementById('load-panel').dataset.state === 'live'", timeout=5_000)
    assert not page.is_visible("#load-unavailable")
    assert page.inner_text("#load-batch") == "5 / 2 / 4"
    assert page.inner_text("#load-step") == "– / – / 3 ms"
    assert page.eval_on_selector("#load-batch", "e => getComputedStyle(e).color") == live_colour
    assert page.evaluate("cadence.state.load.engine.figures") == FIGURES
