"""Qwen3 decoder building blocks: RMSNorm, GQA attention over a static KV cache with rotary position
embedding (engine.qwen3.models.rope), SwiGLU MLP.

Shapes are fixed per call and nothing here reads tensors back to the host, so a runner can batch
requests of different lengths and capture the steps as CUDA graphs.

KV cache layout: k, v: [layers, slots, kv_heads, max_len, head_dim]. A request owns one slot; its
token at position p lives at [:, slot, :, p]. Attention for a query at position p sees cache
positions 0..p of its own slot (stale entries beyond p are masked, so slots need no clearing).
The last cache position (max_len - 1) is a scratch cell: padded prefill entries are written there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.qwen3.models import decode_attention, fused_layer, fused_norm, fused_rope
from engine.qwen3.models.config import DecoderShape
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if fused_norm.available(x, self.weight):
            return fused_norm.rms_norm(x, self.weight, self.eps)
        return fused_norm.eager_rms_norm(x, self.weight, self.eps)


@dataclass
class KVCache:
    k: Tensor  # [layers, slots, kv_heads, max_len, head_dim]
    v: Tensor

    @classmethod
    def allocate(
        cls, shape: DecoderShape, slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        dims = (shape.num_hidden_layers, slots, shape.num_key_value_heads, max_len, shape.head_dim)
        return cls(
            torch.zeros(dims, device=device, dtype=dtype), torch.zeros(dims, device=device, dtype=dtype)
        )

    @property
    def max_len(self) -> int:
        return int(self.k.shape[3])


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads = shape.num_attention_heads
        self.num_kv_heads = shape.num_key_value_heads
        self.head_dim = d
        bias = shape.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)
        self.qkv_weight: Tensor | None = None  # q, k, v weights as one (DecoderStack.fuse_layers)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slots: Tensor | None,
        positions: Tensor,
        kv_len: int,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """x [B, T, H]; k_cache/v_cache [slots, kv_heads, max_len, D] (one layer); positions [B, T].

        slots [B]: each row's cache slot; positions 0..kv_len-1 bound what is attended (kv_len static).
        slots None: row i owns cache row i and every row's tokens sit at positions kv_len-T..kv_len-1
        (the code predictor's frame loop), so the cache is written and read as plain slices.
        lengths [B] (one token per row, CUDA): each row attends its first lengths[row] positions,
        read straight from its slot by the decode kernel (no gathered copy)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if fused_rope.available(q):
            q, k = fused_rope.rope(q, cos, sin).transpose(1, 2), fused_rope.rope(k, cos, sin).transpose(1, 2)
        else:
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if slots is None:
            out = self._attend_own_rows(q, k, v, k_cache, v_cache, kv_len)
        else:
            row = slots[:, None]
            k_cache[row, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
            v_cache[row, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
            if lengths is not None and t == 1 and decode_attention.available(x.device):
                out = decode_attention.decode_attention(
                    q[:, :, 0], k_cache, v_cache, slots, lengths, self.head_dim**-0.5
                )[:, :, None]
            else:
                out = self._attend_gathered(q, k_cache, v_cache, slots, positions, kv_len)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _attend_gathered(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor, kv_len: int
    ) -> Tensor:
        keys = k_cache[slots, :, :kv_len].to(q.dtype)
        values = v_cache[slots, :, :kv_len].to(q.dtype)
        key_pos = torch.arange(kv_len, device=q.device)
        allowed = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, kv_len]
        # grouped-query attention without materialising repeated keys and values
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=allowed,
            scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )

    def forward_fused(self, x: Tensor, step: FusedStep, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """x [N, H] (the step's tokens, row-major) -> attention output [N, H], through
        engine.qwen3.models.fused_layer (CUDA, bf16); the same attention as forward()."""
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight).split((hq * d, hkv * d, hkv * d), dim=1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = fused_layer.qkv_post(
            q,
            k,
            v,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            step.cos,
            step.sin,
            k_cache,
            v_cache,
            step.token_slots,
            step.token_positions,
        )
        b, t = step.batch, step.tokens
        if step.decode_rows is not None:  # one token a row: the decode kernel, straight from the cache
            out = decode_attention.decode_attention(
                q, k_cache, v_cache, step.decode_rows, step.decode_lengths, self.head_dim**-0.5
            )
            return self.o_proj(out.reshape(b, hq * d))
        q4 = q.view(b, t, hq, d).transpose(1, 2)
        if step.slots is None:
            out = self._attend_cached_rows(q4, k_cache, v_cache, step.kv_len)
        else:
            out = self._attend_gathered(q4, k_cache, v_cache, step.slots, step.positions, step.kv_len)
        return self.o_proj(out.transpose(1, 2).reshape(b * t, hq * d))

    def _attend_own_rows(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: int
    ) -> Tensor:
        """Rows 0..B-1 at shared positions kv_len-T..kv_len-1: slice writes, then the attention."""
        b, _, t, _ = q.shape
        k_cache[:b, :, kv_len - t : kv_len] = k.to(k_cache.dtype)
        v_cache[:b, :, kv_len - t : kv_len] = v.to(v_cache.dtype)
        return self._attend_cached_rows(q, k_cache, v_cache, kv_len)

    def _attend_cached_rows(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: int) -> Tensor:
        """Rows 0..B-1, queries at kv_len-T..kv_len-1, keys already cached: slice reads and the
        attention as two small batched matmuls (a handful of keys; SDPA's kernels cost more here)."""
        b, _, t, d = q.shape
        keys, values = k_cache[:b, :, :kv_len].to(q.dtype), v_cache[:b, :, :kv_len].to(q.dtype)
        group = self.num_heads // self.num_kv_heads
        grouped = q.reshape(b, self.num_kv_heads, group * t, d)  # query heads of one kv head together
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * self.head_dim**-0.5
        if t > 1:  # causal within the new tokens: query i sits at position kv_len - t + i
            query_pos = torch.arange(kv_len - t, kv_len, device=q.device).repeat(group)
            hidden = torch.arange(kv_len, device=q.device)[None, :] > query_pos[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(q.dtype), values)
        return out.reshape(b, self.num_heads, t, d)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_weight: Tensor | None = None  # gate and up weights as one (DecoderStack.fuse_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: Tensor) -> Tensor:
        """x [N, H] -> [N, H] through engine.qwen3.models.fused_layer (CUDA, bf16)."""
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused_layer.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slots: Tensor | None,
        positions: Tensor,
        kv_len: int,
        lengths: Tensor | None = None,
    ) -> Tensor:
        h = x + self.self_attn(
            self.input_layernorm(x), cos, sin, k_cache, v_cache, slots, positions, kv_len, lengths
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """`layers.N.*` + final `norm`; subclasses add their embeddings."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(shape.head_dim, shape.rope_theta), persistent=False)
        self.fused = False  # fuse_layers() was called: CUDA bf16 steps take the fused kernels
        self.rope_cos: Tensor | None = None  # [max positions, head_dim], built by fuse_layers()
        self.rope_sin: Tensor | None = None

    def fuse_layers(self) -> None:
        """Serve CUDA bf16 steps through engine.qwen3.models.fused_layer: each layer's q/k/v and gate/up
        projections become one product each (their weights turned into views of one tensor: same
        names, values and memory), and the pointwise work runs in three kernels. Call it once the
        weights are loaded and placed (moving the module afterwards separates the views)."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_weight = fused_layer.fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
            mlp.gate_up_weight = fused_layer.fuse_linears(mlp.gate_proj, mlp.up_proj)
        # the rotation's cos/sin of every position, computed by the same ops as rope_cos_sin (so the
        # same values): a step gathers its rows (two kernels instead of about seven)
        dtype = self.norm.weight.dtype
        every = torch.arange(self.shape.max_position_embeddings, device=self.inv_freq.device)[None]
        self.rope_cos, self.rope_sin = (t[0] for t in rope_cos_sin(self.inv_freq, every, dtype))
        self.fused = True

    def reset_rope(self, device: torch.device | str) -> None:
        """Recompute the RoPE frequencies (after building on the meta device)."""
        self.inv_freq = rope_inv_freq(self.shape.head_dim, self.shape.rope_theta, device)

    def run_layers(
        self,
        x: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: Tensor | None,
        kv_len: int,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """x [B, T, H] input embeddings -> final-normed hidden states [B, T, H] (see Attention)."""
        if self.fused and fused_layer.available(x):
            assert self.rope_cos is not None and self.rope_sin is not None
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            return self._run_fused(x, FusedStep.of(x, cos, sin, positions, slots, kv_len, lengths), cache)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], slots, positions, kv_len, lengths)
        return self.norm(x)

    def _run_fused(self, x: Tensor, step: FusedStep, cache: KVCache) -> Tensor:
        """run_layers through the fused kernels: each layer's residual add rides in the next norm."""
        b, t, hidden = x.shape
        h, delta = x.reshape(b * t, hidden), None
        for i, layer in enumerate(self.layers):
            h, normed = fused_layer.add_rms_norm(
                h, delta, layer.input_layernorm.weight, layer.input_layernorm.eps
            )
            attn = layer.self_attn.forward_fused(normed, step, cache.k[i], cache.v[i])
            h, normed = fused_layer.add_rms_norm(
                h, attn, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
            )
            delta = layer.mlp.forward_fused(normed)
        return fused_layer.add_rms_norm(h, delta, self.norm.weight, self.norm.eps)[1].view(b, t, hidden)


@dataclass
class FusedStep:
    """What every layer of one fused run_layers call shares (see Attention.forward)."""

    batch: int
    tokens: int  # per row
    cos: Tensor  # [B*T, D]
    sin: Tensor
    token_slots: Tensor  # [B*T]: each token's cache slot
    token_positions: Tensor  # [B*T]: its position there
    slots: Tensor | None
    positions: Tensor
    kv_len: int
    decode_rows: Tensor | None = None  # one token a row through the decode kernel: the rows' slots
    decode_lengths: Tensor | int = 0  # and the positions each attends

    @classmethod
    def of(
        cls,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor,
        slots: Tensor | None,
        kv_len: int,
        lengths: Tensor | None,
    ) -> FusedStep:
        b, t, _ = x.shape
        own = torch.arange(b, device=x.device) if slots is None else None
        # contiguous copies: a reshape of an expanded tensor can be a view with stride 0
        token_slots = (slots if slots is not None else own)[:, None].expand(b, t).reshape(-1).contiguous()  # type: ignore[index]
        step = cls(
            b,
            t,
            cos.reshape(b * t, -1),
            sin.reshape(b * t, -1),
            token_slots,
            positions.reshape(-1).contiguous(),
            slots,
            positions,
            kv_len,
        )
        if t == 1 and decode_attention.available(x.device):
            if slots is None:  # the code predictor's frame loop: every row sees kv_len positions
                step.decode_rows, step.decode_lengths = own, kv_len
            elif lengths is not None:
                step.decode_rows, step.decode_lengths = slots, lengths
        return step
