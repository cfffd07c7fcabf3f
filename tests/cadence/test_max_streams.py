"""`--max-streams`: `auto` by default, a number as an upper bound, and passed to every engine; `--kv-memory`,
the GPU memory whose talker slots `auto` takes."""

from __future__ import annotations

import pytest

from cadence.cli import _serve_parser
from cadence.engines import EngineOptions, build_engine


def test_max_streams_is_auto_by_default_and_a_number_bounds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CADENCE_MAX_STREAMS", raising=False)
    assert _serve_parser().parse_args([]).max_streams is None
    assert _serve_parser().parse_args(["--max-streams", "48"]).max_streams == 48
    monkeypatch.setenv("CADENCE_MAX_STREAMS", "12")
    assert _serve_parser().parse_args([]).max_streams == 12
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            _serve_parser().parse_args(["--max-streams", bad])


def test_every_cpu_engine_gets_the_bound() -> None:
    null = build_engine(EngineOptions(name="null", max_streams=3))
    assert null.load().capacity == 3  # type: ignore[attr-defined]
    espeak = build_engine(EngineOptions(name="espeak", max_streams=5))
    assert espeak.max_streams == 5  # type: ignore[attr-defined]


async def test_auto_is_what_the_espeak_worker_keeps_in_real_time_alone() -> None:
    engine = build_engine(EngineOptions(name="espeak"))
    await engine.start()
    try:
        figures = engine.load().admission
        assert figures is not None
        assert figures.max_streams == engine.cost.auto_max_streams() > 1  # type: ignore[attr-defined]
        assert 1 <= figures.capacity <= figures.max_streams
    finally:
        await engine.stop()


def test_kv_memory_is_a_share_of_the_gpu_below_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CADENCE_KV_MEMORY", raising=False)
    assert _serve_parser().parse_args([]).kv_memory == 0.4
    assert _serve_parser().parse_args(["--kv-memory", "0.5"]).kv_memory == 0.5
    monkeypatch.setenv("CADENCE_KV_MEMORY", "0.3")
    assert _serve_parser().parse_args([]).kv_memory == 0.3
    for bad in ("0", "1", "-0.2", "half"):
        with pytest.raises(SystemExit):
            _serve_parser().parse_args(["--kv-memory", bad])
