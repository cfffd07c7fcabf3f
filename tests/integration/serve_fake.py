"""`python -m tests.integration.serve_fake PORT`: the real server (uvicorn, signal handling) with a
slow FakeEngine, for the SIGTERM drain test."""

from __future__ import annotations

import sys

from gateway.config import GatewayConfig
from gateway.server import serve
from tests.fakes import FakeEngine

if __name__ == "__main__":
    serve(
        FakeEngine(step_s=0.02),
        "127.0.0.1",
        int(sys.argv[1]),
        GatewayConfig(drain_timeout_s=1.0),
        log_level="warning",
    )
