"""A decoder layer's pointwise work in three Triton kernels (bf16, CUDA).

Eagerly a Qwen3 layer launches some 20-27 kernels for one token per row: three projections, two
head norms, two rotations, two cache writes, the residual adds, the norms, SiLU and the gate
product. The code predictor runs its five layers 16 times a frame and the talker its 28 once, so at
every batch size launches, not arithmetic, set most of a step's time. Here:

- `add_rms_norm`: the residual add and the next RMSNorm in one pass (both outputs kept);
- `qkv_post`: query and key head norms, the rotary embedding of both, and the keys' and values'
  write into the KV cache at each token's (slot, position), in one pass over the projections;
- `silu_mul`: SiLU of the gate times the up projection.

With the query, key and value projections as one product and the gate and up projections as
another (`fuse_projections`), a layer is nine kernels. Each kernel keeps the eager rounding points
(every torch op rounds its result to bf16), so it agrees with the eager layer up to the order of
fp32 sums. fp32 (the parity runs) and the CPU keep the eager ops. `check()` compares the kernels
with the eager ops on the device before first use (engine.qwen3.models.kernel_guard).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.qwen3.models.fused_norm import eager_rms_norm
from engine.qwen3.models.kernel_guard import KernelGuard
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

try:
    import triton
    import triton.language as tl

    from engine.qwen3.models.fused_rope import _round
except ImportError:  # CPU-only installs
    triton = None


def available(x: Tensor) -> bool:
    """Whether the kernels serve this tensor: bf16 on CUDA, once checked on the device."""
    return x.is_cuda and x.dtype == torch.bfloat16 and guard.ready(x.device)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, d_ptr, w_ptr, h_ptr, out_ptr, dim, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        dtype = out_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_DELTA:  # the residual add, rounded as eager rounds it
            h = _round(h + tl.load(d_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32), dtype)
            tl.store(h_ptr + row * dim + cols, h.to(dtype), mask=inside)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h) / dim + eps)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + cols, (w * _round(h * rstd, dtype)).to(dtype), mask=inside)

    @triton.jit
    def _norm_rope(base, w_ptr, cos, sin, d, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
        """The head vector at `base`: RMSNorm (fp32, rounded, times the weight, rounded), then the
        rotation x * cos + rotate_half(x) * sin with each product rounded."""
        half: tl.constexpr = HEAD_DIM // 2
        x = tl.load(base + d).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x) / HEAD_DIM + eps)
        normed = _round(tl.load(w_ptr + d).to(tl.float32) * _round(x * rstd, dtype), dtype)
        other = (d + half) % HEAD_DIM  # rotate_half's partner, normed the same way
        partner = tl.load(base + other).to(tl.float32)
        partner = _round(tl.load(w_ptr + other).to(tl.float32) * _round(partner * rstd, dtype), dtype)
        rotated = tl.where(d < half, -partner, partner)
        return _round(normed * cos, dtype) + _round(rotated * sin, dtype)

    @triton.jit
    def _qkv_post_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        q_row,
        k_row,
        v_row,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_cache,
        v_cache,
        slot_ptr,
        pos_ptr,
        c_slot,
        c_head,
        c_pos,
        eps,
        Q_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)  # token
        head = tl.program_id(1)  # query heads, then key/value heads
        d = tl.arange(0, HEAD_DIM)
        dtype = q_out_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + n * HEAD_DIM + d).to(tl.float32)
        sin = tl.load(sin_ptr + n * HEAD_DIM + d).to(tl.float32)
        if head < Q_HEADS:
            out = _norm_rope(q_ptr + n * q_row + head * HEAD_DIM, qw_ptr, cos, sin, d, eps, HEAD_DIM, dtype)
            tl.store(q_out_ptr + (n * Q_HEADS + head) * HEAD_DIM + d, out.to(dtype))
        else:
            kv = head - Q_HEADS
            at = (
                tl.load(slot_ptr + n).to(tl.int64) * c_slot
                + kv * c_head
                + tl.load(pos_ptr + n).to(tl.int64) * c_pos
            )
            out = _norm_rope(k_ptr + n * k_row + kv * HEAD_DIM, kw_ptr, cos, sin, d, eps, HEAD_DIM, dtype)
            tl.store(k_cache + at + d, out.to(dtype))
            tl.store(v_cache + at + d, tl.load(v_ptr + n * v_row + kv * HEAD_DIM + d))

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, cols, g_row, u_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = c < cols
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + row * g_row + c, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * u_row + c, mask=inside, other=0.0).to(tl.float32)
        silu = _round(g / (1.0 + tl.exp(-g)), dtype)
        tl.store(out_ptr + row * cols + c, (silu * u).to(dtype), mask=inside)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [..., D] (+ delta, same shape) -> (x + delta, rms_norm(x + delta)); delta None: (x, norm(x))."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim).contiguous()
    h = torch.empty_like(flat) if delta is not None else flat
    out = torch.empty_like(flat)
    d = delta.reshape(-1, dim).contiguous() if delta is not None else flat
    _add_rms_norm_kernel[(flat.shape[0],)](
        flat, d, weight, h, out, dim, eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(dim)
    )
    return h.view(x.shape), out.view(x.shape)


def qkv_post(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    token_slots: Tensor,
    token_positions: Tensor,
) -> Tensor:
    """q [N, Hq*D], k/v [N, Hkv*D] (rows may be strided views of one qkv product); head norm
    weights [D]; cos/sin [N, D]; caches [slots, Hkv, max_len, D] (one layer); token_slots and
    token_positions [N] -> the normed, rotated queries [N, Hq, D]. The normed, rotated keys and the
    values are written into the caches at each token's (slot, position)."""
    n = q.shape[0]
    d = q_weight.shape[0]
    hq, hkv = q.shape[1] // d, k.shape[1] // d
    assert q.stride(1) == k.stride(1) == v.stride(1) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == q.dtype
    # the kernel reads entry n of these at offset n (an expanded view would send it past the end)
    assert token_slots.is_contiguous() and token_positions.is_contiguous() and token_slots.numel() == n
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (n, d)
    q_out = torch.empty(n, hq, d, device=q.device, dtype=q.dtype)
    _qkv_post_kernel[(n, hq + hkv)](
        q,
        k,
        v,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        q_weight,
        k_weight,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        token_slots,
        token_positions,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        eps,
        Q_HEADS=hq,
        HEAD_DIM=d,
    )
    return q_out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up [N, I] (rows may be strided views of one product) -> silu(gate) * up [N, I]."""
    rows, cols = gate.shape
    assert gate.stride(1) == up.stride(1) == 1
    out = torch.empty(rows, cols, device=gate.device, dtype=gate.dtype)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
        gate, up, out, cols, gate.stride(0), up.stride(0), BLOCK=block
    )
    return out


def fuse_linears(*linears: nn.Linear) -> Tensor | None:
    """One weight [sum(out), in] for several plain nn.Linear layers without biases, their own weights
    made views into it (same tensor names and values; no second copy). None when any is not a plain
    bias-free nn.Linear (an Fp8Linear, say): the caller keeps the separate products."""
    if not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return None
    fused = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _compare(device: torch.device) -> None:
    gen = torch.Generator(device="cpu").manual_seed(11)
    bf16 = torch.bfloat16

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, bf16)

    def close(got: Tensor, expected: Tensor, what: str) -> None:
        if not torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2):
            raise ValueError(
                f"{what} differs from the eager ops by {(got.float() - expected.float()).abs().max().item():.3g}"
            )

    x, delta, w = (
        rand(37, 2048, scale=4),
        rand(37, 2048),
        (torch.rand(2048, generator=gen) + 0.5).to(device, bf16),
    )
    h, normed = add_rms_norm(x, delta, w, 1e-6)
    if not torch.equal(h, x + delta):
        raise ValueError("the fused residual add differs from the eager add")
    close(normed, eager_rms_norm(x + delta, w, 1e-6), "add + RMSNorm")
    tokens, hq, hkv, d = 6, 4, 2, 128
    qkv = rand(tokens, (hq + 2 * hkv) * d, scale=3)
    q, k, v = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    qw, kw = (
        (torch.rand(d, generator=gen) + 0.5).to(device, bf16),
        (torch.rand(d, generator=gen) + 0.5).to(device, bf16),
    )
    positions = torch.randint(0, 30, (tokens,), generator=gen).to(device)
    slots = torch.randperm(tokens, generator=gen).to(device)
    cos, sin = rope_cos_sin(rope_inv_freq(d, 1e6, device), positions[:, None], bf16)
    k_cache = torch.zeros(tokens, hkv, 32, d, device=device, dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    q_out = qkv_post(q, k, v, qw, kw, 1e-6, cos[:, 0], sin[:, 0], k_cache, v_cache, slots, positions)

    def eager_head(t: Tensor, weight: Tensor, heads: int) -> Tensor:  # [tokens, heads, d]
        normed = eager_rms_norm(t.reshape(tokens, heads, d), weight, 1e-6)
        return apply_rope(normed[:, :, None], cos, sin)[:, :, 0]  # cos/sin [tokens, 1, D]

    close(q_out, eager_head(q, qw, hq), "query norm + rotation")
    close(k_cache[slots, :, positions], eager_head(k, kw, hkv), "key norm + rotation")
    if not torch.equal(v_cache[slots, :, positions], v.reshape(tokens, hkv, d)):
        raise ValueError("values written to the wrong cache cells")
    gate_up = rand(9, 2 * 3000, scale=3)
    gate, up = gate_up[:, :3000], gate_up[:, 3000:]
    close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up, "SiLU gate product")


guard = KernelGuard("fused decoder layer kernels", _compare, built=triton is not None)
check = guard.check
