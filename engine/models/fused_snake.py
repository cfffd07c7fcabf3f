"""SnakeBeta, x + sin^2(x * e^alpha) / e^beta per channel, as one Triton kernel on CUDA.

Eagerly the activation is four full passes over the tensor (multiply, sine, square, add); at the
decoder's 24 kHz stages those passes outweigh the convolutions between them. Fused, it reads x once
and writes once. Without Triton or CUDA, `available()` is False and the caller keeps the eager ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


enabled = True  # benchmarks flip this to time the eager activation


def available(x: Tensor) -> bool:
    return enabled and triton is not None and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def _snake_kernel(x_ptr, out_ptr, alpha_ptr, inv_beta_ptr, bias_ptr, channels, length,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one (batch, channel) row of `length` samples
        channel = row % channels
        alpha = tl.load(alpha_ptr + channel)
        inv_beta = tl.load(inv_beta_ptr + channel)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < length
        base = row.to(tl.int64) * length
        x = tl.load(x_ptr + base + offs, mask=inside, other=0.0)
        if HAS_BIAS:  # the previous conv's bias, rounded to the tensor's dtype as the conv would
            x = x + tl.load(bias_ptr + channel)
        x = x.to(tl.float32)
        s = tl.sin(x * alpha)
        tl.store(out_ptr + base + offs, (x + inv_beta * s * s).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _residual_kernel(x_ptr, y_ptr, bias_ptr, out_ptr, channels, length, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < length
        base = row.to(tl.int64) * length
        y = tl.load(y_ptr + base + offs, mask=inside, other=0.0) + tl.load(bias_ptr + row % channels)
        x = tl.load(x_ptr + base + offs, mask=inside, other=0.0)
        tl.store(out_ptr + base + offs, x + y, mask=inside)


BLOCK = 1024


def snake(x: Tensor, alpha: Tensor, inv_beta: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [B, C, T]; alpha, inv_beta [C] (already exponentiated / inverted); bias [C] added to x
    first (the conv before it runs without one) -> [B, C, T]."""
    x = x.contiguous()
    b, c, t = x.shape
    out = torch.empty_like(x)
    _snake_kernel[(b * c, triton.cdiv(t, BLOCK))](
        x, out, alpha.float().contiguous(), inv_beta.float().contiguous(),
        x if bias is None else bias.to(x.dtype).contiguous(), c, t, HAS_BIAS=bias is not None, BLOCK=BLOCK
    )
    return out


def residual(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """x + (y + bias[c]) in one pass, as the eager `x + (conv(h) with its bias)`; [B, C, T] each."""
    x, y = x.contiguous(), y.contiguous()
    b, c, t = x.shape
    out = torch.empty_like(x)
    _residual_kernel[(b * c, triton.cdiv(t, BLOCK))](x, y, bias.to(x.dtype).contiguous(), out, c, t, BLOCK=BLOCK)
    return out
