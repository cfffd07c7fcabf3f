"""The fused RMSNorm against the eager norm (skipped without CUDA/Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models import fused_norm
from engine.qwen3.models.layers import RMSNorm

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or fused_norm.triton is None:
    pytest.skip("needs CUDA and Triton", allow_module_level=True)


@pytest.mark.parametrize("shape", [(3, 7, 2048), (512, 1, 16, 128), (1, 1024)])
def test_fused_equals_eager_within_one_bf16_rounding(shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(shape, device="cuda") * 4).to(torch.bfloat16)
    assert fused_norm.check(torch.device("cuda")) and fused_norm.available(x, norm.weight)
    got = norm(x)
    expected = fused_norm.eager_rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert (got == expected).float().mean() > 0.99  # almost every element bit-identical


def test_fp32_keeps_the_eager_norm():
    x = torch.randn(4, 64, device="cuda")
    assert not fused_norm.available(x, torch.ones(64, device="cuda"))
