"""The load simulation (bench/sim_engine.py) drives the real scheduler with a GPU cost model: a
short run reports the benchmark's figures, and merging small Code2Wav groups means fewer launches."""

from __future__ import annotations

import argparse

from bench.sim_engine import PRESETS, Costs, Simulation, codec_launches, load_costs


def args(merge_below: int | None, seed: int = 0) -> argparse.Namespace:
    return argparse.Namespace(
        seconds=4.0,
        warmup=1.0,
        prompt=1,
        buffer_ms=150.0,
        seed=seed,
        merge_below=merge_below,
        codec_scale=1.06,
        ramp_s=0.5,
        smooth=None,
        delivery_base_ms=0.0,
        delivery_jitter_ms=0.0,
        gateway_us_per_packet=0.0,
        set=None,
    )


def test_launches_follow_the_runners_grouping() -> None:
    # 70 one-frame chunks: a 64-row slice and a 6-row one padded to 8; two 4-frame chunks: bucket 2
    assert sorted(codec_launches([(1, 0)] * 70 + [(4, 0)] * 2)) == [(2, 4), (8, 1), (64, 1)]


def test_the_cost_model_interpolates_rows_and_frames() -> None:
    current = load_costs(None, None)
    assert current.codec_ms(64, 4) == 6.698 and current.launch_ms(64, 4) == 6.698  # h100-codec.json
    assert current.codec_ms(32, 4) == current.codec_ms(16, 4) + (6.698 - 2.508) * 16 / 48
    costs = load_costs(None, None, "h200-fused-layers")
    assert isinstance(costs, Costs)
    assert costs.codec_ms(64, 4) == 11.523 and costs.codec_ms(1, 1) == 2.411  # h200-codec-shapes.json
    assert costs.codec_ms(48, 4) == (costs.codec_ms(32, 4) + costs.codec_ms(64, 4)) / 2
    assert costs.codec_ms(1, 4) < costs.codec_ms(32, 4) < costs.codec_ms(64, 4)
    assert costs.codec_ms(64, 4) < costs.codec_ms(64, 8) < costs.codec_ms(64, 25)


def test_a_short_run_reports_the_benchmarks_figures_and_merging_saves_launches() -> None:
    costs = load_costs(None, None)
    growing = [args(None), args(0)]
    for a in growing:  # chunks through every size: groups small enough to merge
        a.schedule = "1,2,25"
    merged = Simulation(growing[0], 256, costs).run()
    apart = Simulation(growing[1], 256, costs).run()
    for r in (merged, apart):
        assert r["streams"] == 256 and r["requests"] > 100
        assert 0 < r["rtf_p50"] <= r["rtf_p90"] < 2 and 0 <= r["underrun_streams_pct"] <= 100
        assert r["step_ms"] > r["gpu_ms_sample"] + r["gpu_ms_decode"]
        assert 200 < r["rows_per_step"] <= 256  # measured after the warm-up: nearly every stream samples
    assert merged["codec_launches_per_step"] < apart["codec_launches_per_step"]


def test_scheduler_fields_are_set_from_the_command_line() -> None:
    import pytest

    costs = load_costs(None, None)
    a = args(None)
    a.set = ["max_early_codec_rows=7", "preempt_bulk=false"]
    config = Simulation(a, 8, costs).sched.config
    assert config.max_early_codec_rows == 7 and config.preempt_bulk is False
    a.set = ["no_such_field=1"]
    with pytest.raises(SystemExit, match="no_such_field"):
        Simulation(a, 8, costs)


def test_presets_keep_the_older_calibration_and_the_host_term_grows_past_the_overlapped_rows() -> None:
    fused, eager = load_costs(None, None, "h200-fused-layers"), load_costs(None, None, "h200-eager-layers")
    assert set(PRESETS) == {"current", "h200-batched-prompts", "h200-fused-layers", "h200-eager-layers"}
    assert eager.decode == (1.0, 0.0125) and eager.sample == (6.7, 0.0167)
    assert eager.host_step_ms(1) == eager.host_step_ms(512) == 5.0
    assert fused.decode[1] < eager.decode[1] and fused.sample[0] < eager.sample[0]
    assert fused.codec == eager.codec
    at = fused.host_rows_overlapped
    assert fused.host_step_ms(at) == fused.host_ms
    assert fused.host_step_ms(at + 100) == fused.host_ms + 0.1 * fused.host_us_per_row


def test_a_costs_file_may_carry_the_host_term(tmp_path) -> None:
    import json

    table = {"1": {"1": 2.0}, "64": {"1": 5.0}}
    path = tmp_path / "costs.json"
    path.write_text(
        json.dumps(
            {
                "decode": [1, 0.01],
                "sample": [4, 0.01],
                "prefill_per_chunk": 1.0,
                "codec": table,
                "host_ms": 3.0,
                "host_us_per_row": 0.0,
            }
        )
    )
    costs = load_costs(path)
    assert costs.codec_ms(1, 1) == 2.0 and costs.host_step_ms(500) == 3.0


def test_the_seed_changes_the_run() -> None:
    costs = load_costs(None, None)
    a, b = Simulation(args(None, 0), 64, costs).run(), Simulation(args(None, 1), 64, costs).run()
    assert a != b


def test_the_default_preset_has_no_host_term_and_codec_scaled_to_the_later_bench() -> None:
    batched, fused = load_costs(None, None), load_costs(None, None, "h200-fused-layers")
    assert batched.host_step_ms(1) == batched.host_step_ms(512) == 0.0
    assert batched.decode[1] < fused.decode[1]
    # the fused-transformer Code2Wav bench measured every shape faster than the older table
    assert all(batched.launch_ms(64, f) < fused.launch_ms(64, f) for f in (1, 4, 25))
