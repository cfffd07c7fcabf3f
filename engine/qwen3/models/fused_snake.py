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


if triton is not None:
    # Flat over the tensor's elements, channels last: the channel of an element is its index
    # modulo the channel count.

    @triton.jit
    def _snake_kernel(
        x_ptr,
        out_ptr,
        alpha_ptr,
        inv_beta_ptr,
        bias_ptr,
        numel,
        channels,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        channel = offs % channels
        alpha = tl.load(alpha_ptr + channel, mask=inside, other=0.0)
        inv_beta = tl.load(inv_beta_ptr + channel, mask=inside, other=0.0)
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        if HAS_BIAS:  # the previous conv's bias, rounded to the tensor's dtype as the conv would
            x = x + tl.load(bias_ptr + channel, mask=inside, other=0.0)
        x = x.to(tl.float32)
        s = tl.sin(x * alpha)
        tl.store(out_ptr + offs, (x + inv_beta * s * s).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _residual_kernel(x_ptr, y_ptr, bias_ptr, out_ptr, numel, channels, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        channel = offs % channels
        y = tl.load(y_ptr + offs, mask=inside, other=0.0) + tl.load(
            bias_ptr + channel, mask=inside, other=0.0
        )
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        tl.store(out_ptr + offs, x + y, mask=inside)


BLOCK = 1024
MAX_NUMEL = 2**31 - BLOCK  # 32-bit element offsets in the kernels


def available(x: Tensor) -> bool:
    return (
        triton is not None
        and x.is_cuda
        and x.numel() <= MAX_NUMEL
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def snake(x: Tensor, alpha: Tensor, inv_beta: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., C]; alpha, inv_beta [C] fp32 (already exponentiated / inverted); bias [C] added to x
    first (the conv before it runs without one) -> like x."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    _snake_kernel[(triton.cdiv(n, BLOCK),)](
        x,
        out,
        alpha,
        inv_beta,
        x if bias is None else bias.to(x.dtype).contiguous(),
        n,
        x.shape[-1],
        HAS_BIAS=bias is not None,
        BLOCK=BLOCK,
    )
    return out


def residual(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """x + (y + bias) in one pass, as the eager `x + (conv(h) with its bias)`; [..., C] each."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    _residual_kernel[(triton.cdiv(n, BLOCK),)](
        x, y, bias.to(x.dtype).contiguous(), out, n, x.shape[-1], BLOCK=BLOCK
    )
    return out
