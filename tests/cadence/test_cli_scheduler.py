"""`cadence serve` engine flags: `--scheduler FIELD=JSON` (flags and the environment, checked at start-up), the first-chunk lane and the fused layers."""

from __future__ import annotations

import pytest

from cadence.cli import _serve_parser, serve_main


def test_scheduler_settings_come_from_the_environment_then_the_flags(monkeypatch):
    monkeypatch.setenv("CADENCE_SCHEDULER", "urgent_codec_chunks=false max_early_codec_rows=96")
    args = _serve_parser().parse_args(["--scheduler", "max_early_codec_rows=64"])
    assert args.scheduler == [
        "urgent_codec_chunks=false",
        "max_early_codec_rows=96",
        "max_early_codec_rows=64",
    ]


@pytest.mark.parametrize("bad", ["no_such_field=1", "max_early_codec_rows=many"])
def test_a_bad_scheduler_setting_stops_serve_before_any_engine_is_built(bad, monkeypatch):
    monkeypatch.delenv("CADENCE_SCHEDULER", raising=False)
    with pytest.raises(SystemExit, match="--scheduler: scheduler option"):
        serve_main(["--engine", "espeak", "--scheduler", bad])


@pytest.mark.parametrize(
    ("field", "flag", "variable"),
    [
        ("first_chunk_lane", "--no-first-chunk-lane", "CADENCE_FIRST_CHUNK_LANE"),
        ("fused_layers", "--no-fused-layers", "CADENCE_FUSED_LAYERS"),
    ],
)
def test_a_default_on_engine_feature_is_off_by_its_flag_or_the_environment(
    field, flag, variable, monkeypatch
):
    monkeypatch.delenv(variable, raising=False)
    assert getattr(_serve_parser().parse_args([]), field) is True
    assert getattr(_serve_parser().parse_args([flag]), field) is False
    monkeypatch.setenv(variable, "0")
    assert getattr(_serve_parser().parse_args([]), field) is False
