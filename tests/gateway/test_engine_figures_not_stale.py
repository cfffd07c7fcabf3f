"""/metrics shows the engine's figures as the engine reports them at the scrape, over real uvicorn
on loopback: a figure the engine stops reporting (a worker restarts, a percentile has no samples
any more, a figure present only under load) leaves /metrics rather than repeating its last value,
and a figure whose value changes shows the new one."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.api import AdmissionFigures, EngineLoad
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)

FIGURE = "cadence_engine_figure"
GPU_PEAK = "cadence_gpu_memory_peak_bytes"


class FiguresEngine(FakeEngine):
    """A fake engine whose load().extra (and admission) are whatever the test sets them to now."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, float] = {}
        self.admission: AdmissionFigures | None = None

    def load(self) -> EngineLoad:
        return dataclasses.replace(super().load(), extra=dict(self.figures), admission=self.admission)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _figures(text: str) -> dict[str, float]:
    return {dict(labels)["name"]: value for (name, labels), value in _samples(text).items() if name == FIGURE}


def _admission(refused: dict[str, int]) -> AdmissionFigures:
    return AdmissionFigures(
        capacity=4,
        max_streams=8,
        admitted=1,
        queued=0,
        queue_limit=16,
        admitted_total=5,
        queued_total=2,
        refused=refused,
        wait_p50_s=None,
        wait_p90_s=None,
        wait_bounds_s=(0.1, 1.0),
        wait_counts=(1, 2, 2),
        wait_sum_s=0.3,
    )


async def _scrape(http: httpx.AsyncClient) -> str:
    page = await http.get("/metrics")
    assert page.status_code == 200
    return page.text


async def test_a_figure_the_engine_stops_reporting_leaves_metrics() -> None:
    engine = FiguresEngine()
    engine.figures = {"aligner_sync_added_ttfa_ms_p50": 42.0, "step_ms_codec": 3.5, "ttfa_p50_ms": 180.0}
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            assert _figures(await _scrape(http)) == engine.figures
            del engine.figures["aligner_sync_added_ttfa_ms_p50"]  # its percentile has no samples now
            assert _figures(await _scrape(http)) == {"step_ms_codec": 3.5, "ttfa_p50_ms": 180.0}
            engine.figures = {}  # a worker restarted and reports nothing yet
            page = await _scrape(http)
            assert _figures(page) == {}
            engine.figures = {"step_ms_codec": 4.0}  # it reports again: the series comes back
            assert _figures(await _scrape(http)) == {"step_ms_codec": 4.0}


async def test_a_figure_whose_value_changes_shows_the_new_value() -> None:
    engine = FiguresEngine()
    engine.figures = {"ttfa_p50_ms": 180.0, "step_ms_codec": 3.5}
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            assert _figures(await _scrape(http))["ttfa_p50_ms"] == 180.0
            engine.figures["ttfa_p50_ms"] = 95.5
            assert _figures(await _scrape(http)) == {"ttfa_p50_ms": 95.5, "step_ms_codec": 3.5}


async def test_gpu_memory_peak_is_shown_only_while_the_engine_reports_it() -> None:
    engine = FiguresEngine()
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            assert (GPU_PEAK, ()) not in _samples(await _scrape(http))  # never reported: not a 0
            engine.figures = {"gpu_memory_peak_bytes": 5e10}
            assert _samples(await _scrape(http))[(GPU_PEAK, ())] == 5e10
            engine.figures = {"gpu_memory_peak_bytes": 6e10}
            assert _samples(await _scrape(http))[(GPU_PEAK, ())] == 6e10
            engine.figures = {}  # the engine that reported it is gone
            assert (GPU_PEAK, ()) not in _samples(await _scrape(http))


async def test_admission_figures_follow_the_engine() -> None:
    """The admission series are read from the last load, so they already follow the engine: a
    refusal reason it no longer reports, or no admission at all, leaves /metrics."""
    engine = FiguresEngine()
    engine.admission = _admission({"queue_full": 3, "too_long": 1})
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            samples = _samples(await _scrape(http))
            assert samples[("cadence_engine_refusals_total", (("reason", "too_long"),))] == 1.0
            assert samples[("cadence_engine_max_streams", ())] == 8.0
            engine.admission = _admission({"queue_full": 4})
            samples = _samples(await _scrape(http))
            assert samples[("cadence_engine_refusals_total", (("reason", "queue_full"),))] == 4.0
            assert ("cadence_engine_refusals_total", (("reason", "too_long"),)) not in samples
            engine.admission = None
            samples = _samples(await _scrape(http))
            assert not [key for key in samples if key[0].startswith("cadence_engine_max_streams")]
