"""Our Code2Wav against the reference decoder (upstream `qwen_tts`, same weights, fp32 CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.qwen3.models.codec import Code2Wav
from tests.engine.qwen3.codec.conftest import SAMPLES_PER_FRAME, random_codes, tiny_tokenizer_config_dict

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


# ---- a complete tiny checkpoint directory in the upstream layout ------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.reference_builders import build_reference_tts, load_reference

    path = build_reference_tts("base", tmp_path_factory.mktemp("base"))
    return path, load_reference(path)


def test_loaded_speech_tokenizer_matches_reference(checkpoint: Any) -> None:
    from engine.qwen3.models.speech_tokenizer import load_speech_tokenizer
    from tests.engine.qwen3.codec.test_speaker import voice_like

    path, ref = checkpoint
    ours = load_speech_tokenizer(path / "speech_tokenizer")
    assert (ours.sample_rate, ours.samples_per_frame) == (24000, 1920)
    wav = voice_like(2.3, 150.0, seed=4)
    expected = ref.model.speech_tokenizer.encode(wav, sr=24000).audio_codes[0]
    codes = ours.encode(wav)
    assert codes.dtype == torch.long and codes.shape == (-(-wav.size // 1920), 16)
    assert torch.equal(codes, expected)
    wavs, sr = ref.model.speech_tokenizer.decode([{"audio_codes": codes}])
    decoded = ours.decoder.decode(codes[None])[0]
    assert sr == 24000
    torch.testing.assert_close(decoded, torch.from_numpy(wavs[0]), atol=1e-4, rtol=0)


def test_speaker_encoder_from_checkpoint_matches_reference(checkpoint: Any) -> None:
    import json

    from safetensors.torch import load_file

    from engine.qwen3.models.speaker import SpeakerEncoder
    from tests.engine.qwen3.codec.test_speaker import voice_like

    path, ref = checkpoint
    cfg = json.loads((path / "config.json").read_text())["speaker_encoder_config"]
    weights = load_file(str(path / "model.safetensors"))
    enc = SpeakerEncoder(cfg).eval()
    prefix = "speaker_encoder."
    enc.load_state_dict(
        {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True
    )
    wav = voice_like(1.6, 120.0, seed=5)
    expected = ref.model.extract_speaker_embedding(wav, 24000)
    torch.testing.assert_close(enc.embed(wav), expected, atol=1e-5, rtol=1e-4)


def test_missing_files_are_named(tmp_path: Any) -> None:
    from engine.qwen3.models.speech_tokenizer import load_speech_tokenizer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors, preprocessor_config.json"):
        load_speech_tokenizer(tmp_path)


def test_missing_tensors_are_named_and_extra_ones_ignored(checkpoint: Any, tmp_path: Any) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.qwen3.models.speech_tokenizer import load_speech_tokenizer

    path, _ = checkpoint
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(path / "speech_tokenizer" / name, tmp_path / name)
    weights = load_file(str(path / "speech_tokenizer" / "model.safetensors"))
    weights["decoder.pre_transformer.rotary_emb.inv_freq"] = torch.ones(8)  # harmless extra
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert load_speech_tokenizer(tmp_path).decoder.samples_per_frame == 1920
    del weights["decoder.pre_conv.conv.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks decoder.pre_conv.conv.weight"):
        load_speech_tokenizer(tmp_path)


def test_encoder_keeps_the_first_16_of_32_quantizers(reference_tokenizer: Any, tmp_path: Any) -> None:
    """The released Mimi encoder has 32 quantizers; reference codes use the first 16."""
    from transformers import EncodecFeatureExtractor

    from engine.qwen3.models.speech_tokenizer import load_speech_tokenizer
    from tests.engine.qwen3.codec.test_speaker import voice_like

    assert reference_tokenizer.encoder.config.num_quantizers == 32
    reference_tokenizer.save_pretrained(tmp_path)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(tmp_path)
    ours = load_speech_tokenizer(tmp_path)
    wav = voice_like(1.3, 200.0, seed=6)
    x = torch.from_numpy(wav)[None]
    with torch.no_grad():
        expected = reference_tokenizer.encode(
            x, torch.ones_like(x, dtype=torch.long), return_dict=True
        ).audio_codes[0]
    codes = ours.encode(wav)
    assert codes.shape == expected.shape == (-(-wav.size // 1920), 16)
    assert torch.equal(codes, expected)
    assert len(torch.unique(codes)) > 16  # not a degenerate constant code
