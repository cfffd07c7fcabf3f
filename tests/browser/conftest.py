"""Debian's Chromium driven by Playwright (never a downloaded browser) against the real gateway with
the eSpeak engine on loopback uvicorn."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.espeak.engine import EspeakEngine
from tests.integration.conftest import RunningGateway, run_gateway

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
]


@pytest.fixture
def espeak_gateway() -> Iterator[RunningGateway]:
    with run_gateway(EspeakEngine()) as running:
        yield running


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh Chromium profile and page; the sent WebSocket frames are recorded in window.sent."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (scripts/test installs it)")
    monkeypatch.setenv("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    profile = tempfile.mkdtemp(prefix="cadence-chromium-")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 900, "height": 900},
        )
        context.add_init_script("""
            window.sent = [];
            const send = WebSocket.prototype.send;
            WebSocket.prototype.send = function (data) {
              if (typeof data === "string") window.sent.push({ t: performance.now(), msg: JSON.parse(data) });
              return send.call(this, data);
            };
        """)
        try:
            yield context.new_page()
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
