"""Rotary position embedding in torch ops: the frequencies, the cos/sin of positions and the rotation.

A leaf: the decoder layers, the fused kernels' checks and the aligner all build on these, and this
module imports none of them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim] (computed in fp32, then cast).

    The talker's interleaved M-RoPE uses three identical position streams, which reduces to this."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """The last dimension's halves swapped, the new first half negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
