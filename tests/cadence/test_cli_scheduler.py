"""`cadence serve` engine flags: `--scheduler FIELD=JSON` (flags and the environment, checked at
start-up, given to the one SchedulerConfig the engine keeps) and the fused layers' fallback."""

from __future__ import annotations

import pytest

from cadence.cli import _serve_parser, serve_main


def test_scheduler_settings_come_from_the_environment_then_the_flags(monkeypatch):
    monkeypatch.setenv("CADENCE_SCHEDULER", "preempt_bulk=false max_early_codec_rows=96")
    args = _serve_parser().parse_args(["--scheduler", "max_early_codec_rows=64"])
    assert args.scheduler == [
        "preempt_bulk=false",
        "max_early_codec_rows=96",
        "max_early_codec_rows=64",
    ]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("no_such_field=1", "FIELD one of .*max_early_codec_rows.*safety_margin_s"),
        ("max_early_codec_rows=many", "not a JSON value"),
        ("max_early_codec_rows=1.5", "expected int"),
        ("codec_delivery_steps=2", "FIELD one of"),  # the runner's, not a setting
    ],
)
def test_a_bad_scheduler_setting_stops_serve_before_any_engine_is_built(bad, says, monkeypatch):
    monkeypatch.delenv("CADENCE_SCHEDULER", raising=False)
    with pytest.raises(SystemExit, match=f"--scheduler: scheduler option.*{says}"):
        serve_main(["--engine", "espeak", "--scheduler", bad])


def test_the_fused_layers_are_off_by_their_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("CADENCE_FUSED_LAYERS", raising=False)
    assert _serve_parser().parse_args([]).fused_layers is True
    assert _serve_parser().parse_args(["--no-fused-layers"]).fused_layers is False
    monkeypatch.setenv("CADENCE_FUSED_LAYERS", "0")
    assert _serve_parser().parse_args([]).fused_layers is False


@pytest.mark.parametrize("gone", ["--codec-overlap", "--no-first-chunk-lane"])
def test_the_switches_that_lost_are_gone(gone, capsys):
    with pytest.raises(SystemExit):
        _serve_parser().parse_args([gone])
    assert "unrecognized arguments" in capsys.readouterr().err
