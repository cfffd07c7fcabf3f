"""A tiny random Qwen3-ForcedAligner checkpoint in the real layout, built with the reference classes.

The tokenizer is a small byte-level BPE saved as vocab.json + merges.txt (the files our loader
reads); the reference converts those same files into its fast Qwen2 tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.qwen_reference import import_qwen_asr

SPECIALS = ["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<timestamp>"]
CORPUS = [
    "hello world this is a test of the forced aligner, don't stop 2024",
    "the quick brown fox jumps over the lazy dog",
    "甚至出现交易几乎停滞的情况。今天天气很好",
    "今日はいい天気ですね。東京都に住んでいます。すごいと言った",
]


def _train_tokenizer(root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    tokenizer.model.save(str(root))  # vocab.json + merges.txt


def build_tiny_checkpoint(root: Path, seed: int = 0) -> Path:
    """Write config.json, tokenizer files, preprocessor config and model.safetensors into ``root``."""
    qwen_asr = import_qwen_asr()
    from qwen_asr.core.transformers_backend import (
        Qwen3ASRConfig,
        Qwen3ASRForConditionalGeneration,
        Qwen3ASRProcessor,
    )
    from transformers import Qwen2TokenizerFast, WhisperFeatureExtractor

    assert qwen_asr is not None
    root.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(root)
    tokenizer = Qwen2TokenizerFast(
        vocab_file=str(root / "vocab.json"),
        merges_file=str(root / "merges.txt"),
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "audio_token": "<|audio_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    features = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400)
    Qwen3ASRProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(str(root))

    config = Qwen3ASRConfig(
        thinker_config=dict(
            model_type="qwen3_forced_aligner",
            classify_num=5000,
            audio_token_id=ids["<|audio_pad|>"],
            audio_start_token_id=ids["<|audio_start|>"],
            audio_end_token_id=ids["<|audio_end|>"],
            audio_config=dict(
                num_mel_bins=128,
                encoder_layers=2,
                encoder_attention_heads=4,
                encoder_ffn_dim=128,
                d_model=64,
                output_dim=64,
                n_window=50,
                n_window_infer=800,
                downsample_hidden_size=32,
                max_source_positions=1500,
            ),
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_theta=1e6,
                tie_word_embeddings=False,
                rope_scaling={
                    "rope_type": "default",
                    "interleaved": True,
                    "mrope_interleaved": True,
                    "mrope_section": [4, 2, 2],
                },
            ),
        ),
        timestamp_token_id=ids["<timestamp>"],
        timestamp_segment_time=80,
        support_languages=["Chinese", "English", "Japanese"],
    )
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config)
    with torch.no_grad():  # context-dominated hidden states, so slot classes vary along the text
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.02)
            elif param.dim() >= 2:
                param.normal_(0.0, 2.0 / param[0].numel() ** 0.5)
    model.save_pretrained(str(root))
    # The saved config carries the class's model_type; the real checkpoint says forced aligner,
    # which is what gives the head 5000 classes on load.
    raw = json.loads((root / "config.json").read_text())
    raw["thinker_config"]["model_type"] = "qwen3_forced_aligner"
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    return root
