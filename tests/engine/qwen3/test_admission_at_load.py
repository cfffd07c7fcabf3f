"""The Qwen3 scheduler's admission by measured cost at twice its capacity: the real scheduler in the
load simulation (bench/sim_engine.py) against a GPU cost model, on a simulated clock (the GPU is the
one part no machine here has; its step costs come from the H200 figures, scaled so that a few
dozen streams fill it and the run stays short). Closed-loop clients retry after Retry-After."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench.sim_engine import Costs, Simulation, load_costs

QUEUE_LIMIT = 40


def args(**changes: Any) -> argparse.Namespace:
    base = argparse.Namespace(
        seconds=40.0,
        warmup=5.0,
        prompt=1,
        buffer_ms=150.0,
        seed=0,
        merge_below=None,
        ramp_s=0.5,
        smooth=None,
        delivery_base_ms=0.0,
        delivery_jitter_ms=0.0,
        gateway_us_per_packet=0.0,
        set=None,
        slots=256,  # the memory bound, far above what the cost admits
        queue_limit=QUEUE_LIMIT,
    )
    for name, value in changes.items():
        setattr(base, name, value)
    return base


@pytest.fixture(scope="module")
def costs() -> Costs:
    """The H200 model with every per-row cost ten times larger: the step reaches a frame's
    duration at about a tenth of the streams."""
    model = load_costs(None, None)
    model.decode = (model.decode[0], 10 * model.decode[1])
    model.sample = (model.sample[0], 10 * model.sample[1])
    model.codec_scale *= 6
    return model


@pytest.fixture(scope="module")
def runs(costs: Costs) -> dict[int, dict[str, Any]]:
    return {n: Simulation(args(), n, costs).run() for n in (40, 80, 160)}


def test_under_capacity_everything_is_admitted_at_once(runs: dict[int, dict[str, Any]]) -> None:
    light = runs[40]
    assert light["queued"] == 0 and light["refused"] == 0
    assert light["max_admitted"] <= 40 and light["underrun_streams_pct"] == 0.0


def test_twice_the_capacity_keeps_admitted_streams_real_time(runs: dict[int, dict[str, Any]]) -> None:
    at_capacity, twice = runs[80], runs[160]
    capacity = at_capacity["capacity"]
    assert 50 <= capacity <= 110  # where the step's predicted time reaches the headroom
    assert twice["offered"] > 1.5 * twice["requests"]  # the excess was offered, and not served
    assert twice["queued"] > 0 and twice["refused"] > 0
    assert twice["max_queued"] <= QUEUE_LIMIT
    # measured growth stops near the capacity, far below what was offered
    assert twice["max_admitted"] <= 1.5 * max(capacity, twice["capacity"]) < 160
    for point in (at_capacity, twice):  # every admitted stream keeps real time
        assert point["underrun_streams_pct"] == 0.0
        assert point["rtf_p90"] < 1.0 and point["ttfa_p90_ms"] < 200
    # no cliff: the admitted streams' audio per second holds
    assert twice["audio_s_per_s"] >= 0.95 * at_capacity["audio_s_per_s"]
    assert twice["queue_wait_p90_ms"] is not None and twice["queue_wait_p90_ms"] > 0


def test_decode_batches_past_512_rows_run(costs: Costs) -> None:
    """The batch follows the KV budget: 768 rows a step plan and finish like 512 (H200 costs)."""
    result = Simulation(
        args(seconds=3.0, warmup=1.0, slots=768, set=["initial_streams=768"]), 768, load_costs(None, None)
    ).run()
    assert result["requests"] > 0 and result["rows_per_step"] > 512
