"""Reading the engine's load for the routes and the supervisor, through a failing engine too, and
the supervisor's restarts of an engine that stays not ready."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import Engine, EngineLoad
from gateway.metrics import GatewayMetrics

log = logging.getLogger("cadence.app")  # the gateway app's log, where its routes and supervisor log


class EngineLoadReader:
    """The engine's load(), read for the routes and the supervisor. A broken, restarting or
    unreachable engine may fail to report it at all: a failed read counts in
    cadence_engine_load_failures_total and is logged at warning level when reads start failing,
    again at most once every `log_every_s` while they go on failing, and once (info) when the
    engine reports again, rather than at every scrape and probe."""

    def __init__(
        self,
        engine: Engine,
        metrics: GatewayMetrics,
        *,
        log_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_every_s = log_every_s
        self.clock = clock
        self.failure: str | None = None  # the class of the last read's exception, while reads fail
        self._failing_since = 0.0
        self._failed_reads = 0  # since reads started failing
        self._logged_at = 0.0

    def read(self) -> EngineLoad | None:
        """The engine's load now, or None when load() raised (self.failure then names why)."""
        try:
            load = self.engine.load()
        except Exception as exc:
            self._failed(exc)
            return None
        if self.failure is not None:
            log.info(
                "engine %s reports its load again, after %d failed reads over %.0f s",
                self.engine.info.name,
                self._failed_reads,
                self.clock() - self._failing_since,
            )
            self.failure = None
        return load

    def _failed(self, exc: Exception) -> None:
        self.metrics.engine_load_failures.inc()
        now = self.clock()
        name = self.engine.info.name
        if self.failure is None:
            self._failing_since, self._failed_reads, self._logged_at = now, 1, now
            self.failure = exc.__class__.__name__
            log.warning(
                "engine %s: load() failed; its figures are left out of /metrics until it reports again",
                name,
                exc_info=exc,
            )
            return
        self.failure = exc.__class__.__name__
        self._failed_reads += 1
        if now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            log.warning(
                "engine %s: load() still fails: %d failed reads over %.0f s",
                name,
                self._failed_reads,
                now - self._failing_since,
                exc_info=exc,
            )


RESTART_DELAY_FIRST_S = 1.0
RESTART_DELAY_MAX_S = 30.0
RESTART_LOG_EVERY_S = 60.0


@dataclass
class EngineOutage:
    """The supervisor's restarts while the engine stays not ready: each failed attempt (the engine
    is not ready after it, or its start() raised) doubles the wait before the next, from
    RESTART_DELAY_FIRST_S up to RESTART_DELAY_MAX_S; an outage that lasts is logged at most once
    every RESTART_LOG_EVERY_S."""

    since: float
    next_attempt_at: float
    logged_at: float
    delay_s: float = RESTART_DELAY_FIRST_S
    attempts: int = 0
    failed: int = 0  # attempts whose stop() or start() raised
    last_error: Exception | None = None  # the last attempt's, when it raised

    def attempted(self, now: float, error: Exception | None) -> float:
        """Count an attempt that ended at `now` (raising `error`, if not None); the wait before
        the next one."""
        self.attempts += 1
        self.failed += error is not None
        self.last_error = error
        delay_s = self.delay_s
        self.next_attempt_at = now + delay_s
        self.delay_s = min(2 * delay_s, RESTART_DELAY_MAX_S)
        return delay_s
