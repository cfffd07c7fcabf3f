"""`ref_audio` on POST /v1/audio/speech: a one-off voice clone. The clip is decoded and checked at
the gateway (a 400 that says why when unusable) and reaches the engine as samples and their rate."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf

from tests.fakes import FakeEngine
from tests.integration.conftest import RunningGateway
from tests.integration.test_rest import post


def wav_b64(samples: np.ndarray, rate: int) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def speech_clip(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


async def test_a_reference_clip_reaches_the_engine(gateway: RunningGateway) -> None:
    clip = wav_b64(speech_clip(2.0, 16000), 16000)
    response = await post(
        gateway, input="Hello.", ref_audio=f"data:audio/wav;base64,{clip}", ref_text="Hi there."
    )
    assert response.status_code == 200, response.text
    engine = gateway.engine
    assert isinstance(engine, FakeEngine)
    request = engine.streams[-1].request
    assert request.ref_text == "Hi there." and request.ref_audio is not None
    samples, rate = request.ref_audio
    # resampled to the engine's own rate off the event loop: the engine's open has nothing left to do
    assert rate == engine.info.sample_rate and samples.shape == (2 * engine.info.sample_rate,)
    assert abs(float(samples.max()) - 0.4) < 0.02


async def test_unusable_reference_clips_get_a_400_that_says_why(gateway: RunningGateway) -> None:
    cases = {
        "not base64 !!": "base64",
        base64.b64encode(b"not audio at all").decode(): "could not be read",
        wav_b64(np.zeros(32000, np.float32), 16000): "silent",
        wav_b64(speech_clip(0.4, 16000), 16000): "at least",
    }
    for value, reason in cases.items():
        response = await post(gateway, input="Hello.", ref_audio=value)
        assert response.status_code == 400, (reason, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_audio" and reason in error["message"], error
    assert not gateway.engine.streams  # type: ignore[attr-defined]
