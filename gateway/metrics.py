"""Prometheus metrics, one registry per app (so tests and several apps never share counters)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import AdmissionFigures, EngineLoad
from gateway.gc_pauses import BUCKETS_S, GcPauses


class DeliveryCounts(Protocol):
    """What the webhook sender counts (gateway.webhooks.WebhookStats), read at each scrape."""

    delivered: int
    failed: int
    dropped: int
    attempts: int


_TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttfa = Histogram(
            "cadence_ttfa_seconds",
            "Time from an utterance's first text (its admission, when it waited in the engine's queue) "
            "to its first packet sent",
            ["endpoint"],
            buckets=_TTFA_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "cadence_rtf",
            "Synthesis wall time (from admission) over audio duration, per utterance",
            ["endpoint"],
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.active_sessions = Gauge("cadence_active_sessions", "Open WebSocket sessions", registry=r)
        self.active_utterances = Gauge("cadence_active_utterances", "Utterances in progress", registry=r)
        # the engine's load at the last observe_engine; None before one, or when load() failed
        self.load: EngineLoad | None = None
        r.register(_EngineLoadCollector(self))
        self.admission: AdmissionFigures | None = None  # the engine's, at the last observe_engine
        r.register(_AdmissionCollector(self))
        self.engine_load_failures = Counter(
            "cadence_engine_load_failures",
            "Reads of the engine's load that failed (the gateway's once-a-second check, /metrics, "
            "/readyz, /v1/load): the engine's figures are left out of a scrape whose read failed",
            registry=r,
        )
        self.errors = Counter("cadence_errors", "Error messages and responses, by code", ["code"], registry=r)
        self.utterances = Counter("cadence_utterances", "Utterances opened", ["endpoint"], registry=r)
        self.packets = Counter("cadence_packets_sent", "Audio packets sent on /v1/stream", registry=r)
        self.engine_restarts = Counter(
            "cadence_engine_restarts", "Engine restarts after it stopped being ready", registry=r
        )
        self.session_queue_bytes = Gauge(
            "cadence_session_queue_bytes", "Bytes queued to send, all sessions", registry=r
        )
        self.session_queue_bytes_max = Gauge(
            "cadence_session_queue_bytes_max", "Bytes queued to send, the fullest session", registry=r
        )
        self.event_loop_tasks = Gauge("cadence_event_loop_tasks", "asyncio tasks alive", registry=r)
        self.figures: dict[str, float] = {}  # the engine's EngineLoad.extra, at the last observe_engine
        r.register(_EngineFigureCollector(self))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, ...

    def watch_gc(self, pauses: GcPauses) -> None:
        """Expose `pauses` (read at each scrape): cadence_gc_pause_seconds by generation and
        cadence_gc_pause_longest_seconds."""
        self.registry.register(_GcPauseCollector(pauses))

    def watch_webhooks(self, stats: Callable[[], DeliveryCounts]) -> None:
        """Expose the webhook sender's counts (`stats()`, read at each scrape):
        cadence_webhook_deliveries_total{outcome} and cadence_webhook_attempts_total."""
        self.registry.register(_WebhookCollector(stats))

    def include(self, other: CollectorRegistry) -> None:
        """Serve `other`'s metrics with these (read at each scrape): a cluster's."""
        self.registry.register(_RegistryCollector(other))

    def observe_engine(self, load: EngineLoad | None) -> None:
        """What the engine reports now; None when its load() failed: then every series built from
        its load leaves /metrics (none is current) until it reports again."""
        self.load = load
        self.admission = load.admission if load is not None else None
        self.figures = dict(load.extra) if load is not None else {}

    def observe_sessions(self, queued_bytes: list[int], tasks: int) -> None:
        self.session_queue_bytes.set(sum(queued_bytes))
        self.session_queue_bytes_max.set(max(queued_bytes, default=0))
        self.event_loop_tasks.set(tasks)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _WebhookCollector(Collector):
    """The webhook sender's own counts since start (gateway.webhooks.WebhookStats), read rather
    than counted twice; `outcome` is one of a fixed few, never the URL."""

    def __init__(self, stats: Callable[[], DeliveryCounts]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        deliveries = CounterMetricFamily(
            "cadence_webhook_deliveries",
            "Webhook deliveries by outcome: delivered (2xx), failed (a final refusal or out of "
            "attempts), dropped (too many in flight)",
            labels=["outcome"],
        )
        deliveries.add_metric(["delivered"], stats.delivered)
        deliveries.add_metric(["failed"], stats.failed)
        deliveries.add_metric(["dropped"], stats.dropped)
        yield deliveries
        yield CounterMetricFamily(
            "cadence_webhook_attempts", "Webhook POST attempts, retries included", value=stats.attempts
        )


class _RegistryCollector(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()


def admission_summary(figures: AdmissionFigures | None) -> dict[str, object] | None:
    """The engine's admission for GET /v1/load (the page's load panel): the queue's waits in ms."""
    if figures is None:
        return None

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(1000 * seconds, 1)

    return {
        "capacity": figures.capacity,
        "max_streams": figures.max_streams,
        "admitted": figures.admitted,
        "queued": figures.queued,
        "queue_limit": figures.queue_limit,
        "admitted_total": figures.admitted_total,
        "queued_total": figures.queued_total,
        "refused": dict(figures.refused),
        "queue_wait_p50_ms": ms(figures.wait_p50_s),
        "queue_wait_p90_ms": ms(figures.wait_p90_s),
    }


class _EngineLoadCollector(Collector):
    """The engine's counts (engine.api.EngineLoad) as they were at the last observe_engine, absent
    when that read failed rather than its predecessor's values shown as current."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        load = self.metrics.load
        if load is None:
            return
        yield GaugeMetricFamily("cadence_engine_active", "Engine requests producing audio", value=load.active)
        yield GaugeMetricFamily("cadence_engine_queue_depth", "Engine requests waiting", value=load.queued)
        yield GaugeMetricFamily(
            "cadence_engine_capacity",
            "Streams the engine admits now (its measured cost, within its bound)",
            value=load.capacity,
        )


class _AdmissionCollector(Collector):
    """The engine's admission (engine.api.AdmissionFigures), as it was at the last observe_engine:
    its counts are the engine's own since start, so they are read, not re-counted here."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        figures = self.metrics.admission
        if figures is None:
            return
        yield GaugeMetricFamily(
            "cadence_engine_max_streams",
            "The engine's upper bound on admitted streams",
            value=figures.max_streams,
        )
        yield GaugeMetricFamily(
            "cadence_engine_queue_limit",
            "Requests the engine's queue holds at most",
            value=figures.queue_limit,
        )
        yield CounterMetricFamily(
            "cadence_engine_admitted", "Requests the engine admitted", value=figures.admitted_total
        )
        yield CounterMetricFamily(
            "cadence_engine_queued",
            "Requests that waited in the engine's queue before admission",
            value=figures.queued_total,
        )
        refusals = CounterMetricFamily(
            "cadence_engine_refusals", "Requests the engine refused, by reason", labels=["reason"]
        )
        for reason, count in sorted(figures.refused.items()):
            refusals.add_metric([reason], count)
        yield refusals
        histogram = HistogramMetricFamily(
            "cadence_engine_queue_wait_seconds",
            "Time requests waited in the engine's queue before admission (those that waited)",
        )
        bounds = [*(repr(b) for b in figures.wait_bounds_s), "+Inf"]
        histogram.add_metric([], list(zip(bounds, figures.wait_counts, strict=True)), figures.wait_sum_s)
        yield histogram


class _EngineFigureCollector(Collector):
    """The engine's figures (EngineLoad.extra) as they were at the last observe_engine. Read, not
    set on labelled gauges: a figure the engine no longer reports (a worker restarted, a percentile
    with no samples left, one present only under load), or every figure when its load() failed,
    must leave /metrics rather than repeat its last value as if current."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        figures = self.metrics.figures
        family = GaugeMetricFamily(
            "cadence_engine_figure", "Engine-specific load figures (EngineLoad.extra)", labels=["name"]
        )
        for name, value in figures.items():
            family.add_metric([name], value)
        yield family
        peak = figures.get("gpu_memory_peak_bytes")
        if peak is not None:  # absent, not 0, from an engine that reports no GPU memory
            yield GaugeMetricFamily(
                "cadence_gpu_memory_peak_bytes", "Peak GPU memory allocated by the engine", value=peak
            )


class _GcPauseCollector(Collector):
    """Read at scrape time: the pauses are counted by the collector's own hook, which must take no
    lock (gateway/gc_pauses.py), so they are not prometheus_client metrics observed from it."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Metric]:
        histogram = HistogramMetricFamily(
            "cadence_gc_pause_seconds",
            "Garbage collector pauses of the gateway's process, by generation",
            labels=["generation"],
        )
        bounds = [*(repr(b) for b in BUCKETS_S), "+Inf"]
        for generation, cumulative, total in self.pauses.histograms():
            histogram.add_metric([str(generation)], list(zip(bounds, cumulative, strict=True)), total)
        yield histogram
        yield GaugeMetricFamily(
            "cadence_gc_pause_longest_seconds",
            "The gateway's longest garbage collector pause in the last minute",
            value=self.pauses.longest_s(),
        )
