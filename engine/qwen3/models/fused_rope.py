"""Rotary position embedding of a [B, T, heads, D] tensor as one Triton kernel (bf16, CUDA).

Eagerly x * cos + rotate_half(x) * sin is some seven kernels per tensor, twice per layer (queries
and keys), on every talker and code-predictor layer. The kernel keeps the eager rounding points
(each product rounded to the tensor's dtype, then their sum). fp32 keeps the eager ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.qwen3.models.kernel_guard import KernelGuard
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(x: Tensor) -> bool:
    """bf16 on CUDA, once checked on the device."""
    return x.is_cuda and x.dtype == torch.bfloat16 and guard.ready(x.device)


if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr):
        """v (fp32) rounded to `dtype` and back, as eager rounds each product. For bf16 with integer
        ops (nearest, ties to even): the compiler folds a plain cast pair into an FMA."""
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, HEAD_DIM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one (batch, position, head) vector
        token = row // heads
        d = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = HEAD_DIM // 2
        x = tl.load(x_ptr + row * HEAD_DIM + d).to(tl.float32)
        partner = tl.load(x_ptr + row * HEAD_DIM + (d + half) % HEAD_DIM).to(tl.float32)
        rotated = tl.where(d < half, -partner, partner)
        cos = tl.load(cos_ptr + token * HEAD_DIM + d).to(tl.float32)
        sin = tl.load(sin_ptr + token * HEAD_DIM + d).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        a = _round(x * cos, dtype)
        b = _round(rotated * sin, dtype)
        tl.store(out_ptr + row * HEAD_DIM + d, (a + b).to(dtype))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, D]; cos/sin [B, T, D] -> rotated x [B, T, heads, D] (contiguous)."""
    b, t, heads, d = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rope_kernel[(b * t * heads,)](x, cos.contiguous(), sin.contiguous(), out, heads, HEAD_DIM=d)
    return out


def _compare(device: torch.device) -> None:
    gen = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(3, 2, 16, 128, generator=gen).to(device, torch.bfloat16)
    positions = torch.randint(0, 512, (3, 2), generator=gen).to(device)
    cos, sin = rope_cos_sin(rope_inv_freq(128, 1e6, device), positions, torch.bfloat16)
    if not torch.equal(rope(x, cos, sin), apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)):
        raise ValueError("differs from the eager rotation")


guard = KernelGuard("fused rotary embedding", _compare, built=triton is not None)
check = guard.check
