"""Speaker encoder and its log-mel against the reference (upstream `qwen_tts`, fp32 CPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.qwen3.models.speaker import SpeakerEncoder, mel_filterbank, speaker_mel
from tests.qwen_reference import import_qwen_tts

pytestmark = pytest.mark.reference

TINY = dict(
    mel_dim=128,
    enc_dim=64,
    enc_channels=[32, 32, 32, 32, 96],
    enc_kernel_sizes=[5, 3, 3, 3, 1],
    enc_dilations=[1, 2, 3, 4, 1],
    enc_attention_channels=16,
    enc_res2net_scale=8,
    enc_se_channels=16,
    sample_rate=24000,
)


def voice_like(seconds: float, f0: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(24000 * seconds)) / 24000
    wav = sum(np.sin(2 * np.pi * f0 * k * t * (1 + 0.02 * np.sin(3 * t))) / k for k in range(1, 8))
    wav = wav * (0.5 + 0.5 * np.sin(2 * np.pi * 2.5 * t) ** 2) + 0.01 * rng.standard_normal(t.size)
    return (0.3 * wav / np.abs(wav).max()).astype(np.float32)


@pytest.fixture(scope="module")
def modeling() -> Any:
    import_qwen_tts()
    from qwen_tts.core.models import modeling_qwen3_tts

    return modeling_qwen3_tts


@pytest.fixture(scope="module")
def pair(modeling: Any) -> tuple[Any, SpeakerEncoder]:
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    torch.manual_seed(0)
    ref = modeling.Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**TINY)).eval()
    ours = SpeakerEncoder(TINY).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def reference_mel(modeling: Any, wav: np.ndarray) -> torch.Tensor:
    return modeling.mel_spectrogram(
        torch.from_numpy(wav)[None],
        n_fft=1024,
        num_mels=128,
        sampling_rate=24000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)


def test_filterbank_equals_librosa_slaney() -> None:
    librosa_filters = pytest.importorskip("librosa.filters")
    expected = librosa_filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    np.testing.assert_allclose(mel_filterbank(), expected, rtol=1e-5, atol=1e-7)


def test_log_mel_equals_reference(modeling: Any) -> None:
    wav = voice_like(1.7, 140.0, seed=1)
    mel = speaker_mel(torch.from_numpy(wav))
    expected = reference_mel(modeling, wav)
    assert mel.shape == expected.shape == (1, expected.shape[1], 128)
    torch.testing.assert_close(mel, expected, atol=1e-4, rtol=1e-5)


def test_weight_names_match(pair: tuple[Any, SpeakerEncoder]) -> None:
    ref, ours = pair
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }


@pytest.mark.parametrize("seconds", [1.0, 3.3])
def test_embedding_equals_reference(modeling: Any, pair: tuple[Any, SpeakerEncoder], seconds: float) -> None:
    ref, ours = pair
    wav = voice_like(seconds, 180.0, seed=2)
    with torch.no_grad():
        expected = ref(reference_mel(modeling, wav))[0]
    emb = ours.embed(wav)
    assert emb.shape == (64,)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(emb, expected, atol=1e-5, rtol=1e-4)


def test_embedding_tells_voices_apart(pair: tuple[Any, SpeakerEncoder]) -> None:
    _, ours = pair
    a, b = ours.embed(voice_like(2.0, 110.0, seed=3)), ours.embed(voice_like(2.0, 260.0, seed=3))
    assert not torch.allclose(a, b, atol=1e-3)
