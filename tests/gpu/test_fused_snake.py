"""The fused SnakeBeta kernel against the eager activation (skipped without CUDA/Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.models import fused_snake
from engine.models.codec import SnakeBeta

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or fused_snake.triton is None:
    pytest.skip("needs CUDA and Triton", allow_module_level=True)


def random_activation(seed: int) -> SnakeBeta:
    torch.manual_seed(seed)
    act = SnakeBeta(96).cuda()
    with torch.no_grad():
        act.alpha.normal_(0, 0.5)
        act.beta.normal_(0, 0.5)
    return act


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_equals_eager(dtype, tol):
    act = random_activation(seed=0)
    x = torch.randn(3, 96, 3001, device="cuda") * 3
    expected = act(x.double()).float()  # the eager ops (fp64 is not fused)
    assert not fused_snake.available(x.double())
    got = act.to(dtype)(x.to(dtype)).float()
    torch.testing.assert_close(got, expected, atol=tol * 3, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_bias_folded_into_the_activation_and_the_residual(dtype, tol):
    """A residual unit's conv biases ride in the fused kernels: same values as adding them eagerly."""
    act = random_activation(seed=1)
    x, y = torch.randn(3, 96, 2001, device="cuda") * 3, torch.randn(3, 96, 2001, device="cuda")
    bias = torch.randn(96, device="cuda")
    # the kernel rounds x + bias to the tensor's dtype, as the eager add would: so does the reference
    shifted = (x.to(dtype) + bias.to(dtype)[:, None]).double()
    expected = act(shifted).float()
    got = act.to(dtype)(x.to(dtype), bias=bias.to(dtype)).float()
    torch.testing.assert_close(got, expected, atol=tol * 3, rtol=tol)
    wide = torch.randn(3, 96, 2600, device="cuda")[..., 300:2301]  # a sliced (non-contiguous) input
    for first in (x, wide):
        got = fused_snake.residual(first.to(dtype), y.to(dtype), bias.to(dtype)).float()
        torch.testing.assert_close(got, (first + (y + bias[:, None])).float(), atol=tol * 3, rtol=tol)
