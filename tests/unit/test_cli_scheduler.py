"""`cadence serve` engine flags: `--scheduler FIELD=JSON` (flags and the environment, checked at start-up), the first-chunk lane and the fused layers."""

from __future__ import annotations

import pytest

from cadence.cli import _serve_parser, serve_main


def test_scheduler_settings_come_from_the_environment_then_the_flags(monkeypatch):
    monkeypatch.setenv("CADENCE_SCHEDULER", "urgent_codec_chunks=false max_early_codec_rows=96")
    args = _serve_parser().parse_args(["--scheduler", "max_early_codec_rows=64"])
    assert args.scheduler == ["urgent_codec_chunks=false", "max_early_codec_rows=96", "max_early_codec_rows=64"]


@pytest.mark.parametrize("bad", ["no_such_field=1", "max_early_codec_rows=many"])
def test_a_bad_scheduler_setting_stops_serve_before_any_engine_is_built(bad, monkeypatch):
    monkeypatch.delenv("CADENCE_SCHEDULER", raising=False)
    with pytest.raises(SystemExit, match="--scheduler: scheduler option"):
        serve_main(["--engine", "espeak", "--scheduler", bad])


def test_the_first_chunk_lane_is_on_unless_a_flag_or_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv("CADENCE_FIRST_CHUNK_LANE", raising=False)
    assert _serve_parser().parse_args([]).first_chunk_lane is True
    assert _serve_parser().parse_args(["--no-first-chunk-lane"]).first_chunk_lane is False
    monkeypatch.setenv("CADENCE_FIRST_CHUNK_LANE", "0")
    assert _serve_parser().parse_args([]).first_chunk_lane is False


def test_the_fused_layers_are_on_unless_a_flag_or_the_environment_turns_them_off(monkeypatch):
    monkeypatch.delenv("CADENCE_FUSED_LAYERS", raising=False)
    assert _serve_parser().parse_args([]).fused_layers is True
    assert _serve_parser().parse_args(["--no-fused-layers"]).fused_layers is False
    monkeypatch.setenv("CADENCE_FUSED_LAYERS", "0")
    assert _serve_parser().parse_args([]).fused_layers is False
