"""The Qwen3-ForcedAligner-0.6B network: Qwen3-ASR's thinker with a 5000-class head.

An AuT audio encoder turns 16 kHz log-mel into ~12.5 embeddings per second; a Qwen3 decoder reads
``<|audio_start|> audio… <|audio_end|> unit₁ <ts><ts> unit₂ <ts><ts> …`` in one causal pass, and
the head's argmax at each ``<ts>`` slot is a time in 80 ms steps (slot 2i = start, 2i+1 = end of
unit i). Parameter names follow the checkpoint. Both stacks run over packed rows (aligner.layout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aligner.layout import DecoderLayout, EncoderLayout, conv_length, encoder_output_length, upload
from engine.qwen3.models.layers import RMSNorm
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from engine.qwen3.models.speaker import mel_filterbank

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 128
# cuDNN attention is left out: it builds a graph for every new shape (hundreds of ms on first use),
# and nearly every batch of clips and texts has a new shape.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    layers: int = 24
    d_model: int = 1024
    heads: int = 16
    ffn_dim: int = 4096
    output_dim: int = 1024
    conv_channels: int = 480
    n_window: int = 50
    n_window_infer: int = 800
    max_source_positions: int = 1500

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> AudioEncoderConfig:
        return cls(
            num_mel_bins=raw.get("num_mel_bins", 128),
            layers=raw.get("encoder_layers", 32),
            d_model=raw.get("d_model", 1280),
            heads=raw.get("encoder_attention_heads", 20),
            ffn_dim=raw.get("encoder_ffn_dim", 5120),
            output_dim=raw.get("output_dim", 3584),
            conv_channels=raw.get("downsample_hidden_size", 480),
            n_window=raw.get("n_window", 100),
            n_window_infer=raw.get("n_window_infer", 400),
            max_source_positions=raw.get("max_source_positions", 1500),
        )


@dataclass(frozen=True)
class TextDecoderConfig:
    vocab_size: int = 152064
    hidden: int = 1024
    ffn_dim: int = 3072
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TextDecoderConfig:
        heads = raw.get("num_attention_heads", 32)
        return cls(
            vocab_size=raw.get("vocab_size", 151936),
            hidden=raw.get("hidden_size", 4096),
            ffn_dim=raw.get("intermediate_size", 22016),
            layers=raw.get("num_hidden_layers", 32),
            heads=heads,
            kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim", 128),
            rope_theta=float(raw.get("rope_theta", 5_000_000.0)),
            rms_eps=raw.get("rms_norm_eps", 1e-6),
        )


@dataclass(frozen=True)
class AlignerConfig:
    audio: AudioEncoderConfig
    text: TextDecoderConfig
    classes: int = 5000
    slot_ms: float = 80.0
    audio_token_id: int = 151676
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    timestamp_token_id: int = 151705

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> AlignerConfig:
        thinker = raw.get("thinker_config", {})
        if "forced_aligner" not in thinker.get("model_type", "qwen3_forced_aligner"):
            raise ValueError(
                f"not a forced-aligner checkpoint: thinker model_type {thinker.get('model_type')!r}"
            )
        return cls(
            audio=AudioEncoderConfig.from_json(thinker.get("audio_config", {})),
            text=TextDecoderConfig.from_json(thinker.get("text_config", {})),
            classes=thinker.get("classify_num", 5000),
            slot_ms=float(raw.get("timestamp_segment_time", 80)),
            audio_token_id=thinker.get("audio_token_id", 151676),
            audio_start_token_id=thinker.get("audio_start_token_id", 151669),
            audio_end_token_id=thinker.get("audio_end_token_id", 151670),
            timestamp_token_id=raw.get("timestamp_token_id", 151705),
        )


# --------------------------------------------------------------------------- log-mel front end


class LogMel:
    """Whisper-style 128-bin log-mel at 16 kHz (10 ms hop), batched like the reference extractor.

    ``steady=True`` (on CUDA) pads the batch's signal on to a whole second: the STFT and the
    filterbank's product then meet few shapes, and each new one costs a cuFFT plan and a GEMM
    heuristic. The extra frames are silence, below every item's peak, and past every item's end.
    """

    def __init__(self, device: torch.device | str = "cpu", steady: bool = False) -> None:
        self.device = torch.device(device)
        self.steady = steady
        # Slaney-normalised triangular filters up to the Nyquist rate, as Whisper's
        filters = mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS, 0.0, SAMPLE_RATE / 2)  # [mels, freqs]
        self.filters = torch.from_numpy(np.ascontiguousarray(filters.T)).to(self.device, torch.float32)
        self.window = torch.hann_window(N_FFT, device=self.device)

    def __call__(self, waveforms: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        """Return features (batch, 128, frames) and each item's valid frame count.

        The batch is zero-padded to its longest item before the STFT; valid frames are
        ``ceil(len / 160)`` except where that reaches past the longest item's whole frames, as the
        reference does.
        """
        longest = max(len(w) for w in waveforms)
        width = -(-longest // SAMPLE_RATE) * SAMPLE_RATE if self.steady else longest
        padded = torch.zeros((len(waveforms), width), pin_memory=self.device.type == "cuda")
        rows = padded.numpy()
        for row, wave in enumerate(waveforms):
            rows[row, : len(wave)] = wave
        signal = padded.to(self.device, non_blocking=True)
        spectrum = torch.stft(signal, N_FFT, HOP, window=self.window, return_complex=True)
        power = spectrum[..., :-1].abs() ** 2
        log_spec = torch.clamp(self.filters.T @ power, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0
        frames = longest // HOP
        return log_spec, [min(math.ceil(len(w) / HOP), frames) for w in waveforms]


# --------------------------------------------------------------------------- audio encoder


class _AudioAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, length, dim = x.shape
        shape = (rows, length, self.heads, dim // self.heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(rows, length, dim))


class _AudioLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = _AudioAttention(cfg.d_model, cfg.heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    increment = np.log(10000) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioEncoder(nn.Module):
    """AuT: three stride-2 convs per 1 s chunk of mel, then attention within 8 s windows.

    ``windowed=False`` attends over the whole clip instead: what the reference's transformers code
    does under its sdpa/eager attention (it honours the windows only with FlashAttention-2, as vLLM
    does). The two agree for clips up to 8 s.

    ``steady_shapes=True`` pads every chunk to full width and the chunk count to a bucket, so the
    convolutions meet few distinct shapes (on CUDA each new one costs cuDNN a plan), and packs the
    windows into full-window rows of a bucketed count (aligner.layout), which CUDA graphs cover;
    the padding never reaches a kept token.
    """

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.windowed = True
        self.steady_shapes = False
        ch = cfg.conv_channels
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        freq = conv_length(conv_length(conv_length(cfg.num_mel_bins)))
        self.conv_out = nn.Linear(ch * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(_AudioLayer(cfg) for _ in range(cfg.layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.positions: torch.Tensor | None = None

    @property
    def chunk_frames(self) -> int:
        return 2 * self.cfg.n_window

    @property
    def window_chunks(self) -> int:
        return self.cfg.n_window_infer // self.chunk_frames

    @property
    def full_window(self) -> int:
        """Tokens in a window of full chunks: the length of a steady-shape row."""
        return int(encoder_output_length(self.chunk_frames)) * self.window_chunks

    def _position_table(self, device: torch.device) -> torch.Tensor:
        if self.positions is None or self.positions.device != device:
            self.positions = _sinusoids(self.cfg.max_source_positions, self.cfg.d_model).to(device)
        return self.positions

    def _embed_chunks(
        self, chunks: torch.Tensor, lengths: torch.Tensor, solo: torch.Tensor, any_solo: bool
    ) -> torch.Tensor:
        """Conv front end over (chunks, mel, frames). A chunk that is its item's only one is
        computed as if unpadded: activations past its length are zeroed after every conv."""
        x = chunks.unsqueeze(1)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            lengths = (lengths - 1) // 2 + 1
            if any_solo:
                keep = torch.arange(x.shape[-1], device=x.device)[None, :] < lengths[:, None]
                keep |= ~solo[:, None]
                x = x * keep[:, None, None, :].to(x.dtype)
        count, channels, freq, frames = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(count, frames, channels * freq))
        return x + self._position_table(x.device)[:frames].to(x.dtype)

    def forward(self, features: torch.Tensor, frame_counts: list[int]) -> list[torch.Tensor]:
        """features (batch, mel, frames) -> one (tokens, output_dim) tensor per item."""
        tokens, counts = self.encode(features, frame_counts)
        return list(torch.split(tokens, counts))

    def encode(
        self, features: torch.Tensor, frame_counts: list[int], attend: Attend | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """features (batch, mel, frames) -> every item's tokens back to back, and their counts.

        The layout (chunks, tokens, windows) is planned on the host and reaches the device in one
        copy; gathers and scatters then stand in for per-chunk slicing, so nothing waits on the GPU.
        ``attend`` runs the attention stack over the packed windows (``self.attend`` unless given:
        aligner.graphs replays it from a CUDA graph).
        """
        layout = EncoderLayout.plan(
            frame_counts, self.chunk_frames, self.window_chunks, self.windowed, self.steady_shapes
        )
        item, start, length, solo, source, target, segments = upload(
            features.device,
            layout.chunk_item,
            layout.chunk_start,
            layout.chunk_length,
            layout.chunk_solo,
            layout.token_source,
            layout.token_target,
            layout.windows.segments,
        )
        offsets = torch.arange(layout.width, device=features.device)
        frames = (start[:, None] + offsets).clamp(max=features.shape[-1] - 1)
        chunks = features[item[:, None], :, frames]  # (chunks, width, mel)
        chunks = torch.where((offsets < length[:, None])[..., None], chunks, 0).transpose(1, 2)
        embedded = self._embed_chunks(chunks, length, solo.bool(), bool(layout.chunk_solo.any()))

        dim = embedded.shape[-1]
        shape = layout.windows.segments.shape
        packed = embedded.new_zeros(layout.windows.segments.size, dim)
        packed.index_copy_(0, target, embedded.reshape(-1, dim)[source])
        x = (attend or self.attend)(packed.view(*shape, dim), segments.view(shape))
        return x[target], layout.item_tokens

    def attend(self, x: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """The attention layers and output projection over packed rows: (rows, length, d_model) ->
        (rows · length, output_dim). A position attends within its own window only."""
        mask = segments[:, None, :, None] == segments[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------- text decoder


class _TextAttention(nn.Module):
    def __init__(self, cfg: TextDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        head_dim = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(batch, length, -1, head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, length, -1, head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class _TextMLP(nn.Module):
    def __init__(self, cfg: TextDecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TextLayer(nn.Module):
    def __init__(self, cfg: TextDecoderConfig) -> None:
        super().__init__()
        self.self_attn = _TextAttention(cfg)
        self.mlp = _TextMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextDecoder(nn.Module):
    """Qwen3 decoder (QK-norm, GQA, RoPE) over packed rows; returns final-norm hidden states."""

    def __init__(self, cfg: TextDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(_TextLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The checkpoint's interleaved multimodal RoPE gets equal positions on all three axes
        # for this model, which makes it plain 1-D RoPE.
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, positions.device)
        return rope_cos_sin(inv_freq, positions, dtype)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """embeds (rows, length, hidden); every prompt attends causally within itself only, its
        positions counted from its own start."""
        cos, sin = self.rope(positions, embeds.dtype)
        index = torch.arange(embeds.shape[1], device=embeds.device)
        causal = index[None, :] <= index[:, None]
        mask = (segments[:, :, None] == segments[:, None, :]) & causal
        mask = mask[:, None]
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ForcedAlignerModel(nn.Module):
    """The thinker: audio tower + decoder + timestamp head. Parameter names follow the checkpoint
    (``thinker.`` prefix stripped)."""

    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextDecoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden, cfg.classes, bias=False)

    def slot_classes(
        self,
        prompts: DecoderInputs,
        features: torch.Tensor,
        frame_counts: list[int],
        attend: Attend | None = None,
        decode: Decode | None = None,
    ) -> torch.Tensor:
        """Argmax class of every ``<timestamp>`` slot, in the order of ``prompts.slots_at``.

        ``attend`` and ``decode`` stand in for the encoder's attention stack and
        `position_classes` (aligner.graphs replays them from CUDA graphs)."""
        with sdpa_kernel(ATTENTION_BACKENDS):
            audio, _ = self.audio_tower.encode(features.to(self.lm_head.weight.dtype), frame_counts, attend)
            embeds = self.model.embed_tokens(prompts.ids)
            hidden_size = embeds.shape[-1]
            embeds = (
                embeds.view(-1, hidden_size)
                .index_copy(0, prompts.audio_at, audio.to(embeds.dtype))
                .view_as(embeds)
            )
            classes = (decode or self.position_classes)(embeds, prompts.positions, prompts.segments)
        return classes.reshape(-1)[prompts.slots_at]

    def position_classes(
        self, embeds: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor
    ) -> torch.Tensor:
        """The decoder and the head: the argmax class at every position of the packed rows. The
        head runs over every position, not just the slots, so its shape is the rows' (few)."""
        return self.lm_head(self.model(embeds, positions, segments)).argmax(-1)


@dataclass(frozen=True)
class DecoderInputs:
    """A `DecoderLayout` on the device."""

    ids: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    audio_at: torch.Tensor
    slots_at: torch.Tensor

    @classmethod
    def upload(cls, layout: DecoderLayout, device: torch.device) -> DecoderInputs:
        shape = layout.ids.shape
        ids, positions, segments, audio_at, slots_at = upload(
            device, layout.ids, layout.rows.offsets, layout.rows.segments, layout.audio_at, layout.slots_at
        )
        return cls(ids.view(shape), positions.view(shape), segments.view(shape), audio_at, slots_at)
