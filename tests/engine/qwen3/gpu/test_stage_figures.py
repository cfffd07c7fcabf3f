"""Stage figures on the GPU: the time between two stages' launches shows as GPU gaps (skipped
without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from engine.qwen3.stage_figures import StageFigures

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _stage(fig: StageFigures, name: str, x: torch.Tensor) -> None:
    t = fig.start()
    for _ in range(4):
        x = x @ x
    fig.stop(name, t)


def test_host_time_between_stages_is_a_gpu_gap_and_busy_launches_are_not():
    x = torch.randn(256, 256, device="cuda") / 16
    idle, busy = StageFigures(cuda=True), StageFigures(cuda=True)
    _stage(idle, "decode", x)
    torch.cuda.synchronize()
    time.sleep(0.02)  # the host plans while the GPU has nothing queued
    _stage(idle, "sample", x)
    torch.cuda.synchronize()
    idle.finish_step()
    torch.cuda._sleep(50_000_000)  # the GPU is busy well past the next launch
    _stage(busy, "decode", x)
    _stage(busy, "sample", x)
    torch.cuda.synchronize()
    busy.finish_step()
    assert idle.snapshot()["step_ms_gpu_gaps"] >= 15
    assert busy.snapshot()["step_ms_gpu_gaps"] < 1


def test_spans_inside_a_stage_count_the_gpu_work_not_the_host_time_between_them():
    x = torch.randn(256, 256, device="cuda") / 16
    fig = StageFigures(cuda=True)
    t = fig.start()
    for _ in range(2):
        time.sleep(0.01)  # the host prepares the next launch while the GPU waits
        m = fig.mark()
        y = x @ x
        fig.span("codec_replays", m)
    fig.stop("codec", t)
    torch.cuda.synchronize()
    fig.finish_step()
    figures = fig.snapshot()
    assert y.shape == x.shape
    assert figures["step_ms_codec"] >= 15  # the stage spans the host's preparation
    assert figures["step_ms_codec_replays"] < 5
