"""Qwen3-ForcedAligner-0.6B inference: audio + text -> a start and an end time for every text unit.

The model is Qwen3-ASR's thinker with a 5000-class head: an AuT audio encoder turns 16 kHz log-mel
into ~12.5 embeddings per second, a Qwen3 decoder reads
``<|audio_start|> audio… <|audio_end|> unit₁ <ts><ts> unit₂ <ts><ts> …`` in one causal pass and the
head's argmax at each ``<ts>`` slot is a time in 80 ms steps (slot 2i = start, 2i+1 = end of unit
i). Times are then made non-decreasing the way the reference does it.

Batching: every input of one ``align`` call runs in one encoder pass and one decoder pass.
Feature extraction pads the batch's audio to its longest item before the STFT, as the reference's
feature extractor does, so an item's times can depend (rarely, at the 80 ms level) on its batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aligner.api import AlignedWord, AlignInput
from aligner.text import UnitSplitter, display_spans, load_korean_dictionary, locate_units

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 128
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


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = 200.0 * mel / 3.0
    log_region = mel >= 15.0
    hz[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel[log_region] - 15.0))
    return hz


def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-normalised triangular filters, shape (n_fft // 2 + 1, n_mels), as Whisper uses."""
    fft_hz = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    edges_mel = np.linspace(_hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([8000.0]))[0], n_mels + 2)
    edges_hz = _mel_to_hz(edges_mel)
    widths = np.diff(edges_hz)
    slopes = edges_hz[None, :] - fft_hz[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges_hz[2 : n_mels + 2] - edges_hz[:n_mels]))


class LogMel:
    """Whisper-style 128-bin log-mel at 16 kHz (10 ms hop), batched like the reference extractor."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.filters = torch.from_numpy(mel_filters()).to(self.device, torch.float32)
        self.window = torch.hann_window(N_FFT, device=self.device)

    def __call__(self, waveforms: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        """Return features (batch, 128, frames) and each item's valid frame count.

        The batch is zero-padded to its longest item before the STFT; valid frames are
        ``ceil(len / 160)`` except where that reaches past the padded total, as the reference does.
        """
        longest = max(len(w) for w in waveforms)
        padded = np.zeros((len(waveforms), longest), dtype=np.float32)
        for row, wave in enumerate(waveforms):
            padded[row, : len(wave)] = wave
        signal = torch.from_numpy(padded).to(self.device)
        spectrum = torch.stft(signal, N_FFT, HOP, window=self.window, return_complex=True)
        power = spectrum[..., :-1].abs() ** 2
        log_spec = torch.clamp(self.filters.T @ power, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0
        frames = log_spec.shape[-1]
        lengths = [min(math.ceil(len(w) / HOP), frames) for w in waveforms]
        return log_spec, lengths


def encoder_output_length(frames: int) -> int:
    """Audio embeddings for ``frames`` mel frames: 13 per full 100-frame chunk plus the tail's."""
    tail = frames % 100
    after_conv = (tail - 1) // 2 + 1
    return ((after_conv - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


def _conv_length(frames: int) -> int:
    return (frames - 1) // 2 + 1


# --------------------------------------------------------------------------- audio encoder


class _AudioAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        windows, length, dim = x.shape
        shape = (windows, length, self.heads, dim // self.heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(windows, length, dim))


class _AudioLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = _AudioAttention(cfg.d_model, cfg.heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
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
    """

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.windowed = True
        ch = cfg.conv_channels
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        freq = _conv_length(_conv_length(_conv_length(cfg.num_mel_bins)))
        self.conv_out = nn.Linear(ch * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(_AudioLayer(cfg) for _ in range(cfg.layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.positions: torch.Tensor | None = None

    def _position_table(self, device: torch.device) -> torch.Tensor:
        if self.positions is None or self.positions.device != device:
            self.positions = _sinusoids(self.cfg.max_source_positions, self.cfg.d_model).to(device)
        return self.positions

    def _embed_chunks(self, chunks: torch.Tensor, lengths: list[int], solo: list[bool]) -> torch.Tensor:
        """Conv front end over (chunks, mel, frames). A chunk that is its item's only one is
        computed as if unpadded: activations past its length are zeroed after every conv."""
        x = chunks.unsqueeze(1)
        device = x.device
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            lengths = [_conv_length(n) for n in lengths]
            if any(solo):
                keep = (
                    torch.arange(x.shape[-1], device=device)[None, :]
                    < torch.tensor(lengths, device=device)[:, None]
                )
                keep |= ~torch.tensor(solo, device=device)[:, None]
                x = x * keep[:, None, None, :].to(x.dtype)
        count, channels, freq, frames = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(count, frames, channels * freq))
        return x + self._position_table(device)[:frames].to(x.dtype)

    def forward(self, features: torch.Tensor, frame_counts: list[int]) -> list[torch.Tensor]:
        """features (batch, mel, frames) -> one (tokens, output_dim) tensor per item."""
        chunk_frames = self.cfg.n_window * 2
        pieces: list[torch.Tensor] = []
        lengths: list[int] = []
        solo: list[bool] = []
        owners: list[int] = []
        for item, frames in enumerate(frame_counts):
            starts = list(range(0, frames, chunk_frames))
            for start in starts:
                pieces.append(features[item, :, start : min(start + chunk_frames, frames)].T)
                lengths.append(min(chunk_frames, frames - start))
                solo.append(len(starts) == 1)
                owners.append(item)
        padded = nn.utils.rnn.pad_sequence(pieces, batch_first=True).transpose(1, 2)
        embedded = self._embed_chunks(padded, lengths, solo)

        # Tokens of each item, then attention windows of n_window_infer frames' worth of tokens.
        per_item: list[list[torch.Tensor]] = [[] for _ in frame_counts]
        widest: list[int] = [0] * len(frame_counts)
        for row, (item, length) in enumerate(zip(owners, lengths, strict=True)):
            count = encoder_output_length(length)
            per_item[item].append(embedded[row, :count])
            widest[item] = max(widest[item], count)
        windows: list[torch.Tensor] = []
        window_owner: list[int] = []
        ratio = self.cfg.n_window_infer // chunk_frames
        for item, parts in enumerate(per_item):
            tokens = torch.cat(parts)
            for window in tokens.split(widest[item] * ratio if self.windowed else len(tokens)):
                windows.append(window)
                window_owner.append(item)
        sizes = torch.tensor([len(w) for w in windows], device=features.device)
        x = nn.utils.rnn.pad_sequence(windows, batch_first=True)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < sizes[:, None]
        key_mask = valid[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        outputs: list[list[torch.Tensor]] = [[] for _ in frame_counts]
        for row, item in enumerate(window_owner):
            outputs[item].append(x[row, : int(sizes[row])])
        return [torch.cat(parts) for parts in outputs]


# --------------------------------------------------------------------------- text decoder


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


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
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
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
    """Qwen3 decoder (QK-norm, GQA, RoPE) over left-padded rows; returns final-norm hidden states."""

    def __init__(self, cfg: TextDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(_TextLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The checkpoint's interleaved multimodal RoPE gets equal positions on all three axes
        # for this model, which makes it plain 1-D RoPE.
        dim = self.cfg.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        inv_freq = 1.0 / (self.cfg.rope_theta**exponents)
        angles = positions.float()[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, embeds: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        positions = attention.long().cumsum(-1) - 1
        positions = positions.masked_fill(attention == 0, 1)
        cos, sin = self.rope(positions, embeds.dtype)
        length = embeds.shape[1]
        index = torch.arange(length, device=embeds.device)
        causal = index[None, :] <= index[:, None]
        mask = (causal[None] & attention.bool()[:, None, :]) | torch.eye(
            length, dtype=torch.bool, device=embeds.device
        )
        mask = mask[:, None]
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


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
        self, ids: torch.Tensor, attention: torch.Tensor, features: torch.Tensor, frame_counts: list[int]
    ) -> torch.Tensor:
        """Argmax class of every ``<timestamp>`` slot, row-major over the batch."""
        audio = self.audio_tower(features.to(self.lm_head.weight.dtype), frame_counts)
        embeds = self.model.embed_tokens(ids)
        audio_slots = ids == self.cfg.audio_token_id
        embeds = embeds.masked_scatter(audio_slots[..., None], torch.cat(audio).to(embeds.dtype))
        hidden = self.model(embeds, attention)
        slots = hidden[ids == self.cfg.timestamp_token_id]
        return self.lm_head(slots).argmax(-1)


# --------------------------------------------------------------------------- post-processing


def repair_monotonic(values: Sequence[float]) -> list[int]:
    """Make slot times non-decreasing as the reference does.

    The longest non-decreasing subsequence (earliest-ending choice on ties) is trusted; runs of at
    most two other values snap to the nearer trusted neighbour (left on a tie), longer runs are
    interpolated linearly between their trusted neighbours. Results are truncated to integers.
    """
    data = np.asarray(values, dtype=np.float64)
    count = len(data)
    if count == 0:
        return []
    best = np.ones(count, dtype=np.int64)
    parent = np.full(count, -1, dtype=np.int64)
    for i in range(1, count):
        candidates = np.where(data[:i] <= data[i], best[:i], 0)
        j = int(np.argmax(candidates))
        if candidates[j] + 1 > 1:
            best[i], parent[i] = candidates[j] + 1, j
    trusted = np.zeros(count, dtype=bool)
    node = int(np.argmax(best))
    while node != -1:
        trusted[node] = True
        node = int(parent[node])

    result = data.tolist()
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
        self.mel = LogMel(self.device)

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

    def prompt_ids(self, words: Sequence[str], audio_tokens: int) -> list[int]:
        cfg = self.cfg
        ids = [cfg.audio_start_token_id, *([cfg.audio_token_id] * audio_tokens), cfg.audio_end_token_id]
        encoded = self.tokenizer.encode_batch(list(words), add_special_tokens=False) if words else []
        for piece in encoded:
            ids += piece.ids
            ids += [cfg.timestamp_token_id, cfg.timestamp_token_id]
        if not words:
            ids += [cfg.timestamp_token_id, cfg.timestamp_token_id]
        return ids

    @torch.inference_mode()
    def slot_times_ms(self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]) -> list[list[int]]:
        """Repaired slot times in ms for 16 kHz waves and their unit lists (two slots per unit)."""
        features, frame_counts = self.mel(waves)
        rows = [
            self.prompt_ids(units, encoder_output_length(frames))
            for units, frames in zip(words, frame_counts, strict=True)
        ]
        width = max(len(row) for row in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):  # left padding, as the reference
            ids[index, width - len(row) :] = torch.tensor(row)
            attention[index, width - len(row) :] = 1
        classes = self.model.slot_classes(
            ids.to(self.device), attention.to(self.device), features, frame_counts
        ).tolist()
        times: list[list[int]] = []
        offset = 0
        for row in rows:
            slots = sum(1 for token in row if token == self.cfg.timestamp_token_id)
            times.append(repair_monotonic([c * self.cfg.slot_ms for c in classes[offset : offset + slots]]))
            offset += slots
        return times

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        if not batch:
            return []
        waves = [to_model_audio(audio, rate) for audio, rate, _, _ in batch]
        for wave in waves:
            if len(wave) / SAMPLE_RATE > self.max_audio_s:
                raise ValueError(
                    f"aligner input is {len(wave) / SAMPLE_RATE:.1f} s; the limit is {self.max_audio_s:.0f} s"
                )
            if len(wave) < HOP:
                raise ValueError("aligner input is shorter than 10 ms")
        words = [self.splitter.words(text, language) for _, _, text, language in batch]
        times = self.slot_times_ms(waves, words)
        results: list[list[AlignedWord]] = []
        for (_, _, text, _), units, slot_ms in zip(batch, words, times, strict=True):
            spans = display_spans(text, locate_units(text, units))
            results.append(
                [
                    AlignedWord(
                        text=text[start:end],
                        start_s=round(slot_ms[2 * i] / 1000.0, 3),
                        end_s=round(slot_ms[2 * i + 1] / 1000.0, 3),
                        char_start=start,
                        char_end=end,
                    )
                    for i, (start, end) in enumerate(spans)
                ]
            )
        return results
