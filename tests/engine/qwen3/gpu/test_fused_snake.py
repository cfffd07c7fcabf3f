"""The fused SnakeBeta kernel against the eager activation (skipped without CUDA/Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models import fused_snake
from engine.qwen3.models.codec import SnakeBeta

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
    x = torch.randn(3, 3001, 96, device="cuda") * 3  # [batch, time, channels]
    expected = act(x.double()).float()  # the eager ops (fp64 is not fused)
    assert not fused_snake.available(x.double())
    got = act.to(dtype)(x.to(dtype)).float()
    torch.testing.assert_close(got, expected, atol=tol * 3, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_bias_folded_into_the_activation_and_the_residual(dtype, tol):
    """A residual unit's conv biases ride in the fused kernels: same values as adding them eagerly."""
    act = random_activation(seed=1)
    x, y = torch.randn(3, 2001, 96, device="cuda") * 3, torch.randn(3, 2001, 96, device="cuda")
    bias = torch.randn(96, device="cuda")
    # the kernel rounds x + bias to the tensor's dtype, as the eager add would: so does the reference
    shifted = (x.to(dtype) + bias.to(dtype)).double()
    expected = act(shifted).float()
    got = act.to(dtype)(x.to(dtype), bias=bias.to(dtype)).float()
    torch.testing.assert_close(got, expected, atol=tol * 3, rtol=tol)
    wide = torch.randn(3, 2001, 130, device="cuda")[..., 20:116]  # a sliced (non-contiguous) input
    for first in (x, wide):
        got = fused_snake.residual(first.to(dtype), y.to(dtype), bias.to(dtype)).float()
        torch.testing.assert_close(got, (first + (y + bias)).float(), atol=tol * 3, rtol=tol)


@pytest.mark.parametrize("shape", [(64, 10, 1536), (64, 1926, 96), (1, 3, 768), (5, 1, 7)])
def test_fused_equals_eager_at_the_decoders_shapes(shape):
    """[batch, time, channels] as at one frame: few samples and many channels early, the reverse late."""
    torch.manual_seed(2)
    act = SnakeBeta(shape[-1]).cuda()
    with torch.no_grad():
        act.alpha.normal_(0, 0.5)
        act.beta.normal_(0, 0.5)
    x, bias = torch.randn(*shape, device="cuda") * 3, torch.randn(shape[-1], device="cuda")
    expected = act((x + bias).double()).float()
    torch.testing.assert_close(act(x, bias=bias), expected, atol=3e-5, rtol=1e-5)
    y = torch.randn(*shape, device="cuda")
    torch.testing.assert_close(fused_snake.residual(x, y, bias), x + (y + bias), atol=1e-6, rtol=1e-6)


def test_derived_parameters_follow_the_weights():
    """e^alpha and 1 / e^beta are kept between calls, and computed again when the weights change."""
    act = random_activation(seed=3)
    x = torch.randn(2, 50, 96, device="cuda")
    before = act(x)
    with torch.no_grad():
        act.alpha.add_(0.3)
    after = act(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, act(x.double()).float(), atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(act.to(torch.bfloat16)(x.bfloat16()).float(), after, atol=0.1, rtol=3e-2)
