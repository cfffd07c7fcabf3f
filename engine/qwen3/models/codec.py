"""Code2Wav: the 12 Hz speech tokenizer's decoder (16 codebooks per 80 ms frame -> 24 kHz audio).

Weight-compatible with the checkpoint's `speech_tokenizer/model.safetensors` `decoder.*` tensors
(prefix stripped). Two ways to run it:

- `decode(codes)`: offline, whole sequences at once.
- `init_streams(max_slots)` then `decode_step(slots, codes)`: batched incremental decoding. Every
  layer is causal with a bounded left context, so each slot keeps only that context (causal-conv
  input histories, the transposed convs' previous input, a ring of each attention layer's recent
  keys and values, and its frame position) in pooled tensors indexed by slot.
  A chunk never re-decodes old frames, and the output equals `decode` of the whole sequence for
  any chunk schedule. Per step: fixed shapes per (batch, frames), no host syncs, in-place state
  updates, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.qwen3.models import fused_conv, fused_rope, fused_snake, window_attention
from engine.qwen3.models.layers import RMSNorm
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

# the longest chunk the streaming attention's kernel takes (the engine's largest chunk); longer
# ones take its torch path
RING_FRAMES = 25


@dataclass(frozen=True)
class Code2WavConfig:
    """The `decoder_config` of speech_tokenizer/config.json (defaults as upstream)."""

    codebook_dim: int
    codebook_size: int = 2048
    hidden_size: int = 1024
    latent_dim: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Code2WavConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in cfg.items() if k in known}
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in values:
                values[key] = tuple(values[key])
        if "codebook_dim" not in values:
            raise ValueError("speech tokenizer decoder_config needs codebook_dim")
        return cls(**values)

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)


# ----------------------------------------------------------------------------------------------
# Causal convolutions over [batch, time, channels] activations (channels last in memory: the fused
# kernel of engine.qwen3.models.fused_conv and cuDNN's tensor-core kernels take that layout, so no
# convolution converts its input or output). Offline: pad on the left. Streaming: the left context
# comes from a per-slot history pool (`state`, [slots, history, channels]) that each call reads and
# refreshes.
# ----------------------------------------------------------------------------------------------


def channels_last_weight(weight: Tensor) -> None:
    """Lay a [out, in, kernel] conv weight out kernel-major, channels innermost (shape and values
    unchanged, so state dicts and loading are as before): `_conv` then passes it on unconverted."""
    if not weight.permute(0, 2, 1).is_contiguous():
        weight.data = weight.data.permute(0, 2, 1).contiguous().permute(0, 2, 1)


def _conv(x: Tensor, conv: nn.Conv1d | nn.ConvTranspose1d, bias: Tensor | None) -> Tensor:
    """conv over x [B, T, C] -> [B, T', C_out], as a 2-D convolution of height 1 in channels-last."""
    x4, w4 = x.transpose(1, 2).unsqueeze(2), conv.weight.unsqueeze(2)
    if isinstance(conv, nn.ConvTranspose1d):
        y = F.conv_transpose2d(x4, w4, bias, stride=(1, conv.stride[0]))
    else:
        y = F.conv2d(x4, w4, bias, dilation=(1, conv.dilation[0]), groups=conv.groups)
    return y.squeeze(2).transpose(1, 2)


class _Streamable(nn.Module):
    """A layer that keeps `history` input samples of `channels` channels per stream slot."""

    history: int = 0
    channels: int = 0
    state: Tensor | None = None

    def _with_history(self, x: Tensor, slots: Tensor) -> Tensor:
        assert self.state is not None, "call Code2Wav.init_streams() first"
        past = self.state.index_select(0, slots)
        full = torch.cat([past, x], dim=1)
        self.state.index_copy_(0, slots, full[:, -self.history :])
        return full

    def _with_context(self, x: Tensor, slots: Tensor | None) -> Tensor:
        """x with its left context in front: the slots' history, or silence offline."""
        if not self.history:
            return x
        return F.pad(x, (0, 0, self.history, 0)) if slots is None else self._with_history(x, slots)

    def _past(self, slots: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """The history pool and slots, for a fused kernel that reads the context in place."""
        if slots is None or not self.history:
            return None
        assert self.state is not None, "call Code2Wav.init_streams() first"
        return self.state, slots

    def _refresh(self, x: Tensor, slots: Tensor | None) -> None:
        """After a kernel read the context in place: the slots' history becomes the last `history`
        rows of [history | x] (only x's tail when x is that long, so nothing large is copied)."""
        if slots is None or not self.history:
            return
        assert self.state is not None
        n = x.shape[1]
        if n >= self.history:
            tail = x[:, n - self.history :]
        else:
            tail = torch.cat([self.state.index_select(0, slots)[:, n:], x], dim=1)
        self.state.index_copy_(0, slots, tail)


def _depthwise(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int) -> Tensor:
    """A depthwise causal conv over x [B, T_in, C] as shifted multiply-adds in fp32 (the fused
    kernel's GEMM tiles do not fit a conv whose every channel is its own group)."""
    taps = weight.shape[-1]
    t_out = x.shape[1] - (taps - 1) * dilation
    w = weight[:, 0].float()  # [C, taps]
    acc = x[:, :t_out].float() * w[:, 0]
    for j in range(1, taps):
        acc.addcmul_(x[:, j * dilation : j * dilation + t_out], w[:, j])
    if bias is not None:
        acc += bias
    return acc.to(x.dtype)


class CausalConv(_Streamable):
    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, groups=groups)
        self.history = (kernel - 1) * dilation
        self.channels = c_in
        self._packed = fused_conv.Packed()

    def forward(self, x: Tensor, slots: Tensor | None = None, with_bias: bool = True) -> Tensor:
        """x [B, T, C]. with_bias=False: the caller adds `conv.bias` itself, fused into its next op."""
        if self.conv.groups == 1 and fused_conv.available(x):
            return self.fused(x, slots, with_bias=with_bias)
        x = self._with_context(x, slots)
        bias = self.conv.bias if with_bias else None
        if self.conv.groups == self.channels and fused_conv.available(x):
            return _depthwise(x, self.conv.weight, bias, self.conv.dilation[0])
        return _conv(x, self.conv, bias)

    def fused(
        self,
        x: Tensor,
        slots: Tensor | None = None,
        snake: SnakeBeta | None = None,
        residual: Tensor | None = None,
        with_bias: bool = True,
    ) -> Tensor:
        """The conv with its bias, then `snake`, then `+ residual`, in one fused kernel that reads
        the left context in place (CUDA only: the caller checks fused_conv.available)."""
        weight, bias = self._packed.get(self.conv.weight, self.conv.bias if with_bias else None)
        k, d = self.conv.kernel_size[0], self.conv.dilation[0]
        out = fused_conv.conv(
            x,
            weight,
            k,
            d,
            bias,
            snake=None if snake is None else snake.fp32_params(),
            residual=residual,
            context=self.history,
            past=self._past(slots),
        )
        self._refresh(x, slots)
        return out


class CausalTransConv(_Streamable):
    """Transposed conv whose output is trimmed on the right: sample n depends on inputs <= n/stride."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.stride = stride
        self.history = -(-(kernel - stride) // stride)  # previous inputs that overlap new outputs
        self.channels = c_in
        self._packed = fused_conv.Packed()

    def fusable(self, x: Tensor) -> bool:
        return fused_conv.available(x) and self.conv.kernel_size[0] % self.stride == 0

    def fused(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        """The fused kernel over taps = history + 1 inputs per output frame, reading the history in
        place (offline, silence stands in for it)."""
        n_new = x.shape[1] * self.stride
        weight, bias = self._packed.get(self.conv.weight, self.conv.bias, self.stride)
        y = fused_conv.conv(
            x,
            weight,
            self.history + 1,
            1,
            bias,
            context=self.history,
            past=self._past(slots),
        )
        self._refresh(x, slots)
        return y.view(y.shape[0], n_new, -1)

    def forward(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        n_new = x.shape[1] * self.stride
        if self.fusable(x):
            return self.fused(x, slots)
        if slots is None or not self.history:
            return _conv(x, self.conv, self.conv.bias)[:, :n_new]
        start = self.history * self.stride
        return _conv(self._with_history(x, slots), self.conv, self.conv.bias)[:, start : start + n_new]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (the last dimension)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self._derived: tuple[tuple[Any, ...], Tensor, Tensor, Tensor, Tensor] | None = None

    def _params(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """e^alpha and 1 / e^beta, in the weights' dtype and in fp32 (the fused kernel's), computed
        again only when the weights change: a decode step then launches no kernels for them."""
        a, b = self.alpha, self.beta
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):  # keep the autograd graph
            alpha, inv_beta = a.exp(), 1.0 / (b.exp() + 1e-9)
            return alpha, inv_beta, alpha.float(), inv_beta.float()
        key = (a.data_ptr(), a._version, b.data_ptr(), b._version, a.dtype, a.device)
        if self._derived is None or self._derived[0] != key:
            with torch.no_grad():
                alpha, inv_beta = a.exp(), 1.0 / (b.exp() + 1e-9)
                self._derived = (
                    key,
                    alpha,
                    inv_beta,
                    alpha.float().contiguous(),
                    inv_beta.float().contiguous(),
                )
        return self._derived[1:]

    def fp32_params(self) -> tuple[Tensor, Tensor]:
        """e^alpha and 1 / e^beta in fp32, as the fused kernels take them."""
        return self._params()[2:]

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [..., C]. bias: the previous conv's, added to x here (one pass over the tensor, not two)."""
        alpha, inv_beta, alpha32, inv_beta32 = self._params()
        if fused_snake.available(x):
            return fused_snake.snake(x, alpha32, inv_beta32, bias)
        if bias is not None:
            x = x + bias
        return torch.addcmul(x, inv_beta, torch.sin(x * alpha).square())


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        h = self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x, slots)))))
        return x + self.gamma * h


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        h = self.act1(x)
        if fused_conv.available(h):  # each conv with the ops after it in one kernel
            return self.conv2.fused(self.conv1.fused(h, slots, snake=self.act2), residual=x)
        # the convs' biases ride in the ops after them: cuDNN adds a bias in a pass of its own
        h = self.act2(self.conv1(h, slots, with_bias=False), bias=self.conv1.conv.bias)
        y = self.conv2(h, with_bias=False)
        if fused_snake.available(y):
            return fused_snake.residual(x, y, self.conv2.conv.bias)
        return x + (y + self.conv2.conv.bias)


class DecoderBlock(nn.Module):
    """SnakeBeta -> upsampling transposed conv -> residual units with dilations 1, 3, 9."""

    def __init__(self, c_in: int, c_out: int, rate: int) -> None:
        super().__init__()
        units: list[nn.Module] = [SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate)]
        units += [ResidualUnit(c_out, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList(units)

    def forward(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        x = self.block[0](x)
        for layer in self.block[1:]:
            x = layer(x, slots)
        return x


# ----------------------------------------------------------------------------------------------
# Codebooks: 1 semantic + 15 acoustic residual quantizers, each projected by a 1x1 conv.
# ----------------------------------------------------------------------------------------------


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _CodebookLayer(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _Codebooks(nn.Module):
    def __init__(self, n: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CodebookLayer(size, dim) for _ in range(n))


class _ResidualQuantizer(nn.Module):
    def __init__(self, n: int, size: int, dim: int, io_dim: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)  # encoder side; kept for the weights
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = _Codebooks(n, size, dim)

    def projected_tables(self) -> Tensor:
        """[n, size, io_dim]: each codebook entry already passed through output_proj."""
        tables = torch.stack([cast(_CodebookLayer, layer)._codebook.table() for layer in self.vq.layers])
        return tables.float() @ self.output_proj.weight[:, :, 0].float().T


class SplitQuantizer(nn.Module):
    fused: Tensor  # [quantizers * size, codebook_dim] projected entries, rebuilt by refresh()

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        dim, size = cfg.codebook_dim // 2, cfg.codebook_size
        self.rvq_first = _ResidualQuantizer(1, size, dim, cfg.codebook_dim)
        self.rvq_rest = _ResidualQuantizer(cfg.num_quantizers - 1, size, dim, cfg.codebook_dim)
        self.codebook_size = size
        self.register_buffer(
            "fused", torch.zeros(cfg.num_quantizers * size, cfg.codebook_dim), persistent=False
        )

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused lookup table from the codebook weights (after loading them)."""
        tables = torch.cat([self.rvq_first.projected_tables(), self.rvq_rest.projected_tables()])
        self.fused.copy_(tables.reshape(self.fused.shape))

    def forward(self, codes: Tensor) -> Tensor:
        """codes [B, F, Q] -> summed embeddings [B, F, codebook_dim]."""
        offsets = torch.arange(codes.shape[-1], device=codes.device) * self.codebook_size
        rows = F.embedding(codes + offsets, self.fused)  # [B, F, Q, D]
        return rows.sum(2)


# ----------------------------------------------------------------------------------------------
# The pre-transformer: causal sliding-window attention (RoPE), LayerScale residuals.
# ----------------------------------------------------------------------------------------------


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        d, bias = cfg.attn_head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, cfg.hidden_size, bias=bias)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        stream: _Stream | None = None,
    ) -> Tensor:
        """x [B, T, H]; cos/sin [B, T, D]. Offline: mask [B or 1, 1, T, keys] (True = attend).
        Streaming: the slots' rings of recent keys and values are attended and take the new ones
        (window_attention)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if fused_rope.available(q):  # one kernel per tensor instead of about seven
            cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)
            q, k = fused_rope.rope(q, cos, sin), fused_rope.rope(k, cos, sin)
        else:
            q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)
            k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
        if stream is not None:
            ring = stream.rings[0].shape[2]
            fused = self.kv_heads == self.heads and window_attention.available(q, t, ring, stream.window)
            attend = window_attention.attend if fused else window_attention.attend_reference
            out = attend(q, k, v, stream.rings, stream.slots, stream.starts, stream.window)
            return self.o_proj(out.reshape(b, t, -1))
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


@dataclass(frozen=True)
class _Stream:
    """What a streaming step's attention layer reads: its rings, the rows' slots and first positions."""

    rings: tuple[Tensor, Tensor]
    slots: Tensor
    starts: Tensor
    window: int


class MLP(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, stream: _Stream | None = None
    ) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, stream))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    inv_freq: Tensor

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        d = cfg.attn_head_dim
        self.register_buffer("inv_freq", rope_inv_freq(d, cfg.rope_theta), persistent=False)
        self.kv: list[tuple[Tensor, Tensor]] = []  # per-layer stream caches (init_streams)

    def forward(self, x: Tensor, positions: Tensor, slots: Tensor | None = None) -> Tensor:
        """x [B, T, latent]; positions [B|1, T] of the queries (consecutive per row). Streaming
        (slots given): each slot's ring of recent keys and values is attended and updated."""
        h = self.input_proj(x)
        cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype)
        if slots is None:
            q_pos, k_pos = positions[:, None, :, None], positions[:, None, None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
            for layer in self.layers:
                h = layer(h, cos, sin, mask)
        else:
            starts = positions[:, 0].contiguous()
            for layer, rings in zip(self.layers, self.kv, strict=True):
                h = layer(h, cos, sin, None, _Stream(rings, slots, starts, self.window))
        return self.output_proj(self.norm(h))


# ----------------------------------------------------------------------------------------------
# Code2Wav
# ----------------------------------------------------------------------------------------------


class Code2Wav(nn.Module):
    def __init__(self, cfg: dict[str, Any] | Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg if isinstance(cfg, Code2WavConfig) else Code2WavConfig.from_dict(cfg)
        c = self.cfg
        self.samples_per_frame = c.samples_per_frame
        self.quantizer = SplitQuantizer(c)
        self.pre_conv = CausalConv(c.codebook_dim, c.latent_dim, 3)
        self.pre_transformer = PreTransformer(c)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(c.latent_dim, c.latent_dim, r, r), ConvNeXtBlock(c.latent_dim)])
            for r in c.upsampling_ratios
        )
        layers: list[nn.Module] = [CausalConv(c.latent_dim, c.decoder_dim, 7)]
        for i, rate in enumerate(c.upsample_rates):
            layers.append(DecoderBlock(c.decoder_dim >> i, c.decoder_dim >> (i + 1), rate))
        out_dim = c.decoder_dim >> len(c.upsample_rates)
        layers += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(layers)
        self.positions: Tensor | None = None  # per-slot frame counters (init_streams)
        self._lay_out_weights()
        self.quantizer.refresh()
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            lambda module, _keys: module.quantizer.refresh()
        )

    @property
    def window(self) -> int:
        return self.cfg.sliding_window

    def _lay_out_weights(self) -> None:
        """Every conv weight channels-last (again after a load that replaced the tensors)."""
        for module in self.modules():
            if isinstance(module, (CausalConv, CausalTransConv)):
                channels_last_weight(module.conv.weight)

    def _synthesize(self, codes: Tensor, positions: Tensor, slots: Tensor | None) -> Tensor:
        h = self.pre_conv(self.quantizer(codes), slots)  # [B, F, C] from here on
        h = self.pre_transformer(h, positions, slots)
        for stage in self.upsample:
            trans_conv, convnext = cast(nn.ModuleList, stage)
            h = convnext(trans_conv(h, slots), slots)
        for layer in self.decoder:
            h = layer(h) if isinstance(layer, SnakeBeta) else layer(h, slots)
        return h.clamp(-1.0, 1.0).squeeze(-1)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, F, Q] (negative = padding, decoded as code 0) -> waveform [B, F * 1920]."""
        codes = codes.clamp(min=0)
        positions = torch.arange(codes.shape[1], device=codes.device)[None]
        return self._synthesize(codes, positions, None)

    # ---- streaming ---------------------------------------------------------------------------

    def init_streams(self, max_slots: int) -> None:
        """Allocate the per-slot state pools for `max_slots` concurrent streams (all reset)."""
        self._lay_out_weights()
        p = next(self.parameters())
        for module in self.modules():
            if isinstance(module, _Streamable) and module.history:
                module.state = torch.zeros(
                    max_slots, module.history, module.channels, device=p.device, dtype=p.dtype
                )
        c = self.cfg
        ring = window_attention.ring_size(c.sliding_window, RING_FRAMES)
        shape = (max_slots, c.num_key_value_heads, ring, c.attn_head_dim)
        self.pre_transformer.kv = [
            (
                torch.zeros(shape, device=p.device, dtype=p.dtype),
                torch.zeros(shape, device=p.device, dtype=p.dtype),
            )
            for _ in range(c.num_hidden_layers)
        ]
        self.positions = torch.zeros(max_slots, dtype=torch.long, device=p.device)

    @property
    def max_slots(self) -> int:
        return 0 if self.positions is None else self.positions.shape[0]

    def _state_pools(self) -> list[Tensor]:
        """Every per-slot state tensor (dim 0 = slot): conv histories, attention windows, positions."""
        assert self.positions is not None, "call init_streams() first"
        pools = [m.state for m in self.modules() if isinstance(m, _Streamable) and m.state is not None]
        pools += [t for kv in self.pre_transformer.kv for t in kv]
        return pools + [self.positions]

    def state_bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._state_pools())

    @torch.no_grad()
    def reset(self, slots: Tensor) -> None:
        """Start the given slots afresh (frame 0, silent history)."""
        for pool in self._state_pools():
            pool.index_fill_(0, slots, 0)

    @torch.no_grad()
    def slot_state(self, slot: int) -> list[Tensor]:
        """A copy of one slot's whole streaming state (see load_slot_state)."""
        return [pool[slot].clone() for pool in self._state_pools()]

    @torch.no_grad()
    def load_slot_state(self, slots: Tensor, state: list[Tensor]) -> None:
        """Put a state from slot_state() into each of the given slots: they continue from it."""
        for pool, row in zip(self._state_pools(), state, strict=True):
            pool.index_copy_(0, slots, row.unsqueeze(0).expand(len(slots), *row.shape))

    @torch.no_grad()
    def decode_step(self, slots: Tensor, codes: Tensor) -> Tensor:
        """Decode F new frames for each slot: slots [B] (distinct), codes [B, F, Q] -> [B, F * 1920]."""
        assert self.positions is not None, "call init_streams() first"
        start = self.positions.index_select(0, slots)[:, None]  # [B, 1]
        frames = codes.shape[1]
        positions = start + torch.arange(frames, device=codes.device)
        wav = self._synthesize(codes.clamp(min=0), positions, slots)
        self.positions.index_copy_(0, slots, start[:, 0] + frames)
        return wav
