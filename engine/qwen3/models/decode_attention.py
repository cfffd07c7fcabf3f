"""Decode attention straight from the slot cache: one query token per row, each row reading only its
own slot's first `lengths[row]` positions (a Triton kernel; no gathered copy of the cache).

Gathering every row's cache bucket (`k_cache[slots, :, :kv_len]`) before SDPA copied the whole bucket
of every row per layer; at 512 rows that copy dominated the talker step. Here each program owns one
(row, kv head) pair, streams its keys and values once in blocks with an online softmax, and serves all
query heads of its group (GQA) from that one read. Lengths are device tensors, so one CUDA graph per
batch size serves every sequence length.

Without Triton or CUDA, `available()` is False and callers keep the SDPA path.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        slots_ptr,
        lengths_ptr,
        scale,
        q_row,
        q_head,
        k_slot,
        k_head,
        k_pos,
        v_slot,
        v_head,
        v_pos,
        o_row,
        o_head,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PRECISION: tl.constexpr,
        ONE_LENGTH: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        length = lengths_ptr if ONE_LENGTH else tl.load(lengths_ptr + row)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        in_group = g < GROUP
        q = tl.load(
            q_ptr + row * q_row + heads[:, None] * q_head + d[None, :], mask=in_group[:, None], other=0.0
        )
        k_base = k_ptr + slot * k_slot + kv_head * k_head
        v_base = v_ptr + slot * v_slot + kv_head * v_head
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for start in range(0, length, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < length
            k = tl.load(k_base + pos[:, None] * k_pos + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, 1))
            p = tl.exp(s - new_best[:, None])
            alpha = tl.exp(best - new_best)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * v_pos + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        out = acc / total[:, None]
        o = out_ptr + row * o_row + heads[:, None] * o_head + d[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor | int, scale: float
) -> Tensor:
    """q [B, Hq, D]; k_cache/v_cache [slots, Hkv, max_len, D] (one layer, unit stride in D);
    slots [B]; lengths [B] (>= 1, positions 0..length-1 attended), or one length for every row
    (the code predictor's frame loop) -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    q = q.contiguous()
    assert slots.is_contiguous() and slots.numel() == b, "the kernel reads slot n at offset n"
    out = torch.empty_like(q)
    one_length = isinstance(lengths, int)
    if isinstance(lengths, Tensor) and lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32)
    _decode_kernel[(b, hkv)](
        q,
        k_cache,
        v_cache,
        out,
        slots,
        lengths,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64,
        HEAD_DIM=d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (parity runs)
        ONE_LENGTH=one_length,
    )
    return out
