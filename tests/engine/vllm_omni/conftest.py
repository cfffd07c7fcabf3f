"""Fixtures: the vLLM-Omni simulator on loopback and a backend engine pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest

from engine.vllm_omni.engine import VllmOmniConfig, VllmOmniEngine
from tests.engine.vllm_omni.simulator import RunningSimulator, SimulatorOptions, run_simulator

FAST = VllmOmniConfig(
    backoff_initial_s=0.05,
    backoff_max_s=0.2,
    health_interval_s=0.2,
    connect_timeout_s=2.0,
    first_audio_timeout_s=5.0,
    stall_timeout_s=5.0,
)


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimulatorOptions()) as running:
        yield running


def engine_for(sim: RunningSimulator, **overrides: object) -> VllmOmniEngine:
    return VllmOmniEngine(replace(FAST, upstream=sim.url, **overrides))  # type: ignore[arg-type]


@pytest.fixture
async def engine(sim: RunningSimulator) -> AsyncIterator[VllmOmniEngine]:
    eng = engine_for(sim)
    await eng.start()
    yield eng
    await eng.stop()
