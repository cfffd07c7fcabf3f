"""The runner turns Code2Wav's samples into int16 PCM on the device: the same integers as
engine.api.pcm16 gives the host for the same samples, ties and the full-scale ends included."""

from __future__ import annotations

import numpy as np
import torch

from engine.api import PCM16_FULL_SCALE, pcm16
from engine.qwen3.runner import _pcm16


def test_device_pcm_equals_the_hosts_pcm16() -> None:
    gen = torch.Generator().manual_seed(0)
    ties = (torch.arange(-40, 40, dtype=torch.float32) + 0.5) / PCM16_FULL_SCALE  # halfway between steps
    samples = torch.cat([torch.rand(20_000, generator=gen) * 2 - 1, ties, torch.tensor([-1.0, 1.0, 0.0])])
    for dtype in (torch.float32, torch.bfloat16):
        wav = samples.to(dtype)
        got = _pcm16(wav)
        assert got.dtype == torch.int16
        np.testing.assert_array_equal(got.numpy(), pcm16(wav.float().numpy()))
    assert _pcm16(torch.tensor([1.0, -1.0])).tolist() == [32767, -32767]
