"""The load simulation (scripts/sim_engine.py) drives the real scheduler with a GPU cost model: a
short run reports the benchmark's figures, and merging small Code2Wav groups means fewer launches."""

from __future__ import annotations

import argparse

from scripts.sim_engine import Costs, Simulation, codec_launches, load_costs


def args(merge_below: int | None) -> argparse.Namespace:
    return argparse.Namespace(seconds=4.0, warmup=1.0, host_ms=5.0, prompt=1, buffer_ms=150.0,
                              merge_below=merge_below, codec_scale=1.06, ramp_s=0.5, smooth=None,
                              delivery_base_ms=0.0, delivery_jitter_ms=0.0, gateway_us_per_packet=0.0, set=None)


def test_launches_follow_the_runners_grouping() -> None:
    # 70 one-frame chunks: a 64-row slice and a 6-row one padded to 8; two 4-frame chunks: bucket 2
    assert sorted(codec_launches([(1, 0)] * 70 + [(4, 0)] * 2)) == [(2, 4), (8, 1), (64, 1)]


def test_the_cost_model_interpolates_rows_and_frames() -> None:
    costs = load_costs(None, None)
    assert isinstance(costs, Costs)
    assert costs.codec_ms(64, 4) == 11.523 and costs.codec_ms(1, 1) == 2.411  # h200-codec-shapes.json
    assert costs.codec_ms(48, 4) == (costs.codec_ms(32, 4) + costs.codec_ms(64, 4)) / 2
    assert costs.codec_ms(1, 4) < costs.codec_ms(32, 4) < costs.codec_ms(64, 4)
    assert costs.codec_ms(64, 4) < costs.codec_ms(64, 8) < costs.codec_ms(64, 25)


def test_a_short_run_reports_the_benchmarks_figures_and_merging_saves_launches() -> None:
    costs = load_costs(None, None)
    merged = Simulation(args(None), 256, costs).run()
    apart = Simulation(args(0), 256, costs).run()
    for r in (merged, apart):
        assert r["streams"] == 256 and r["requests"] > 100
        assert 0 < r["rtf_p50"] <= r["rtf_p90"] < 2 and 0 <= r["underrun_streams_pct"] <= 100
        assert r["step_ms"] > r["gpu_ms_sample"] + r["gpu_ms_decode"]
    assert merged["codec_launches_per_step"] < apart["codec_launches_per_step"]


def test_scheduler_fields_are_set_from_the_command_line() -> None:
    import pytest

    costs = load_costs(None, None)
    a = args(None)
    a.set = ["max_early_codec_rows=7", "urgent_codec_chunks=true"]
    config = Simulation(a, 8, costs).sched.config
    assert config.max_early_codec_rows == 7 and config.urgent_codec_chunks is True
    a.set = ["no_such_field=1"]
    with pytest.raises(SystemExit, match="no_such_field"):
        Simulation(a, 8, costs)
