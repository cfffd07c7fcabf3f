"""Speaker encoder of the Base models: ECAPA-TDNN over a 128-bin log-mel of 24 kHz audio.

Weight-compatible with the checkpoint's `speaker_encoder.*` tensors (prefix stripped). Its output
(an x-vector of size `enc_dim`, equal to the talker hidden size) fills one slot of the talker's
codec track for voice clones. Cold path: runs once per reference clip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

SAMPLE_RATE = 24000
N_FFT, HOP, WIN, N_MELS, F_MIN, F_MAX = 1024, 256, 1024, 128, 0.0, 12000.0


# ----------------------------------------------------------------------------------------------
# Log-mel features (Slaney-scale, Slaney-normalised filterbank; magnitude STFT, no centring).
# ----------------------------------------------------------------------------------------------

_LOG_STEP = math.log(6.4) / 27.0  # Slaney mel scale: linear below 1 kHz, logarithmic above
_LINEAR_STEP = 200.0 / 3.0
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_STEP


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    safe = np.maximum(hz, _BREAK_HZ)
    return np.where(hz < _BREAK_HZ, hz / _LINEAR_STEP, _BREAK_MEL + np.log(safe / _BREAK_HZ) / _LOG_STEP)


def _mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.where(mel < _BREAK_MEL, mel * _LINEAR_STEP, _BREAK_HZ * np.exp(_LOG_STEP * (mel - _BREAK_MEL)))


@lru_cache(maxsize=4)
def mel_filterbank(
    sr: int = SAMPLE_RATE,
    n_fft: int = N_FFT,
    n_mels: int = N_MELS,
    f_min: float = F_MIN,
    f_max: float = F_MAX,
) -> npt.NDArray[np.float32]:
    """[n_mels, n_fft // 2 + 1] triangular filters with area normalisation (librosa's defaults)."""
    bins_hz = np.linspace(0.0, sr / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(f_min)), _hz_to_mel(np.array(f_max)), n_mels + 2))
    width = np.diff(edges)
    dist = edges[:, None] - bins_hz[None, :]
    rising = -dist[:-2] / width[:-1, None]
    falling = dist[2:] / width[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


def speaker_mel(audio_24k: Tensor | npt.NDArray[np.float32]) -> Tensor:
    """Mono 24 kHz audio [T] -> log-mel [1, frames, 128] (fp32, on the audio's device)."""
    y = torch.as_tensor(audio_24k, dtype=torch.float32).reshape(1, -1)
    pad = (N_FFT - HOP) // 2
    y = F.pad(y[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(WIN, device=y.device)
    spec = torch.stft(
        y,
        N_FFT,
        hop_length=HOP,
        win_length=WIN,
        window=window,
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.from_numpy(mel_filterbank()).to(y.device) @ magnitude
    return torch.log(mel.clamp(min=1e-5)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# ECAPA-TDNN
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """The `speaker_encoder_config` of config.json (defaults as upstream)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> SpeakerEncoderConfig:
        known = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in known}
        out = cls(**values)  # type: ignore[arg-type]
        if not len(out.enc_channels) == len(out.enc_kernel_sizes) == len(out.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations need the same length")
        return out


def _same_conv(c_in: int, c_out: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Dilated 'same' conv with reflect padding, then ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _same_conv(c_in, c_out, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Split channels into `scale` groups; group i sees its input plus group i-1's output."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        prev: Tensor | None = None
        for block, part in zip(self.blocks, parts[1:], strict=True):
            prev = block(part if prev is None else part + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, bottleneck: int) -> None:
        super().__init__()
        self.conv1 = _same_conv(channels, bottleneck)
        self.conv2 = _same_conv(bottleneck, channels)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: int, se: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1, 1)
        self.res2net_block = Res2Net(c_out, scale, kernel, dilation)
        self.tdnn2 = TDNN(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcite(c_out, se)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _mean_std(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean[..., None]).pow(2)).sum(dim=2)
    return mean, var.clamp(min=1e-12).sqrt()


class AttentiveStatsPool(nn.Module):
    """Per-channel attention over time (conditioned on global mean/std), then weighted mean/std."""

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention, 1, 1)
        self.conv = _same_conv(attention, channels)

    def forward(self, x: Tensor) -> Tensor:
        frames = x.shape[-1]
        mean, std = _mean_std(x, torch.full_like(x[:, :1], 1.0 / frames))
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _mean_std(x, attn)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any] | SpeakerEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg if isinstance(cfg, SpeakerEncoderConfig) else SpeakerEncoderConfig.from_dict(cfg)
        c = self.cfg
        ch, ks, dil = c.enc_channels, c.enc_kernel_sizes, c.enc_dilations
        blocks: list[nn.Module] = [TDNN(c.mel_dim, ch[0], ks[0], dil[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(
                SERes2NetBlock(ch[i - 1], ch[i], c.enc_res2net_scale, c.enc_se_channels, ks[i], dil[i])
            )
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], c.enc_attention_channels)
        self.fc = _same_conv(ch[-1] * 2, c.enc_dim)

    def forward(self, mels: Tensor) -> Tensor:
        """mels [B, frames, mel_dim] -> x-vectors [B, enc_dim]."""
        h = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        h = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(h))[..., 0]

    @torch.inference_mode()
    def embed(self, audio_24k: Tensor | npt.NDArray[np.float32]) -> Tensor:
        """Mono 24 kHz audio [T] -> speaker embedding [enc_dim] (module dtype and device)."""
        p = next(self.parameters())
        mels = speaker_mel(torch.as_tensor(audio_24k, dtype=torch.float32).to(p.device))
        return self(mels.to(p.dtype))[0]
