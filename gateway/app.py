"""The Starlette application: routes, and a lifespan that starts and stops the engine."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from engine.api import Engine
from gateway.auth import (
    ANONYMOUS,
    Authenticator,
    AuthMiddleware,
    Principal,
    from_environment,
    make_token_endpoint,
    principal_of,
)
from gateway.compat import Compat, compat_routes
from gateway.compat.voices import VoiceAliases
from gateway.config import GatewayConfig
from gateway.engine_load import RESTART_DELAY_MAX_S, RESTART_LOG_EVERY_S, EngineLoadReader, EngineOutage
from gateway.errors import CLOSE_GOING_AWAY, CLOSE_POLICY
from gateway.messages import ErrorMessage, encode
from gateway.metrics import GatewayMetrics, admission_summary
from gateway.quotas import QuotaError, Quotas
from gateway.rest import make_speech_endpoint
from gateway.session import Session
from gateway.twilio import TwilioGateway
from gateway.voices import VoiceRegistry, make_voice_endpoints
from gateway.webhooks import WebhookSender, WebhookSession

if TYPE_CHECKING:
    from gateway.cluster.state import Cluster

log = logging.getLogger("cadence.app")

WEB_DIR = Path(__file__).resolve().parent.parent / "clients" / "web"
WEB_PAGE = WEB_DIR / "index.html"
FAVICON = WEB_DIR / "favicon.ico"


class TtfaWindow:
    """Median time to first audio over the last minute, from the TTFA histogram: snapshots of its
    cumulative bucket counts (all endpoints), the median of the difference across the window
    interpolated within its bucket (as Prometheus' histogram_quantile does)."""

    def __init__(self, metrics: GatewayMetrics, window_s: float = 60.0) -> None:
        self.metrics, self.window_s = metrics, window_s
        self._snaps: list[tuple[float, dict[float, float]]] = [(time.monotonic(), {})]

    def _counts(self) -> dict[float, float]:
        counts: dict[float, float] = {}
        for family in self.metrics.ttfa.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    counts[le] = counts.get(le, 0.0) + s.value
        return counts

    def sample(self) -> None:
        now = time.monotonic()
        self._snaps.append((now, self._counts()))
        while len(self._snaps) > 2 and self._snaps[1][0] <= now - self.window_s:
            self._snaps.pop(0)

    def p50_ms(self) -> tuple[float | None, int]:
        """(median in ms or None, utterances in the window)."""
        self.sample()
        base, last = self._snaps[0][1], self._snaps[-1][1]
        delta = sorted((le, n - base.get(le, 0.0)) for le, n in last.items())
        total = delta[-1][1] if delta else 0.0
        if total <= 0:
            return None, 0
        rank, lower, below = total / 2, 0.0, 0.0
        for le, cum in delta:
            if cum >= rank:
                if math.isinf(le):
                    return 1000 * lower, int(total)
                return 1000 * (lower + (le - lower) * (rank - below) / max(cum - below, 1e-9)), int(total)
            lower, below = le, cum
        return 1000 * lower, int(total)


class Gateway:
    """What the routes share: the engine, the limits, the metrics and the open sessions. Built
    with a `cluster` (gateway.cluster.state), it is one replica of several: the cluster's quotas,
    voices, engine and session set are the ones it uses."""

    def __init__(
        self,
        engine: Engine,
        config: GatewayConfig,
        auth: Authenticator | None = None,
        *,
        cluster: Cluster | None = None,
        webhooks: WebhookSender | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.metrics = metrics or GatewayMetrics()
        self.ready = False
        self.closing = False
        self.auth = auth or from_environment(config.api_keys_file, config.allowed_origins)
        self.engine: Engine
        self.quotas: Quotas
        self.voices: VoiceRegistry
        self.sessions: set[Session]
        if cluster is not None:
            self.engine, self.quotas, self.voices = cluster.engine, cluster.quotas, cluster.voices
            self.sessions = cluster.sessions
            self.metrics.include(cluster.registry)
        else:
            self.engine, self.quotas = engine, Quotas(config.quota_limits)
            self.voices = VoiceRegistry(engine, config, config.voices_dir)
            self.sessions = set()
        self.engine_load = EngineLoadReader(self.engine, self.metrics)
        self.engine_restarts = 0
        self.engine_problem: str | None = None  # why the engine is not ready, while it is not
        # utterance.interrupted -> session's webhook_url
        self.webhooks = webhooks or WebhookSender.from_env()
        # read through the gateway at each scrape: the sender of the moment, calls' deliveries too
        self.metrics.watch_webhooks(lambda: self.webhooks.stats)
        self.ttfa_window = TtfaWindow(self.metrics)
        self.voice_aliases = VoiceAliases.load(config.voice_aliases_file)  # other vendors' voice names

    async def close_sessions(self) -> None:
        """Shutdown: refuse new sessions, drain the open ones (bounded), close them with 1001."""
        self.closing = True
        sessions = list(self.sessions)
        if sessions:
            await asyncio.gather(
                *(s.shutdown(self.config.drain_timeout_s) for s in sessions), return_exceptions=True
            )

    async def stream(self, websocket: WebSocket) -> None:
        await websocket.accept()
        if self.closing:
            await websocket.close(CLOSE_GOING_AWAY, "server shutting down")
            return
        principal = principal_of(websocket)
        quotas = self.quotas_for(principal)
        try:
            if quotas is not None:
                quotas.open_session(principal.key_id)
        except QuotaError as exc:
            self.metrics.errors.labels(exc.code).inc()  # sent here, not through a session's actions
            error: ErrorMessage = {"type": "error", "code": exc.code, "message": exc.message}
            if exc.retry_after_ms is not None:  # when to connect again (a hint: a count)
                error["retry_after_ms"] = exc.retry_after_ms
            await websocket.send_text(encode(error))
            await websocket.close(CLOSE_POLICY, exc.message[:120])
            return
        session = WebhookSession(
            websocket,
            self.engine,
            self.config,
            self.metrics,
            webhooks=self.webhooks,
            key_id=principal.key_id,
            allowed_voices=principal.voices,
            voice_usable=functools.partial(self.voices.usable_by, principal.key_id),
            quotas=quotas,
        )
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            if quotas is not None:
                session.protocol.abort()  # utterances the client left open give their quota back
                quotas.close_session(principal.key_id)

    def quotas_for(self, principal: Principal) -> Quotas | None:
        """The per-key limits, unless the caller is the anonymous local user (config.quota_anonymous)."""
        if principal.key_id == ANONYMOUS.key_id and not self.config.quota_anonymous:
            return None
        return self.quotas

    async def supervise_engine(
        self,
        period_s: float = 1.0,
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Restart an engine that stops being ready (its worker died) while the gateway serves;
        /readyz says 503 with the reason meanwhile, and counts the restarts. An engine that stays
        not ready (an upstream that is down, a start() that raises) is restarted at once, then at
        growing intervals (EngineOutage), so a long outage is neither hammered nor logged at every
        attempt."""
        outage: EngineOutage | None = None
        name = self.engine.info.name
        while True:
            await sleep(period_s)
            self.ttfa_window.sample()  # keeps the one-minute TTFA window current between /v1/load calls
            if not self.ready or self.closing:
                continue
            load = self.engine_load.read()  # a broken engine may fail to report at all
            if load is None:
                self.engine_problem = f"load() failed: {self.engine_load.failure}"
            elif not load.ready:
                self.engine_problem = "engine not ready"
            else:
                self.engine_problem = None
                if outage is not None:
                    log.info(
                        "engine %s is ready again after %d restart attempts over %.0f s",
                        name,
                        outage.attempts,
                        clock() - outage.since,
                    )
                    outage = None
                continue
            now = clock()
            if outage is None:
                outage = EngineOutage(since=now, next_attempt_at=now, logged_at=now)
                log.error(
                    "engine %s is not ready (%s): restarting it, then at growing intervals (at most %.0f s)"
                    " while it stays so",
                    name,
                    self.engine_problem,
                    RESTART_DELAY_MAX_S,
                )
            elif now < outage.next_attempt_at:
                continue
            elif now - outage.logged_at >= RESTART_LOG_EVERY_S:
                outage.logged_at = now
                log.error(
                    "engine %s is still not ready (%s): %d restart attempts over %.0f s (%d failed);"
                    " restarting it again",
                    name,
                    self.engine_problem,
                    outage.attempts,
                    now - outage.since,
                    outage.failed,
                    exc_info=outage.last_error,
                )
            error: Exception | None = None
            try:
                await self.engine.stop()
                await self.engine.start()
            except Exception as exc:
                error = exc
            else:
                self.engine_restarts += 1
                self.metrics.engine_restarts.inc()
            # a start can take long (workers loading a model): the next attempt waits from its end
            delay_s = outage.attempted(clock(), error)
            if error is not None and outage.failed == 1:  # later failures are counted in the lines above
                log.error("engine %s: restart failed; retrying in %.0f s", name, delay_s, exc_info=error)

    async def healthz(self, request: Request) -> Response:
        """Liveness: the process answers (200); it reads neither the engine nor the store."""
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """Ready to serve (200) or not (503), and why; `store` is the shared store's state: a
        replica whose store is unreachable still serves (degraded: 200, and says so). An engine
        whose load() fails is not ready: `reason` names the exception's class, and `active`,
        `queued` and `capacity` are null."""
        load = self.engine_load.read()
        ready = self.ready and load is not None and load.ready and not self.closing
        body: dict[str, Any] = {
            "ready": ready,
            "engine": self.engine.info.name,
            "replica": self.config.replica_id,
            "active": load.active if load is not None else None,
            "queued": load.queued if load is not None else None,
            "capacity": load.capacity if load is not None else None,
            "engine_restarts": self.engine_restarts,
            "store": self.cluster.store.state() if self.cluster is not None else {"state": "none"},
        }
        if not ready:
            if self.closing:
                body["reason"] = "shutting down"
            elif load is None:
                body["reason"] = f"load() failed: {self.engine_load.failure}"
            else:
                body["reason"] = self.engine_problem or ("starting" if not self.ready else "engine not ready")
        return JSONResponse(body, 200 if ready else 503)

    async def metrics_page(self, request: Request) -> Response:
        """Prometheus exposition. A failed load() leaves the engine's figures out of this scrape
        (cadence_engine_load_failures_total counts it); the gateway's own metrics are all served."""
        self.metrics.observe_engine(self.engine_load.read())
        self.metrics.observe_sessions([s.queued_bytes() for s in self.sessions], len(asyncio.all_tasks()))
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def live_load(self, request: Request) -> Response:
        """GET /v1/load: the engine's load figures and the gateway's, for the page's live panel;
        503 `engine_unavailable` (Retry-After: 1) while the engine's load() fails."""
        load = self.engine_load.read()
        if load is None:
            message = f"the engine could not report its load ({self.engine_load.failure}); try again shortly"
            return JSONResponse(
                {
                    "error": {
                        "message": message,
                        "type": "server_error",
                        "param": None,
                        "code": "engine_unavailable",
                    }
                },
                503,
                headers={"Retry-After": "1"},
            )
        ttfa_ms, ttfa_count = self.ttfa_window.p50_ms()
        utterances = self.metrics.registry.get_sample_value("cadence_active_utterances") or 0.0
        return JSONResponse(
            {
                "engine": {
                    "name": self.engine.info.name,
                    "model": self.engine.info.model,
                    "ready": load.ready,
                    "active": load.active,
                    "queued": load.queued,
                    "capacity": load.capacity,
                    "queue_limit": load.queue_limit,
                    "figures": {k: v for k, v in load.extra.items() if math.isfinite(v)},  # JSON has no NaN
                    "admission": admission_summary(load.admission),
                },
                "gateway": {
                    "sessions": len(self.sessions),
                    "utterances": int(utterances),
                    "ttfa_p50_ms": ttfa_ms,
                    "ttfa_utterances_1m": ttfa_count,
                    "engine_restarts": self.engine_restarts,
                },
            }
        )

    async def index(self, request: Request) -> Response:
        if WEB_PAGE.is_file():
            return FileResponse(WEB_PAGE, media_type="text/html")
        return PlainTextResponse("Cadence gateway: WS /v1/stream, POST /v1/audio/speech\n")


def create_app(
    engine: Engine, config: GatewayConfig | None = None, auth: Authenticator | None = None
) -> Starlette:
    config = config or GatewayConfig()
    webhooks = WebhookSender.from_env()
    metrics = GatewayMetrics()  # /v1/stream's, REST's and the phone lines' alike
    twilio = TwilioGateway(engine, config, webhooks, metrics=metrics)
    cluster = None
    if config.redis_url:  # replicas sharing voices, quotas and control (gateway.cluster.state)
        from gateway.cluster.state import Cluster

        cluster = Cluster(engine, config, twilio)
    gateway = Gateway(engine, config, auth, cluster=cluster, webhooks=webhooks, metrics=metrics)
    twilio.voice_usable = gateway.voices.usable_by  # a call speaks only its agent's key's voices
    twilio.auth = gateway.auth  # a media stream's `token` parameter is checked as any credential

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        await gateway.voices.load_saved()
        if cluster is not None:
            await cluster.start()
        gateway.ready = True
        log.info("engine %s (%s) ready", engine.info.name, engine.info.model)
        supervisor = asyncio.create_task(gateway.supervise_engine())
        try:
            yield
        finally:
            supervisor.cancel()
            gateway.ready = False
            await gateway.close_sessions()
            await twilio.close()
            await engine.stop()
            await gateway.webhooks.close()
            if cluster is not None:
                await cluster.stop()

    voices_collection, voices_item = make_voice_endpoints(gateway.voices)
    routes = [
        WebSocketRoute("/v1/stream", gateway.stream),
        Route(
            "/v1/audio/speech",
            make_speech_endpoint(
                engine,
                gateway.config,
                gateway.metrics,
                gateway.quotas_for,
                gateway.voice_aliases,
                draining=lambda: gateway.closing,
                voice_usable=gateway.voices.usable_by,
            ),
            methods=["POST"],
        ),
        Route("/v1/tokens", make_token_endpoint(gateway.auth), methods=["POST"]),
        Route("/v1/voices", voices_collection, methods=["GET", "POST"]),
        Route("/v1/voices/{voice_id}", voices_item, methods=["GET", "DELETE"]),
        Route("/healthz", gateway.healthz),
        Route("/readyz", gateway.readyz),
        Route("/health", gateway.readyz),  # vLLM's name for it (vLLM-Omni clients probe it)
        Route("/metrics", gateway.metrics_page),
        Route("/v1/load", gateway.live_load),
        Route("/", gateway.index),
        Route("/favicon.ico", lambda request: FileResponse(FAVICON, media_type="image/x-icon")),
        *(cluster.routes() if cluster is not None else ()),
        *twilio.routes(),  # WS /v1/twilio, WS /v1/twilio/control/{call_sid}
        # ElevenLabs-, Cartesia- and vLLM-Omni-compatible WebSockets over native sessions
        *compat_routes(
            Compat(
                gateway.stream,
                lambda: engine.info,
                gateway.voice_aliases,
                gateway.auth,
                max_open_utterances=gateway.config.max_open_utterances,
                max_text_chars=gateway.config.max_text_chars,
            )
        ),
        Mount("/web", StaticFiles(directory=WEB_DIR, check_dir=False), name="web"),  # the page's scripts
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=[Middleware(AuthMiddleware, auth=gateway.auth)]
    )
    app.state.gateway = gateway
    app.state.twilio = twilio
    return app
