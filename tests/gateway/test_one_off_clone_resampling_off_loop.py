"""A one-off clone's reference clip at a high sample rate is brought to the engine's rate off the
event loop, over real uvicorn on loopback: the loop that carries every session's audio keeps its
timers on time while the clip is taken, and the engine's open() gets a clip it need not resample."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from engine.api import SynthesisRequest
from engine.qwen3.reference_audio import TARGET_RATE, prepare_reference_audio
from tests.fakes import FakeEngine, FakeStream
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)

CLIP_RATE = 192_000
CLIP_S = 29.0  # a FLAC sine: 1.2 MB to send and decode, 5.6 M samples to resample


class CloningEngine(FakeEngine):
    """Takes a one-off clip in open() as the Qwen3 engine does (prepare_reference_audio), and keeps
    the event loop it runs on so a test can time that loop."""

    loop: asyncio.AbstractEventLoop | None = None
    clip_rates: list[int]

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.clip_rates = []
        await super().start()

    def open(self, request: SynthesisRequest) -> FakeStream:
        if request.ref_audio is not None:
            audio, rate = request.ref_audio
            self.clip_rates.append(rate)
            prepare_reference_audio(audio, rate)
        return super().open(request)


async def loop_stall(
    loop: asyncio.AbstractEventLoop, operation: Callable[[], Awaitable[Any]], tick_s: float = 0.002
) -> float:
    """The longest a timer on `loop` (the gateway's, in another thread) fired late while
    `operation()` ran."""
    done = False

    async def ticker() -> float:
        worst = 0.0
        while not done:
            due = loop.time() + tick_s
            await asyncio.sleep(tick_s)
            worst = max(worst, loop.time() - due)
        return worst

    future = asyncio.run_coroutine_threadsafe(ticker(), loop)
    await asyncio.sleep(tick_s * 5)  # ticking
    try:
        await operation()
    finally:
        done = True
    return await asyncio.wrap_future(future)


def _clip() -> str:
    t = np.arange(int(CLIP_RATE * CLIP_S)) / CLIP_RATE
    audio = 0.3 * np.sin(2 * np.pi * 180 * t)
    buffer = io.BytesIO()
    sf.write(buffer, audio.astype(np.float32), CLIP_RATE, format="FLAC", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


async def test_a_high_rate_reference_clip_is_resampled_off_the_event_loop() -> None:
    clip = _clip()
    samples = np.asarray(sf.read(io.BytesIO(base64.b64decode(clip)), dtype="float32")[0])
    costs = []
    for _ in range(3):  # what resampling the clip on the loop would stall it by
        began = time.perf_counter()
        prepare_reference_audio(samples, CLIP_RATE)
        costs.append(time.perf_counter() - began)
    resample_s = min(costs)

    engine = CloningEngine(step_s=0.0)
    with run_gateway(engine) as gw:
        assert engine.loop is not None
        async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
            responses: list[httpx.Response] = []

            async def speak() -> None:
                responses.append(
                    await http.post(
                        "/v1/audio/speech",
                        json={"input": "Hello.", "response_format": "pcm", "ref_audio": clip},
                    )
                )

            stalls = [await loop_stall(engine.loop, speak) for _ in range(3)]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert min(stalls) < resample_s / 2, (stalls, resample_s)
    assert engine.clip_rates == [TARGET_RATE] * 3  # nothing left for open() to resample
