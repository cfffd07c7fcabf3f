"""What the gateway answers while the engine's load() raises (a worker pool mid-restart, an upstream
vLLM-Omni server unreachable), over real uvicorn on loopback: /metrics still serves every gateway
metric, leaves out the engine's figures (none is current) and counts the failure in
cadence_engine_load_failures_total; /readyz (and /health) answer 503 with the reason, /healthz 200,
/v1/load 503 `engine_unavailable`; the failure is logged once, not once per read; and all of it
returns to normal when the engine reports again."""

from __future__ import annotations

import dataclasses
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.api import AdmissionFigures, EngineLoad
from gateway.config import GatewayConfig
from gateway.engine_load import EngineLoadReader
from gateway.metrics import GatewayMetrics
from tests.fakes import FakeEngine
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)

FAILURES = "cadence_engine_load_failures_total"
# every series built from the engine's load(): none may outlive a failed read
ENGINE_SERIES = (
    "cadence_engine_figure",
    "cadence_gpu_memory_peak_bytes",
    "cadence_engine_active",
    "cadence_engine_queue_depth",
    "cadence_engine_capacity",
    "cadence_engine_max_streams",
    "cadence_engine_queue_limit",
    "cadence_engine_admitted_total",
    "cadence_engine_queued_total",
    "cadence_engine_refusals_total",
    "cadence_engine_queue_wait_seconds_count",
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class FailingEngine(FakeEngine):
    """A fake engine whose load() raises `failure` while it is set, and otherwise reports figures."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: Exception | None = None
        self.figures: dict[str, float] = {"step_ms_codec": 3.5, "gpu_memory_peak_bytes": 5e10}
        self.admission: AdmissionFigures | None = AdmissionFigures(
            capacity=4,
            max_streams=8,
            admitted=1,
            queued=0,
            queue_limit=16,
            admitted_total=5,
            queued_total=2,
            refused={"queue_full": 3},
            wait_p50_s=None,
            wait_p90_s=None,
            wait_bounds_s=(0.1, 1.0),
            wait_counts=(1, 2, 2),
            wait_sum_s=0.3,
        )
        self.load_calls = 0

    def load(self) -> EngineLoad:
        self.load_calls += 1
        if self.failure is not None:
            raise self.failure
        return dataclasses.replace(super().load(), extra=dict(self.figures), admission=self.admission)


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


async def _scrape(http: httpx.AsyncClient) -> Samples:
    page = await http.get("/metrics")
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/plain")
    return _samples(page.text)


async def test_metrics_serves_the_gateways_figures_and_drops_the_engines_while_load_fails() -> None:
    engine = FailingEngine()
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            speech = await http.post("/v1/audio/speech", json={"input": "one two", "response_format": "pcm"})
            assert speech.status_code == 200
            healthy = await _scrape(http)
            assert set(ENGINE_SERIES) <= _names(healthy)  # all there while the engine reports
            assert healthy[(FAILURES, ())] == 0.0
            spoken = healthy[("cadence_utterances_total", (("endpoint", "rest"),))]
            assert spoken == 1.0

            engine.failure = ConnectionError("upstream unreachable")
            failing = await _scrape(http)
            # the gateway's own metrics, with their values
            assert failing[("cadence_utterances_total", (("endpoint", "rest"),))] == spoken
            assert ("cadence_active_sessions", ()) in failing
            assert ("cadence_event_loop_tasks", ()) in failing
            assert ("process_resident_memory_bytes", ()) in failing
            assert ("cadence_webhook_attempts_total", ()) in failing
            # the engine's figures leave rather than repeat the last read's values
            assert not set(ENGINE_SERIES) & _names(failing), set(ENGINE_SERIES) & _names(failing)
            # and the failure shows
            first = failing[(FAILURES, ())]
            assert first >= 1.0
            again = await _scrape(http)
            assert again[(FAILURES, ())] > first  # this scrape's read failed too
            assert not set(ENGINE_SERIES) & _names(again)

            engine.failure = None
            back = await _scrape(http)
            assert set(ENGINE_SERIES) <= _names(back)
            assert back[("cadence_engine_figure", (("name", "step_ms_codec"),))] == 3.5
            settled = back[(FAILURES, ())]
            assert settled >= again[(FAILURES, ())]
            assert (await _scrape(http))[(FAILURES, ())] == settled  # no more failures counted


async def test_readyz_and_health_say_not_ready_and_why_while_healthz_stays_200() -> None:
    engine = FailingEngine()
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            assert (await http.get("/readyz")).status_code == 200
            engine.failure = TimeoutError("worker pool restarting")
            for path in ("/readyz", "/health"):
                answer = await http.get(path)
                assert answer.status_code == 503, (path, answer.text)
                body = answer.json()
                assert body["ready"] is False
                assert body["reason"] == "load() failed: TimeoutError"
                assert body["engine"] == "fake"
                assert body["active"] is None and body["queued"] is None and body["capacity"] is None
                assert "worker pool restarting" not in answer.text  # the class, not the message
            live = await http.get("/healthz")
            assert live.status_code == 200 and live.json() == {"status": "ok"}

            engine.failure = None
            ready = await http.get("/readyz")
            assert ready.status_code == 200 and ready.json()["ready"] is True
            assert ready.json()["capacity"] == engine.options.capacity


async def test_v1_load_answers_503_engine_unavailable_while_load_fails() -> None:
    engine = FailingEngine()
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            assert (await http.get("/v1/load")).json()["engine"]["figures"]["step_ms_codec"] == 3.5
            engine.failure = ConnectionError("upstream unreachable")
            answer = await http.get("/v1/load")
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "1"
            error = answer.json()["error"]
            assert error["code"] == "engine_unavailable"
            assert error["type"] == "server_error"
            assert "ConnectionError" in error["message"]
            assert "upstream unreachable" not in answer.text

            engine.failure = None
            answer = await http.get("/v1/load")
            assert answer.status_code == 200
            assert answer.json()["engine"]["figures"]["step_ms_codec"] == 3.5


def _load_failure_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "cadence.app" and r.levelno == logging.WARNING and "load()" in r.getMessage()
    ]


async def test_a_failing_load_is_logged_once_not_at_every_read(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cadence.app")
    engine = FailingEngine()
    with run_gateway(engine, GatewayConfig()) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=10) as http:
            engine.failure = ConnectionError("upstream unreachable")
            for _ in range(5):
                await _scrape(http)
                await http.get("/readyz")
                await http.get("/v1/load")
            assert engine.load_calls >= 15
            warnings = _load_failure_warnings(caplog)
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert warnings[0].exc_info is not None
            assert isinstance(warnings[0].exc_info[1], ConnectionError)

            engine.failure = None
            await _scrape(http)
            recovered = [
                r for r in caplog.records if r.name == "cadence.app" and "reports its load" in r.getMessage()
            ]
            assert len(recovered) == 1

            engine.failure = ConnectionError("unreachable again")  # a new outage is logged again
            await _scrape(http)
            await _scrape(http)
            assert len(_load_failure_warnings(caplog)) == 2


def test_a_lasting_failure_is_logged_again_at_most_once_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    engine = FailingEngine()
    metrics = GatewayMetrics()
    reader = EngineLoadReader(engine, metrics, log_every_s=60.0, clock=lambda: now[0])
    engine.failure = ConnectionError("upstream unreachable")
    with caplog.at_level(logging.INFO, logger="cadence.app"):
        for _ in range(10):  # ten reads within the interval: one line
            assert reader.read() is None
            now[0] += 5.0
        assert len(_load_failure_warnings(caplog)) == 1
        now[0] = 100.0 + 61.0
        assert reader.read() is None  # the interval has passed: one more line, with the count
        lines = _load_failure_warnings(caplog)
        assert len(lines) == 2 and "11" in lines[1].getMessage()
        assert reader.read() is None
        assert len(_load_failure_warnings(caplog)) == 2
    assert metrics.registry.get_sample_value(FAILURES) == 12.0
    assert reader.failure == "ConnectionError"
    engine.failure = None
    load = reader.read()
    assert load is not None and load.capacity == engine.options.capacity
    assert reader.failure is None
