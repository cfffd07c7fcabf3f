"""The page's first impressions in real Chromium: the Voice menu offers the engine's presets and the
registered voices, the favicon is there, and Chinese words render in a font that has them (the
test set-up installs one; without it Chromium draws empty boxes)."""

from __future__ import annotations

import io
import subprocess
from typing import Any

import httpx
import numpy as np
import soundfile as sf

from tests.browser.conftest import screenshot
from tests.integration.conftest import RunningGateway


def test_the_voice_menu_offers_presets_and_registered_voices(
    page: Any, espeak_gateway: RunningGateway
) -> None:
    clip = io.BytesIO()
    sf.write(clip, (0.1 * np.sin(np.arange(24000 * 2) / 10)).astype(np.float32), 24000, format="WAV")
    # espeak clones no voice: the clip is stored all the same (and listed), with a 400 saying so
    httpx.post(f"{espeak_gateway.http}/v1/voices", params={"name": "Mine"}, content=clip.getvalue())
    page.goto(f"{espeak_gateway.http}/")
    page.wait_for_function("document.querySelectorAll('#voice optgroup').length > 0")
    groups = page.evaluate("""() => [...document.querySelectorAll('#voice optgroup')].map(g =>
        ({label: g.label, options: [...g.querySelectorAll('option')].map(o => o.textContent)}))""")
    presets = next(g for g in groups if g["label"] == "Engine presets")["options"]
    assert {"Vivian", "Ryan", "female", "male"} <= set(presets)  # the espeak engine's own voices
    assert next(g for g in groups if g["label"] == "Registered voices")["options"] == ["Mine"]
    page.select_option("#voice", "Ryan")
    page.fill("#text", "Hello.")
    page.click("#speak")
    page.wait_for_function("window.sent.some(s => s.msg.type === 'session.start')")
    start = page.evaluate("window.sent.find(s => s.msg.type === 'session.start').msg")
    assert start["voice"] == "Ryan"
    favicon = httpx.get(f"{espeak_gateway.http}/favicon.ico")
    assert favicon.status_code == 200 and favicon.headers["content-type"] == "image/x-icon"
    assert favicon.content[:4] == b"\x00\x00\x01\x00"  # an ICO file


def chinese_families() -> set[str]:
    """Font families fontconfig says cover Chinese (each line lists a family's names)."""
    listed = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True).stdout
    return {name.strip() for line in listed.splitlines() for name in line.split(",") if name.strip()}


def test_chinese_words_render_in_a_chinese_font(page: Any, espeak_gateway: RunningGateway) -> None:
    assert chinese_families(), "no font covers Chinese: scripts/setup test installs fonts-wqy-zenhei"
    page.goto(f"{espeak_gateway.http}/")
    page.wait_for_function("window.cadence !== undefined")
    page.fill("#text", "你好，世界。")
    page.click("#speak")
    page.wait_for_function("document.querySelectorAll('#words .word').length > 0", timeout=20_000)
    screenshot(page, "page-chinese.png")
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": "#words"})["nodeId"]
    fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    used = {f["familyName"] for f in fonts if f["glyphCount"] > 0}
    assert used & chinese_families(), fonts  # the glyphs came from a font that has them
