"""The gateway's engine supervisor through a lasting outage, on a fake clock: an engine that stays
not ready (a vLLM-Omni upstream that is down) or whose start() raises is restarted at once, then
at growing intervals (1 s, 2 s, 4 s ... at most 30 s apart) rather than every second; the log has
one line when the outage starts, at most one a minute with the count of attempts while it lasts,
and one (info) when the engine is ready again, after which the intervals start again from 1 s.
/readyz goes on saying why the engine is not ready and counts the restarts that completed."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
from starlette.requests import Request

from engine.api import EngineLoad
from gateway.app import Gateway
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(30)


class _Stop(Exception):
    """Ends a supervisor run once the fake clock passes its end."""


class FakeTime:
    """A clock that moves only when the supervisor sleeps, so an hour's outage runs in an instant;
    `at(t, action)` runs an action (the engine recovers, fails again) once the clock reaches t."""

    def __init__(self, until: float) -> None:
        self.now = 0.0
        self.until = until
        self._actions: list[tuple[float, Callable[[], Any]]] = []

    def clock(self) -> float:
        return self.now

    def at(self, t: float, action: Callable[[], Any]) -> None:
        self._actions.append((t, action))

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        due = [a for a in self._actions if a[0] <= self.now]
        for entry in due:
            self._actions.remove(entry)
            result = entry[1]()
            if inspect.isawaitable(result):
                await result
        if self.now > self.until:
            raise _Stop
        await asyncio.sleep(0)


class DownEngine(FakeEngine):
    """load() reports not ready while `down` (as the vLLM-Omni engine does while its upstream is
    down, however often it is restarted); start() raises `start_error` while it is set. Each
    start() is recorded at the fake clock's time."""

    def __init__(self, time: FakeTime) -> None:
        super().__init__()
        self.time = time
        self.down = False
        self.start_error: Exception | None = None
        self.starts: list[float] = []

    async def start(self) -> None:
        self.starts.append(self.time.now)
        if self.start_error is not None:
            raise self.start_error
        await super().start()

    def load(self) -> EngineLoad:
        return dataclasses.replace(super().load(), ready=self.started and not self.down)


async def _ready_gateway(engine: DownEngine) -> Gateway:
    gateway = Gateway(engine, GatewayConfig())
    await engine.start()
    engine.starts.clear()  # the lifespan's start, not a restart
    gateway.ready = True
    return gateway


async def _supervise(gateway: Gateway, time: FakeTime) -> None:
    with pytest.raises(_Stop):
        await gateway.supervise_engine(sleep=time.sleep, clock=time.clock)


async def _readyz(gateway: Gateway) -> tuple[int, dict[str, Any]]:
    answer = await gateway.readyz(
        Request({"type": "http", "method": "GET", "path": "/readyz", "headers": []})
    )
    return answer.status_code, json.loads(bytes(answer.body))


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _supervisor_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    """The supervisor's lines at `level`; the load reader's own (gateway.engine_load) are left out."""
    return [
        r
        for r in caplog.records
        if r.name == "cadence.app"
        and r.levelno == level
        and not r.getMessage().startswith(("engine fake: load()", "engine fake reports its load"))
    ]


def _attempts_over(records: list[logging.LogRecord]) -> list[tuple[int, int]]:
    """(attempts, seconds) from each lasting-outage line."""
    found = [re.search(r"(\d+) restart attempts over (\d+) s", r.getMessage()) for r in records]
    return [(int(m[1]), int(m[2])) for m in found if m is not None]


def _a_minute_apart(lines: list[tuple[int, int]]) -> bool:
    return all(b[1] - a[1] >= 60 and b[0] > a[0] for a, b in zip(lines, lines[1:], strict=False))


async def test_an_engine_that_stays_not_ready_is_restarted_at_growing_intervals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cadence.app")
    time = FakeTime(until=3600.0)
    engine = DownEngine(time)
    gateway = await _ready_gateway(engine)
    engine.down = True
    time.at(1800.0, lambda: setattr(engine, "down", False))  # the upstream comes back after 30 min
    time.at(2400.0, lambda: setattr(engine, "down", True))  # and goes down again 10 min later
    await _supervise(gateway, time)

    first = [t for t in engine.starts if t < 1800.0]
    assert first[0] == 1.0  # the first restart comes at the first check, as before
    assert _gaps(first)[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert set(_gaps(first)[5:]) == {30.0}  # capped
    assert len(first) < 70  # rather than 1 800, one a second
    second = [t for t in engine.starts if t >= 1800.0]
    assert second[0] == 2400.0  # none while it was ready
    assert _gaps(second)[:4] == [1.0, 2.0, 4.0, 8.0]  # a new outage starts again from 1 s

    # each restart completed: /readyz counts them all, and so does the metric
    assert gateway.engine_restarts == len(engine.starts)
    assert gateway.metrics.registry.get_sample_value("cadence_engine_restarts_total") == len(engine.starts)
    status, body = await _readyz(gateway)
    assert status == 503 and body["reason"] == "engine not ready"
    assert body["engine_restarts"] == len(engine.starts)

    errors = _supervisor_lines(caplog, logging.ERROR)
    assert len(errors) <= 2 + 1800 / 60 + 1200 / 60, [r.getMessage() for r in errors]
    starts = [r for r in errors if "is not ready (engine not ready): restarting it" in r.getMessage()]
    assert len(starts) == 2  # one per outage
    assert len(_attempts_over(errors)) == len(errors) - 2  # the others count the attempts
    during_first = _attempts_over(errors[: errors.index(starts[1])])
    assert during_first and during_first[-1][0] <= len(first)
    assert _a_minute_apart(during_first)
    recovered = _supervisor_lines(caplog, logging.INFO)
    assert len(recovered) == 1, [r.getMessage() for r in recovered]
    assert f"ready again after {len(first)} restart attempts" in recovered[0].getMessage()


async def test_an_engine_whose_start_raises_backs_off_and_logs_its_exception_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cadence.app")
    time = FakeTime(until=700.0)
    engine = DownEngine(time)
    gateway = await _ready_gateway(engine)
    engine.started = False  # the worker died
    engine.start_error = RuntimeError("no GPU worker would start")
    during: list[tuple[int, dict[str, Any]]] = []

    async def probe() -> None:
        during.append(await _readyz(gateway))

    time.at(599.0, probe)
    time.at(600.0, lambda: setattr(engine, "start_error", None))  # it starts again
    await _supervise(gateway, time)

    failed = [t for t in engine.starts if t < 600.0]
    assert _gaps(failed)[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert max(_gaps(failed)) == 30.0
    assert len(failed) < 30  # over ten minutes, rather than 600
    status, body = during[0]
    assert status == 503 and body["reason"] == "engine not ready" and body["engine_restarts"] == 0

    errors = _supervisor_lines(caplog, logging.ERROR)
    assert len(errors) <= 2 + 600 / 60, [r.getMessage() for r in errors]
    with_exception = [r for r in errors if r.exc_info is not None]
    assert with_exception and with_exception[0].exc_info is not None
    assert isinstance(with_exception[0].exc_info[1], RuntimeError)  # the traceback is there
    assert sum("restart failed" in r.getMessage() for r in errors) == 1  # once, not at every attempt
    lasting = _attempts_over(errors)
    assert lasting and _a_minute_apart(lasting) and lasting[-1][0] <= len(failed)

    # the first attempt after it starts again brings it back: one completed restart, one line
    assert len(engine.starts) == len(failed) + 1
    assert gateway.engine_restarts == 1
    status, body = await _readyz(gateway)
    assert status == 200 and body["ready"] is True and body["engine_restarts"] == 1
    recovered = _supervisor_lines(caplog, logging.INFO)
    assert len(recovered) == 1, [r.getMessage() for r in recovered]
    assert f"ready again after {len(engine.starts)} restart attempts" in recovered[0].getMessage()


async def test_a_failing_load_read_is_the_reason_and_backs_off_too(caplog: pytest.LogCaptureFixture) -> None:
    class Unreachable(DownEngine):
        def load(self) -> EngineLoad:
            if self.down:
                raise ConnectionError("upstream unreachable")
            return super().load()

    caplog.set_level(logging.INFO, logger="cadence.app")
    time = FakeTime(until=300.0)
    engine = Unreachable(time)
    gateway = await _ready_gateway(engine)
    engine.down = True
    await _supervise(gateway, time)

    assert _gaps(engine.starts)[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert len(engine.starts) < 20
    status, body = await _readyz(gateway)
    assert status == 503 and body["reason"] == "load() failed: ConnectionError"
    errors = _supervisor_lines(caplog, logging.ERROR)
    assert len(errors) <= 1 + 300 / 60, [r.getMessage() for r in errors]
    assert "is not ready (load() failed: ConnectionError): restarting it" in errors[0].getMessage()


async def test_a_stale_reason_does_not_outlive_its_cause() -> None:
    """An engine whose load() failed and then reports not ready is `engine not ready`, not the
    earlier read's failure."""

    class Flaky(DownEngine):
        failing = True

        def load(self) -> EngineLoad:
            if self.failing:
                raise ConnectionError("upstream unreachable")
            return super().load()

    time = FakeTime(until=10.0)
    engine = Flaky(time)
    gateway = await _ready_gateway(engine)
    engine.down = True
    time.at(5.0, lambda: setattr(engine, "failing", False))
    await _supervise(gateway, time)
    status, body = await _readyz(gateway)
    assert status == 503 and body["reason"] == "engine not ready"
