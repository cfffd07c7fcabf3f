"""Eager references the Triton kernels are compared with, shared by the GPU tests (tests/engine/qwen3/gpu) and
the interpreter checks on the CPU (tests/engine/qwen3/kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """SDPA over each row's own slot and its first lengths[row] positions, in fp32 -> [B, Hq, D]."""
    out = []
    for row in range(q.shape[0]):
        s, n = int(slots[row]), int(lengths[row])
        keys, values = k_cache[s : s + 1, :, :n].float(), v_cache[s : s + 1, :, :n].float()
        out.append(
            F.scaled_dot_product_attention(q[row : row + 1, :, None].float(), keys, values, enable_gqa=True)[
                0, :, 0
            ]
        )
    return torch.stack(out)
