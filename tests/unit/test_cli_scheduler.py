"""`cadence serve --scheduler FIELD=JSON`: parsed from flags and the environment, checked at start-up."""

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
