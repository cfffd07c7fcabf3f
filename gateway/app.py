"""The Starlette application: routes, and a lifespan that starts and stops the engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from engine.api import Engine
from gateway.config import GatewayConfig
from gateway.errors import CLOSE_GOING_AWAY
from gateway.metrics import GatewayMetrics
from gateway.rest import make_speech_endpoint
from gateway.session import Session
from gateway.twilio import TwilioGateway
from gateway.webhooks import WebhookSender, WebhookSession

log = logging.getLogger("cadence.app")

WEB_DIR = Path(__file__).resolve().parent.parent / "clients" / "web"
WEB_PAGE = WEB_DIR / "index.html"


class Gateway:
    """What the routes share: the engine, the limits, the metrics and the open sessions."""

    def __init__(self, engine: Engine, config: GatewayConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = GatewayMetrics()
        self.sessions: set[Session] = set()
        self.ready = False
        self.closing = False
        self.webhooks = WebhookSender.from_env()  # utterance.interrupted -> session's webhook_url

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
        session = WebhookSession(websocket, self.engine, self.config, self.metrics, webhooks=self.webhooks)
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        load = self.engine.load()
        ready = self.ready and load.ready and not self.closing
        body = {"ready": ready, "engine": self.engine.info.name, "active": load.active, "queued": load.queued,
                "capacity": load.capacity}
        return JSONResponse(body, 200 if ready else 503)

    async def metrics_page(self, request: Request) -> Response:
        self.metrics.observe_engine(self.engine.load())
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def index(self, request: Request) -> Response:
        if WEB_PAGE.is_file():
            return FileResponse(WEB_PAGE, media_type="text/html")
        return PlainTextResponse("Cadence gateway: WS /v1/stream, POST /v1/audio/speech\n")


def create_app(engine: Engine, config: GatewayConfig | None = None) -> Starlette:
    gateway = Gateway(engine, config or GatewayConfig())
    twilio = TwilioGateway(engine, gateway.config, gateway.webhooks)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        gateway.ready = True
        log.info("engine %s (%s) ready", engine.info.name, engine.info.model)
        try:
            yield
        finally:
            gateway.ready = False
            await gateway.close_sessions()
            await twilio.close()
            await engine.stop()
            await gateway.webhooks.close()

    routes = [
        WebSocketRoute("/v1/stream", gateway.stream),
        Route("/v1/audio/speech", make_speech_endpoint(engine, gateway.config, gateway.metrics), methods=["POST"]),
        Route("/healthz", gateway.healthz),
        Route("/readyz", gateway.readyz),
        Route("/metrics", gateway.metrics_page),
        Route("/", gateway.index),
        *twilio.routes(),  # WS /v1/twilio, WS /v1/twilio/control/{call_sid}
        Mount("/web", StaticFiles(directory=WEB_DIR, check_dir=False), name="web"),  # the page's scripts
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    app.state.twilio = twilio
    return app
