"""The bounded sampler's Triton draw against the torch draw (skipped without CUDA/Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models import sampling_kernel
from engine.qwen3.models.sampler import SamplingParams, draw_kernel, sample

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or sampling_kernel.triton is None:
    pytest.skip("needs CUDA and Triton", allow_module_level=True)


def both(logits, params, seed, counter):
    draw_kernel.enabled = False
    try:
        expected = sample(logits, params, seed, counter, bounded=True)
    finally:
        draw_kernel.enabled = True
    return sample(logits, params, seed, counter, bounded=True), expected


@pytest.mark.parametrize(("top_p", "agreement"), [(1.0, 1.0), (0.8, 0.99)])
def test_kernel_draws_what_the_torch_path_draws(top_p, agreement):
    torch.manual_seed(0)
    rows = 512
    logits = torch.randn(rows, 2048, device="cuda") * 3
    top_k = torch.randint(1, 65, (rows,)).tolist()
    params = SamplingParams.build([0.9] * rows, top_k, [top_p] * rows, [False] * rows, "cuda")
    seed, counter = torch.arange(rows, device="cuda") * 7919, torch.arange(rows, device="cuda") % 11
    got, expected = both(logits, params, seed, counter)
    assert float((got == expected).float().mean()) >= agreement
    assert (got != logits.argmax(-1)).any()  # it samples


def test_masked_rows_draw_the_only_allowed_ids():
    logits = torch.full((3, 3072), float("-inf"), device="cuda")
    logits[:, 2150] = 0.0
    logits[1, 7] = 5.0
    params = SamplingParams.build([0.9] * 3, [50, 64, 1], [1.0, 0.5, 1.0], [False] * 3, "cuda")
    got, expected = both(
        logits, params, torch.arange(3, device="cuda"), torch.zeros(3, dtype=torch.long, device="cuda")
    )
    assert got.tolist() == expected.tolist()
    assert got[0] == 2150 and got[2] == 2150


def test_check_keeps_the_kernel_on():
    assert draw_kernel.check(torch.device("cuda"))
    assert draw_kernel.enabled
