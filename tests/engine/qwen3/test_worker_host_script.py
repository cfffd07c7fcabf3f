"""The host-path bench (bench/worker_host.py) runs the real step loop and worker process
with the GPU's share slept: a short run delivers audio at a step cadence no faster than that sleep,
and reports how long chunks take from the step thread to the consuming process."""

from __future__ import annotations

import argparse

import pytest

from bench.worker_host import level

pytestmark = pytest.mark.timeout(60)


async def test_a_short_run_reports_cadence_host_time_and_cpu() -> None:
    args = argparse.Namespace(
        gpu_ms=10.0, frames=20, seconds=1.0, warmup=0.5, switch_interval_ms=None, beside_ms="", aligned=None
    )
    row = await level(8, args)
    assert row["streams"] == 8 and row["ideal_steps_per_s"] == 100.0
    assert 10.0 <= row["step_interval_ms"] < 60.0  # never faster than the slept GPU share
    assert 0 < row["host_ms_per_step"] < row["step_interval_ms"]
    assert row["worker_cpu_pct"] > 0
    # every stream is served: a frame (80 ms) per stream and step, allowing for the steps between
    # one request and the next (one stream alone would give an eighth of this)
    assert row["audio_s_per_s"] >= 0.5 * 8 * row["steps_per_s"] * 0.08
    # hand-off latency: the step thread's put -> this process's consumer, every chunk and first chunks
    assert row["first_chunks"] > 0
    for name in ("handoff", "first_handoff"):
        assert 0 < row[f"{name}_p50_ms"] <= row[f"{name}_p90_ms"] <= row[f"{name}_p99_ms"] < 1000
    assert 10.0 <= row["step_interval_p50_ms"] <= row["step_interval_p90_ms"]


async def test_a_thread_beside_the_step_thread_is_reported_and_the_streams_are_still_served() -> None:
    args = argparse.Namespace(
        gpu_ms=10.0, frames=20, seconds=1.0, warmup=0.5, switch_interval_ms=0.5, beside_ms="4,4", aligned=None
    )
    row = await level(8, args)
    assert row["beside_ms"] == "4,4" and row["switch_interval_ms"] == 0.5
    assert row["audio_s_per_s"] > 0 and row["step_interval_ms"] >= 10.0
    # the thread holds the GIL half the time: the worker burns CPU beyond its step thread's
    assert row["worker_cpu_pct"] > 20


async def test_behind_the_aligner_stage_every_request_is_aligned_and_served() -> None:
    args = argparse.Namespace(
        gpu_ms=10.0,
        frames=20,
        seconds=1.0,
        warmup=0.5,
        switch_interval_ms=None,
        beside_ms="",
        aligned="async",
        aligner_host_ms=1.0,
        aligner_gpu_ms="2,0.1",
    )
    row = await level(8, args)
    assert row["aligned"] == "async" and row["audio_s_per_s"] > 0
    # the real aligner stage admitted the streams and aligned their utterances
    assert row["aligner_streams"] >= 1 and row["aligner_jobs"] >= 1
    assert row["first_chunks"] > 0 and row["handoff_p50_ms"] > 0
