"""Tiny random Qwen3-TTS-12Hz checkpoints built and saved with the reference `qwen_tts` package, in
the upstream layout, for parity tests:

    config.json, model.safetensors, generation_config.json        (save_pretrained)
    vocab.json, merges.txt, tokenizer_config.json                 (a small real byte-level BPE)
    speech_tokenizer/{config.json, model.safetensors, preprocessor_config.json}

Sizes are toys; the token-id layout (codec vocab 3072 with its control ids, 16 code groups, 12.5 Hz
at 24 kHz) is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.qwen_reference import import_qwen_tts

BPE_CORPUS = [
    "assistant\n",
    "user\n",
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Speak slowly, with a calm and deep voice. A bright cheerful young woman.",
    "This is a test of the speech engine; numbers 1234 and 56 should work too!",
    "Reference words for the cloned voice, spoken clearly.",
    "Good morning, how are you today? I am fine, thank you.",
]
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
)
TEXT_VOCAB = 512

LANGUAGES = {
    "english": 2050,
    "chinese": 2055,
    "japanese": 2058,
    "sichuan_dialect": 2062,
    "beijing_dialect": 2074,
}
SPEAKERS = {"ryan": 3061, "vivian": 3065, "eric": 2875, "dylan": 2878}
DIALECTS: dict[str, str | bool] = {
    "ryan": False,
    "vivian": False,
    "eric": "sichuan_dialect",
    "dylan": "beijing_dialect",
}
GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "max_new_tokens": 8192,
}


def build_reference_tokenizer(tmp_dir: str | Path) -> dict[str, int]:
    """Write vocab.json, merges.txt, tokenizer_config.json (Qwen2 byte-level BPE trained on a tiny
    corpus, ChatML/tts special tokens right after the BPE vocabulary). Returns the special ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from engine.qwen3.tokenizer import QWEN2_PATTERN, build_bpe

    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = build_bpe({}, [], QWEN2_PATTERN).pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=440, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_tok.train_from_iterator(BPE_CORPUS * 20, trainer=trainer)
    trainer_tok.model.save(str(out))  # vocab.json + merges.txt
    vocab_size = trainer_tok.get_vocab_size()
    special = {tok: vocab_size + i for i, tok in enumerate(SPECIAL_TOKENS)}
    assert max(special.values()) < TEXT_VOCAB
    token_entry = {
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    tok_cfg = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, **token_entry} for t, i in special.items()},
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    return special


def tiny_tts_config(kind: str, special: dict[str, int], size: str = "1b7") -> Any:
    qwen_tts = import_qwen_tts()
    hidden, head_dim = 64, 16
    cp = dict(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        rope_theta=1_000_000,
        num_code_groups=16,
        pad_token_id=None,
    )
    talker = dict(
        vocab_size=3072,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=1_000_000,
        rope_scaling={
            "rope_type": "default",
            "interleaved": True,
            "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
        },
        text_vocab_size=TEXT_VOCAB,
        text_hidden_size=32,
        num_code_groups=16,
        codec_pad_id=2148,
        codec_bos_id=2149,
        codec_eos_token_id=2150,
        codec_think_id=2154,
        codec_nothink_id=2155,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        codec_language_id=dict(LANGUAGES),
        spk_id=dict(SPEAKERS),
        spk_is_dialect=dict(DIALECTS),
        code_predictor_config=cp,
    )
    spk = dict(
        mel_dim=128,
        enc_dim=hidden,
        enc_channels=[32, 32, 32, 32, 96],
        enc_kernel_sizes=[5, 3, 3, 3, 1],
        enc_dilations=[1, 2, 3, 4, 1],
        enc_attention_channels=16,
        enc_res2net_scale=8,
        enc_se_channels=16,
        sample_rate=24000,
    )
    return qwen_tts.core.models.Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=spk,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=size,
        tts_model_type=kind,
        tts_pad_token_id=special["<tts_pad>"],
        tts_bos_token_id=special["<tts_text_bos>"],
        tts_eos_token_id=special["<tts_text_eod>"],
        im_start_token_id=special["<|im_start|>"],
        im_end_token_id=special["<|im_end|>"],
    )


def tiny_speech_tokenizer_config() -> Any:
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config

    return Qwen3TTSTokenizerV2Config(
        encoder_config=dict(
            hidden_size=32,
            num_filters=4,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            upsample_groups=32,
            codebook_size=2048,
            codebook_dim=16,
            vector_quantization_hidden_dimension=16,
            num_quantizers=16,
            upsampling_ratios=[8, 6, 5, 4],
        ),
        decoder_config=dict(
            codebook_size=2048,
            codebook_dim=16,
            latent_dim=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=72,
            num_quantizers=16,
            decoder_dim=32,
            upsample_rates=[8, 5, 4, 3],
            upsampling_ratios=[2, 2],
        ),
        encoder_valid_num_quantizers=16,
        input_sample_rate=24000,
        output_sample_rate=24000,
        decode_upsample_rate=1920,
        encode_downsample_rate=1920,
    )


def _spread_weights(model: torch.nn.Module, std: float) -> None:
    """Wider random weights than HF's std 0.02, so greedy choices are well separated."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "speaker_encoder" in name:
                continue
            if p.dim() >= 2:
                p.normal_(0.0, std)


def build_reference_tts(
    kind: str, tmp_dir: str | Path, *, size: str = "1b7", seed: int = 0, eos_after_code: int | None = None
) -> Path:
    """Build a tiny random reference model of `kind` ("custom_voice", "voice_design", "base") and
    save a complete checkpoint directory. `eos_after_code`: copy that code's head row (scaled up)
    onto EOS, so greedy generation ends where it would have picked the code."""
    import_qwen_tts()
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    from transformers import EncodecFeatureExtractor

    out = Path(tmp_dir)
    special = build_reference_tokenizer(out)
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(tiny_tts_config(kind, special, size)).eval()
    _spread_weights(model.talker, 0.08)
    if eos_after_code is not None:
        with torch.no_grad():
            head = model.talker.codec_head.weight
            head[2150] = head[eos_after_code] * 1.5
    model.save_pretrained(out)
    _strip_sub_config_model_type(out / "config.json")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=1))

    st = Qwen3TTSTokenizerV2Model(tiny_speech_tokenizer_config()).eval()
    with torch.no_grad():
        for name, p in st.named_parameters():
            if name.endswith("embedding_sum"):
                p.normal_()
        for mod in st.decoder.modules():
            if isinstance(mod, torch.nn.Conv1d | torch.nn.ConvTranspose1d | torch.nn.Linear):
                mod.reset_parameters()
    st.save_pretrained(out / "speech_tokenizer")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(out / "speech_tokenizer")
    return out


def _strip_sub_config_model_type(config_path: Path) -> None:
    """save_pretrained writes a model_type into speaker_encoder_config that the reference config
    class then refuses to read back; the released config.json files have none."""
    raw = json.loads(config_path.read_text())
    (raw.get("speaker_encoder_config") or {}).pop("model_type", None)
    config_path.write_text(json.dumps(raw, indent=2))


def load_reference(path: str | Path) -> Any:
    """The reference wrapper (`Qwen3TTSModel`) loaded from a checkpoint directory, CPU fp32."""
    qwen_tts = import_qwen_tts()
    return qwen_tts.Qwen3TTSModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")


def load_ours(path: str | Path, device: str = "cpu") -> tuple[Any, Any]:
    """Our loader's bundle (fp32) and Code2Wav decoder for a checkpoint written by build_reference_tts."""
    from engine.qwen3.loader import load_qwen3_tts, read_tensors, weight_files
    from engine.qwen3.models.codec import Code2Wav

    path = Path(path)
    bundle = load_qwen3_tts(path, device, torch.float32)
    st = path / "speech_tokenizer"
    codec = Code2Wav(json.loads((st / "config.json").read_text())["decoder_config"])
    codec.load_state_dict(read_tensors(weight_files(st), "decoder."), strict=True)
    return bundle, codec.to(device).eval()
