"""RMSNorm as one Triton kernel for bf16 tensors on CUDA.

Eagerly the norm is eight kernels (cast, square, mean, add, rsqrt, multiply, cast, weight); a
decode step runs it four times per layer (input, post-attention, query and key norms), some 3 000
times per frame across the talker and the code predictor's 15 steps, where launches rather than
bytes set the time at small batches. The kernel keeps the eager rounding points: normalise in fp32,
round to bf16, multiply by the bf16 weight. fp32 (the parity runs) keeps the eager ops.
`check()` compares the two on the device before first use and turns the kernel off if they differ
(engine.qwen3.models.kernel_guard).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.qwen3.models.kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel serves this call: bf16 on CUDA, once checked on the device."""
    return x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and guard.ready(x.device)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        h = tl.load(x_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h) / dim + eps)
        normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # eager rounds here too
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] of the same dtype (bf16 in serving) -> [..., D]."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(flat)
    _rms_norm_kernel[(flat.shape[0],)](
        flat, weight.contiguous(), out, dim, eps, BLOCK=triton.next_power_of_2(dim)
    )
    return out.view(x.shape)


def eager_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _compare(device: torch.device) -> None:
    gen = torch.Generator(device="cpu").manual_seed(3)
    for rows, dim in ((37, 2048), (300, 128), (5, 1024)):
        x = (torch.randn(rows, dim, generator=gen) * 4).to(device, torch.bfloat16)
        w = (torch.rand(dim, generator=gen) + 0.5).to(device, torch.bfloat16)
        expected, got = eager_rms_norm(x, w, 1e-6).float(), rms_norm(x, w, 1e-6).float()
        # one bf16 rounding step at most (the fp32 sums may differ in their last bits)
        if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
            raise ValueError(f"differs from the eager norm by {(got - expected).abs().max().item():.3g}")


guard = KernelGuard("fused RMSNorm", _compare, built=triton is not None)
check = guard.check
