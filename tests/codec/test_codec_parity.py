"""Our Code2Wav against the reference decoder (upstream `qwen_tts`, same weights, fp32 CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.models.codec import Code2Wav
from tests.codec.conftest import SAMPLES_PER_FRAME, random_codes, tiny_tokenizer_config_dict

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def ours(reference_tokenizer: Any) -> Code2Wav:
    model = Code2Wav(tiny_tokenizer_config_dict()["decoder_config"]).eval()
    model.load_state_dict(reference_tokenizer.decoder.state_dict(), strict=True)
    return model


def test_weight_names_and_shapes_match_the_checkpoint(reference_tokenizer: Any, ours: Code2Wav) -> None:
    theirs = {k: tuple(v.shape) for k, v in reference_tokenizer.decoder.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == theirs


def test_waveform_equals_reference_forward(reference_tokenizer: Any, ours: Code2Wav) -> None:
    codes = random_codes(2, 100, seed=3)  # longer than the 72-frame attention window
    with torch.no_grad():
        expected = reference_tokenizer.decoder(codes.transpose(1, 2)).squeeze(1)
        wav = ours.decode(codes)
    assert wav.shape == (2, 100 * SAMPLES_PER_FRAME)
    assert expected.std() > 0.05
    torch.testing.assert_close(wav, expected, atol=1e-4, rtol=0)


def test_padded_batch_equals_reference_decode(reference_tokenizer: Any, ours: Code2Wav) -> None:
    """Upstream pads shorter rows with -1 and trims each to len * 1920; we decode -1 as code 0."""
    codes = random_codes(2, 40, seed=4)
    codes[1, 25:] = -1
    with torch.no_grad():
        expected = reference_tokenizer.decode(codes, return_dict=True).audio_values
        wav = ours.decode(codes)
    torch.testing.assert_close(wav[0], expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(wav[1, : 25 * SAMPLES_PER_FRAME], expected[1], atol=1e-4, rtol=0)


def test_reference_chunked_decode_has_seams_we_do_not(reference_tokenizer: Any, ours: Code2Wav) -> None:
    """Upstream `decode` cuts sequences into 300-frame chunks with only 25 frames of left context
    (less than the attention window and the conv receptive field), so past frame 300 it drifts
    from the exact whole-sequence forward. Ours is exact: it matches the forward everywhere."""
    codes = random_codes(1, 330, seed=5)
    cut = 300 * SAMPLES_PER_FRAME
    with torch.no_grad():
        exact = reference_tokenizer.decoder(codes.transpose(1, 2)).squeeze(1)
        chunked = reference_tokenizer.decode(codes, return_dict=True).audio_values[0]
        wav = ours.decode(codes)
    torch.testing.assert_close(chunked[:cut], exact[0, :cut], atol=1e-4, rtol=0)
    assert (chunked[cut:] - exact[0, cut:]).abs().max() > 1e-3
    torch.testing.assert_close(wav, exact, atol=1e-4, rtol=0)
