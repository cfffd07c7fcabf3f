"""Code2Wav's sliding-window attention while streaming, over a ring of each slot's recent keys.

Each slot keeps its last keys and values in a ring of `ring` positions per head ([slots, heads,
ring, D]): position p lives at index p % ring. A chunk of F frames writes only its F new keys and
values; nothing already cached moves. With ring >= window - 1 + F every key that the chunk's
queries attend (the `window` positions up to each query) is still in the ring after the write.

`attend` is one Triton kernel per layer on CUDA: each program owns one (row, head), writes that
row's new keys and values into its slot's ring, then attends over the whole ring with the
positions' causal window as its mask, and writes its output in the [B, F, heads, D] layout the
output projection reads. It replaces gathering the cached window, joining it to the new keys,
SDPA and rewriting the cache, several kernels and full copies per layer.
`attend_reference` computes the same in torch ops for any F (the CPU path, and chunks longer than
the ring allows the kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.qwen3.models.kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def ring_size(window: int, max_frames: int) -> int:
    """Ring positions for chunks of up to `max_frames` frames: window - 1 cached, then the chunk,
    rounded up to a multiple of 16 (the kernel's tiles)."""
    return -(-(window - 1 + max_frames) // 16) * 16


def kernel_frames(ring: int, window: int) -> int:
    """The longest chunk whose queries' keys all survive its own write into the ring."""
    return ring - (window - 1)


def available(q: Tensor, frames: int, ring: int, window: int) -> bool:
    return (
        triton is not None
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and frames <= min(kernel_frames(ring, window), 64)
        and guard.ready(q.device)
    )


if triton is not None:

    @triton.jit
    def _window_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        k_ring_ptr,
        v_ring_ptr,
        out_ptr,
        slots_ptr,
        starts_ptr,
        frames,
        scale,
        s_row,  # q, k, v and out: [B, F, heads, D] contiguous
        s_frame,
        r_slot,  # the rings: [slots, heads, ring, D] contiguous
        r_head,
        WINDOW: tl.constexpr,
        RING: tl.constexpr,
        BLOCK_F: tl.constexpr,
        BLOCK_R: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        start = tl.load(starts_ptr + row).to(tl.int64)  # the chunk's first position
        f = tl.arange(0, BLOCK_F)
        d = tl.arange(0, HEAD_DIM)
        f_ok = f < frames
        new = row.to(tl.int64) * s_row + f[:, None] * s_frame + head * HEAD_DIM + d[None, :]
        ring = slot * r_slot + head * r_head
        # this row's new keys and values into its ring; the barrier makes them visible to the
        # program's other threads before it reads the ring back
        at = ring + ((start + f) % RING)[:, None] * HEAD_DIM + d[None, :]
        tl.store(k_ring_ptr + at, tl.load(k_ptr + new, mask=f_ok[:, None]), mask=f_ok[:, None])
        tl.store(v_ring_ptr + at, tl.load(v_ptr + new, mask=f_ok[:, None]), mask=f_ok[:, None])
        tl.debug_barrier()
        i = tl.arange(0, BLOCK_R)
        i_ok = i < RING
        last = start + frames - 1  # the newest position in the ring
        key_pos = last - ((last - i) % RING + RING) % RING  # the position index i holds
        keys = ring + i[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ring_ptr + keys, mask=i_ok[:, None], other=0.0)
        v = tl.load(v_ring_ptr + keys, mask=i_ok[:, None], other=0.0)
        q = tl.load(q_ptr + new, mask=f_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        q_pos = (start + f)[:, None]
        seen = i_ok[None, :] & (key_pos[None, :] >= 0) & (key_pos[None, :] <= q_pos)
        seen = seen & (key_pos[None, :] > q_pos - WINDOW)
        scores = tl.where(seen, scores, float("-inf"))
        top = tl.maximum(tl.max(scores, axis=1), -1e30)  # rows past the chunk may see nothing
        p = tl.exp(scores - top[:, None])
        total = tl.maximum(tl.sum(p, axis=1), 1e-30)
        out = tl.dot(p.to(v.dtype), v) / total[:, None]
        tl.store(out_ptr + new, out.to(out_ptr.dtype.element_ty), mask=f_ok[:, None])


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rings: tuple[Tensor, Tensor],
    slots: Tensor,
    starts: Tensor,
    window: int,
) -> Tensor:
    """q, k, v [B, F, heads, D] (positions starts[b] + f, RoPE applied); rings ([slots, heads, ring,
    D], keys and values) take the new ones -> the attention output [B, F, heads, D]."""
    b, frames, heads, dim = q.shape
    k_ring, v_ring = rings
    ring = k_ring.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    _window_kernel[(b, heads)](
        q,
        k,
        v,
        k_ring,
        v_ring,
        out,
        slots,
        starts,
        frames,
        dim**-0.5,
        frames * heads * dim,
        heads * dim,
        heads * ring * dim,
        ring * dim,
        WINDOW=window,
        RING=ring,
        BLOCK_F=max(16, triton.next_power_of_2(frames)),
        BLOCK_R=max(16, triton.next_power_of_2(ring)),
        HEAD_DIM=dim,
        num_warps=4,
    )
    return out


def attend_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rings: tuple[Tensor, Tensor],
    slots: Tensor,
    starts: Tensor,
    window: int,
) -> Tensor:
    """`attend` in torch ops, for any F and grouped queries (k and v with fewer heads than q): the
    cached window read in order from the ring, SDPA over it and the new keys, then the new keys
    written (the last `ring` of them, when F is longer)."""
    b, frames, heads, dim = q.shape
    k_ring, v_ring = rings
    ring = k_ring.shape[2]
    cached = starts[:, None] + torch.arange(1 - window, 0, device=q.device)  # [B, window - 1]
    where = cached.remainder(ring)
    past_k = k_ring[slots[:, None], :, where]  # [B, window - 1, heads, D]
    past_v = v_ring[slots[:, None], :, where]
    keys = torch.cat([past_k, k], dim=1).transpose(1, 2)
    values = torch.cat([past_v, v], dim=1).transpose(1, 2)
    if keys.shape[1] != heads:  # grouped queries: each kv head serves heads // kv_heads of them
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
        values = values.repeat_interleave(heads // values.shape[1], dim=1)
    q_pos = (starts[:, None] + torch.arange(frames, device=q.device))[:, None, :, None]
    k_pos = torch.cat([cached, q_pos[:, 0, :, 0]], dim=1)[:, None, None, :]
    mask = (k_pos >= 0) & (k_pos <= q_pos) & (k_pos > q_pos - window)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
    keep = min(frames, ring)
    written = (starts[:, None] + torch.arange(frames - keep, frames, device=q.device)).remainder(ring)
    k_ring[slots[:, None], :, written] = k[:, frames - keep :].to(k_ring.dtype)
    v_ring[slots[:, None], :, written] = v[:, frames - keep :].to(v_ring.dtype)
    return out.transpose(1, 2)


def _compare(device: torch.device) -> None:
    gen = torch.Generator(device="cpu").manual_seed(7)
    window, heads, dim, slots_n = 9, 2, 64, 3
    ring = ring_size(window, 4)
    rings = [torch.randn(slots_n, heads, ring, dim, generator=gen).to(torch.bfloat16) for _ in range(2)]
    slots, starts = torch.tensor([2, 0]), torch.tensor([13, 3])
    q, k, v = (torch.randn(2, 4, heads, dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    expected = attend_reference(q, k, v, tuple(r.clone() for r in rings), slots, starts, window)  # type: ignore[arg-type]
    moved = [t.to(device) for t in (q, k, v, slots, starts)]
    got = attend(*moved[:3], tuple(r.to(device) for r in rings), moved[3], moved[4], window)  # type: ignore[arg-type]
    if not torch.allclose(got.float().cpu(), expected.float(), rtol=2e-2, atol=2e-2):
        raise ValueError(
            f"differs from SDPA by {(got.float().cpu() - expected.float()).abs().max().item():.3g}"
        )


guard = KernelGuard("Code2Wav window attention", _compare, built=triton is not None)
check = guard.check
