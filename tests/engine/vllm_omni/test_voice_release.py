"""A voice the vLLM-Omni engine releases (against the simulator): its clip is no longer sent
upstream, and its id is refused as an unknown voice."""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import SynthesisRequest, UnknownVoice
from engine.vllm_omni.engine import VllmOmniEngine
from tests.engine.vllm_omni.simulator import RunningSimulator
from tests.engine.vllm_omni.test_backend import speak


async def test_a_released_voice_is_sent_upstream_no_more(
    sim: RunningSimulator, engine: VllmOmniEngine
) -> None:
    clip = (0.2 * np.sin(2 * np.pi * 150 * np.arange(32_000) / 16_000)).astype(np.float32)
    await engine.register_voice("mine", clip, 16_000, "the transcript")
    await speak(engine, ("Registered.",), voice="mine")
    assert sim.stats.configs[-1]["ref_text"] == "the transcript"
    await engine.unregister_voice("mine")
    assert engine.info.voices  # the server's list: a name outside it is refused at open
    with pytest.raises(UnknownVoice):
        engine.open(SynthesisRequest(request_id="after", voice="mine"))
    await engine.unregister_voice("never-registered")  # no error
