"""Qwen3-ForcedAligner-0.6B inference: audio + text -> a start and an end time for every text unit.

The model is Qwen3-ASR's thinker with a 5000-class head: an AuT audio encoder turns 16 kHz log-mel
into ~12.5 embeddings per second, a Qwen3 decoder reads
``<|audio_start|> audio… <|audio_end|> unit₁ <ts><ts> unit₂ <ts><ts> …`` in one causal pass and the
head's argmax at each ``<ts>`` slot is a time in 80 ms steps (slot 2i = start, 2i+1 = end of unit
i). Times are then made non-decreasing the way the reference does it.

Batching: every input of one ``align`` call runs in one encoder pass and one decoder pass.
Feature extraction pads the batch's audio to its longest item before the STFT, as the reference's
feature extractor does, so an item's times can depend (rarely, at the 80 ms level) on its batch.
The host plans where every chunk, token and slot lies, sends those indices in one copy and reads
the slot classes back in one; nothing in between waits on the device, and the text-side work runs
while it computes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aligner.graphs import AlignerGraphs
from aligner.layout import (
    DecoderLayout,
    EncoderLayout,
    chunk_bucket,
    conv_length,
    encoder_output_length,
    upload,
)
from aligner.text import UnitSplitter, display_spans, load_korean_dictionary, locate_units
from engine.alignment.api import AlignedWord, AlignInput, CallPhases
from engine.qwen3.models.layers import RMSNorm
from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from engine.qwen3.models.speaker import mel_filterbank

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 128
# cuDNN attention is left out: it builds a graph for every new shape (hundreds of ms on first use),
# and nearly every batch of clips and texts has a new shape.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KOREAN_DICTIONARY_FILE = "korean_dict_jieba.dict"
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


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


# --------------------------------------------------------------------------- post-processing


def repair_monotonic(values: Sequence[float]) -> list[int]:
    """Make slot times non-decreasing as the reference does.

    The longest non-decreasing subsequence (earliest-ending choice on ties) is trusted; runs of at
    most two other values snap to the nearer trusted neighbour (left on a tie), longer runs are
    interpolated linearly between their trusted neighbours. Results are truncated to integers.
    """
    return repair_monotonic_rows([values])[0]


def repair_monotonic_rows(rows: Sequence[Sequence[float]]) -> list[list[int]]:
    """``repair_monotonic`` of every row; the subsequence search runs over all rows at once."""
    count = max((len(row) for row in rows), default=0)
    data = np.zeros((len(rows), count), dtype=np.float64)
    for index, row in enumerate(rows):
        data[index, : len(row)] = row
    # best[r, i]: length of the longest non-decreasing run ending at i; parent: the element before.
    # Padding sits after each row's values, so it never feeds a real element.
    best = np.ones_like(data, dtype=np.int64)
    parent = np.full_like(best, -1)
    every = np.arange(len(rows))
    for i in range(1, count):
        candidates = np.where(data[:, :i] <= data[:, i : i + 1], best[:, :i], 0)
        j = candidates.argmax(axis=1)
        top = candidates[every, j]
        grows = top + 1 > 1
        best[grows, i] = top[grows] + 1
        parent[grows, i] = j[grows]
    repaired: list[list[int]] = []
    for index, row in enumerate(rows):
        size = len(row)
        if size == 0:
            repaired.append([])
            continue
        values = data[index, :size]
        if bool(np.all(values[1:] >= values[:-1])):
            repaired.append([int(value) for value in values.tolist()])
            continue
        trusted = np.zeros(size, dtype=bool)
        node = int(np.argmax(best[index, :size]))
        while node != -1:
            trusted[node] = True
            node = int(parent[index, node])
        repaired.append(_fill_untrusted(values.tolist(), trusted.tolist()))
    return repaired


def _fill_untrusted(result: list[Any], trusted: list[bool]) -> list[int]:
    count = len(result)
    i = 0
    while i < count:
        if trusted[i]:
            i += 1
            continue
        j = i
        while j < count and not trusted[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if trusted[k]), None)
        right = next((result[k] for k in range(j, count) if trusted[k]), None)
        for k in range(i, j):
            if j - i <= 2:
                if left is None or (right is not None and (k - (i - 1)) > (j - k)):
                    result[k] = right
                else:
                    result[k] = left
            elif left is not None and right is not None:
                result[k] = left + (right - left) / (j - i + 1) * (k - i + 1)
            else:
                result[k] = left if left is not None else right
        i = j
    return [int(value) for value in result]


# --------------------------------------------------------------------------- audio input


def to_model_audio(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 at 16 kHz, scaled into [-1, 1] only when its peak exceeds 1."""
    wave = np.asarray(audio, dtype=np.float32)
    if wave.ndim == 2:
        wave = (wave.T if wave.shape[0] <= 8 and wave.shape[1] > wave.shape[0] else wave).mean(axis=-1)
        wave = wave.astype(np.float32)
    if wave.ndim != 1:
        raise ValueError(f"audio must be mono (got shape {audio.shape})")
    if sample_rate != SAMPLE_RATE:
        import soxr

        wave = soxr.resample(wave, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    if wave.size:
        peak = float(np.max(np.abs(wave)))
        if peak > 1.0:
            wave = wave / peak
        wave = np.clip(wave, -1.0, 1.0)
    return wave


def model_audio(items: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
    """``to_model_audio`` of every item; resampling runs on a few threads (soxr frees the GIL)."""
    if len(items) < 2 or all(rate == SAMPLE_RATE for _, rate in items):
        return [to_model_audio(audio, rate) for audio, rate in items]
    return list(_resampling_pool().map(lambda item: to_model_audio(*item), items))


@functools.cache
def _resampling_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="resample")


# --------------------------------------------------------------------------- checkpoint


REQUIRED_FILES = ("config.json", "vocab.json", "merges.txt")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in shards]
    return [directory / "model.safetensors"]


def check_checkpoint(directory: str | Path) -> Path:
    """Raise FileNotFoundError naming every file the aligner needs that ``directory`` lacks."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"aligner checkpoint directory not found: {root}")
    missing = [name for name in REQUIRED_FILES if not (root / name).is_file()]
    missing += [path.name for path in _weight_files(root) if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"aligner checkpoint {root} is missing: {', '.join(missing)}")
    return root


def load_word_tokenizer(directory: str | Path) -> Tokenizer:
    """The Qwen2 byte-level BPE from vocab.json/merges.txt (NFC, Qwen2 split regex)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    root = Path(directory)
    model = BPE.from_file(str(root / "vocab.json"), str(root / "merges.txt"))
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def load_model(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ForcedAlignerModel:
    from safetensors.torch import load_file

    root = check_checkpoint(directory)
    cfg = AlignerConfig.from_json(json.loads((root / "config.json").read_text()))
    with torch.device("meta"):
        model = ForcedAlignerModel(cfg)
    expected = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(root):
        for name, tensor in load_file(str(path), device="cpu").items():
            key = name.removeprefix("thinker.")
            if key in expected:
                state[key] = tensor.to(dtype)
    missing = sorted(expected - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" … (+{len(missing) - 5})" if len(missing) > 5 else "")
        raise ValueError(f"aligner checkpoint {root} lacks tensors: {shown}")
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


# --------------------------------------------------------------------------- the aligner


_R = TypeVar("_R")
STREAM_PRIORITY = -1  # above a TTS engine's steps (0), below its first-chunk lane (the highest)


def _on_own_stream(method: Callable[..., _R]) -> Callable[..., _R]:
    """Run an aligner method with its stream current (on CUDA)."""

    @functools.wraps(method)
    def wrapper(self: Qwen3ForcedAligner, *args: Any, **kwargs: Any) -> _R:
        if self.stream is None:
            return method(self, *args, **kwargs)
        with torch.cuda.stream(self.stream):
            return method(self, *args, **kwargs)

    return wrapper


class Qwen3ForcedAligner:
    """Batched forced alignment with Qwen3-ForcedAligner weights from a local directory."""

    def __init__(
        self,
        model: ForcedAlignerModel,
        tokenizer: Tokenizer,
        splitter: UnitSplitter | None = None,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.splitter = splitter or UnitSplitter()
        self.device = model.lm_head.weight.device
        self.mel = LogMel(self.device, steady=self.device.type == "cuda")
        model.audio_tower.steady_shapes = self.device.type == "cuda"
        self.phases = CallPhases()
        self.graphs = AlignerGraphs(model.audio_tower, model) if self.device.type == "cuda" else None
        # Its own stream: beside a TTS engine on the same GPU, the aligner's kernels run between
        # the engine's instead of queueing behind them, and each side's wait for its results
        # waits for its own work only. Above the engine's steps in priority: a call is a long
        # chain of small kernels, each of which would otherwise wait for the engine's larger ones,
        # while its own GPU time is small.
        self.stream = (
            torch.cuda.Stream(self.device, priority=STREAM_PRIORITY) if self.device.type == "cuda" else None
        )
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights are in

    @classmethod
    def from_directory(
        cls,
        directory: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        korean_dictionary: str | Path | None = None,
    ) -> Qwen3ForcedAligner:
        """Load a checkpoint folder (config.json, vocab.json, merges.txt, model.safetensors[.index.json]).

        Default device: CUDA when present; default dtype: bfloat16 on CUDA, float32 elsewhere.
        Korean splitting uses ``korean_dictionary`` or ``korean_dict_jieba.dict`` in the folder;
        without either, Korean units are whole space-separated words.
        """
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = load_model(directory, device, dtype)
        dictionary_path = Path(korean_dictionary or Path(directory) / KOREAN_DICTIONARY_FILE)
        scores = load_korean_dictionary(dictionary_path) if dictionary_path.is_file() else None
        return cls(model, load_word_tokenizer(directory), UnitSplitter(korean_dictionary=scores))

    @property
    def max_audio_s(self) -> float:
        return self.cfg.classes * self.cfg.slot_ms / 1000.0

    @_on_own_stream
    @torch.inference_mode()
    def warm_up(self, max_batch: int = 32, max_chunks: int = 1024) -> None:
        """Meet the kernels' first-use costs at start-up rather than in a caller's first batches:
        on CUDA the graphs are captured first; then batches of 1, 2, 4 … ``max_batch`` short clips
        (at 16 kHz and at a TTS engine's 24 kHz, so resampling is ready too), then with steady
        shapes the convolutions at every chunk bucket."""
        if self.graphs is not None and not len(self.graphs):
            with sdpa_kernel(ATTENTION_BACKENDS):
                self.graphs.capture()
        size = 1
        while size <= max_batch:
            rates = [(SAMPLE_RATE, 24_000)[i % 2] for i in range(size)]
            seconds = [1.5 + 0.75 * (i % 3) for i in range(size)]
            self.align(
                [
                    (np.zeros(int(rate * length), np.float32), rate, "warming up the aligner", "English")
                    for rate, length in zip(rates, seconds, strict=True)
                ]
            )
            size *= 2
        tower = self.model.audio_tower
        if not tower.steady_shapes:
            return
        dtype = self.model.lm_head.weight.dtype
        count = 1
        while count <= max_chunks:
            chunks = torch.zeros(
                (count, self.cfg.audio.num_mel_bins, tower.chunk_frames),
                device=self.device,
                dtype=dtype,
            )
            lengths = torch.zeros(count, dtype=torch.long, device=self.device)
            tower._embed_chunks(chunks, lengths, lengths == 0, True)
            count = chunk_bucket(count + 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prompt_ids(self, words: Sequence[str], audio_tokens: int) -> list[int]:
        return self.prompt_rows([words], [audio_tokens])[0]

    def prompt_rows(self, words: Sequence[Sequence[str]], audio_tokens: Sequence[int]) -> list[list[int]]:
        """Every item's prompt ids; the whole batch's units go through the tokenizer in one call."""
        cfg = self.cfg
        units = [unit for item in words for unit in item]
        pieces = iter(self.tokenizer.encode_batch(units, add_special_tokens=False) if units else [])
        slot_pair = [cfg.timestamp_token_id, cfg.timestamp_token_id]
        rows: list[list[int]] = []
        for item, count in zip(words, audio_tokens, strict=True):
            row = [cfg.audio_start_token_id, *([cfg.audio_token_id] * count), cfg.audio_end_token_id]
            for _ in item:
                row += next(pieces).ids
                row += slot_pair
            if not item:
                row += slot_pair
            rows.append(row)
        return rows

    def _launch(
        self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]
    ) -> tuple[torch.Tensor, list[int]]:
        """Queue both model passes; return the slot classes (still on the device) and slots per item."""
        features, frame_counts = self.mel(waves)
        prompts = self.prompt_rows(words, [int(encoder_output_length(frames)) for frames in frame_counts])
        layout = DecoderLayout.plan(
            prompts,
            self.cfg.audio_token_id,
            self.cfg.timestamp_token_id,
            self.model.audio_tower.steady_shapes,
        )
        graphs = self.graphs
        classes = self.model.slot_classes(
            DecoderInputs.upload(layout, self.device),
            features,
            frame_counts,
            graphs.attend if graphs else None,
            graphs.decode if graphs else None,
        )
        return classes, layout.slots

    def _slot_times(self, classes: torch.Tensor, slots: list[int]) -> list[list[int]]:
        return self._repaired(classes.cpu(), slots)  # the batch's one wait on the device

    def _repaired(self, classes: torch.Tensor, slots: list[int]) -> list[list[int]]:
        flat = (classes.numpy() * self.cfg.slot_ms).tolist()
        ends = np.cumsum(slots).tolist()
        return repair_monotonic_rows(
            [flat[end - count : end] for count, end in zip(slots, ends, strict=True)]
        )

    @_on_own_stream
    @torch.inference_mode()
    def slot_classes(self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]) -> list[int]:
        """Every slot's class before repair, item after item."""
        return self._launch(waves, words)[0].tolist()

    @_on_own_stream
    @torch.inference_mode()
    def slot_times_ms(self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]) -> list[list[int]]:
        """Repaired slot times in ms for 16 kHz waves and their unit lists (two slots per unit)."""
        return self._slot_times(*self._launch(waves, words))

    @_on_own_stream
    @torch.inference_mode()
    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        if not batch:
            return []
        began = time.perf_counter()
        waves = model_audio([(audio, rate) for audio, rate, _, _ in batch])
        for wave in waves:
            if len(wave) / SAMPLE_RATE > self.max_audio_s:
                raise ValueError(
                    f"aligner input is {len(wave) / SAMPLE_RATE:.1f} s; the limit is {self.max_audio_s:.0f} s"
                )
            if len(wave) < HOP:
                raise ValueError("aligner input is shorter than 10 ms")
        words = [self.splitter.words(text, language) for _, _, text, language in batch]
        classes, slots = self._launch(waves, words)
        # While the device works: where every unit lies in the client's text.
        spans = [
            display_spans(text, locate_units(text, units))
            for (_, _, text, _), units in zip(batch, words, strict=True)
        ]
        waited = time.perf_counter()
        classes = classes.cpu()
        read = time.perf_counter()
        times = self._repaired(classes, slots)
        aligned = [
            [
                AlignedWord(
                    text=text[start:end],
                    start_s=round(slot_ms[2 * i] / 1000.0, 3),
                    end_s=round(slot_ms[2 * i + 1] / 1000.0, 3),
                    char_start=start,
                    char_end=end,
                )
                for i, (start, end) in enumerate(item_spans)
            ]
            for (_, _, text, _), item_spans, slot_ms in zip(batch, spans, times, strict=True)
        ]
        self.phases.add(waited - began, read - waited, time.perf_counter() - read)
        return aligned
