"""The fused rotary embedding against the eager one (skipped without CUDA/Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models import fused_rope
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or fused_rope.triton is None:
    pytest.skip("needs CUDA and Triton", allow_module_level=True)


@pytest.mark.parametrize(("b", "t", "heads"), [(512, 1, 16), (4, 37, 8), (1, 2, 16)])
def test_fused_equals_eager_bit_for_bit(b, t, heads):
    torch.manual_seed(0)
    x = torch.randn(b, t, heads, 128, device="cuda").to(torch.bfloat16)
    positions = torch.randint(0, 512, (b, t), device="cuda")
    cos, sin = rope_cos_sin(rope_inv_freq(128, 1e6, "cuda"), positions, torch.bfloat16)
    assert fused_rope.check(torch.device("cuda")) and fused_rope.available(x)
    expected = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(fused_rope.rope(x, cos, sin), expected)
