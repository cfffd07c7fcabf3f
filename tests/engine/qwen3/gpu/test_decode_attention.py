"""The decode-attention kernel against SDPA over the gathered cache (skipped without CUDA/Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models import decode_attention
from tests.kernel_references import decode_attention_reference as reference

pytestmark = pytest.mark.gpu
if not decode_attention.available(torch.device("cuda")) or not torch.cuda.is_available():
    pytest.skip("needs CUDA and Triton", allow_module_level=True)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 8, 128), (4, 2, 16)])
def test_kernel_matches_sdpa_on_each_rows_own_slot_and_length(dtype, tol, heads, kv_heads, dim):
    torch.manual_seed(0)
    slots_total, max_len = 9, 300
    k_cache = torch.randn(slots_total, kv_heads, max_len, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn(slots_total, kv_heads, max_len, dim, device="cuda", dtype=dtype)
    slots = torch.tensor([4, 0, 8, 2, 7], device="cuda")
    lengths = torch.tensor([1, 63, 64, 65, 300], device="cuda")
    q = torch.randn(5, heads, dim, device="cuda", dtype=dtype)
    out = decode_attention.decode_attention(q, k_cache, v_cache, slots, lengths, dim**-0.5)
    torch.testing.assert_close(
        out.float(), reference(q, k_cache, v_cache, slots, lengths), atol=tol, rtol=tol
    )


def test_kernel_ignores_positions_beyond_the_length():
    torch.manual_seed(1)
    k_cache = torch.randn(2, 8, 128, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16)
    slots, lengths = torch.tensor([1], device="cuda"), torch.tensor([70], device="cuda")
    before = decode_attention.decode_attention(q, k_cache, v_cache, slots, lengths, 128**-0.5)
    k_cache[1, :, 70:] = 1e4  # stale entries past the row's length
    v_cache[1, :, 70:] = float("nan")
    after = decode_attention.decode_attention(q, k_cache, v_cache, slots, lengths, 128**-0.5)
    assert torch.equal(before, after)
