"""A tiny random Qwen3 forced aligner built from our own classes (no reference package, ~1 s):
the byte-level BPE of tests/aligner/tiny_checkpoint.py and a 2-layer encoder and decoder."""

from __future__ import annotations

from pathlib import Path

import torch

from aligner.model import AlignerConfig, AudioEncoderConfig, ForcedAlignerModel, TextDecoderConfig
from aligner.qwen3 import Qwen3ForcedAligner, load_word_tokenizer
from tests.aligner.tiny_checkpoint import _train_tokenizer


def tiny_aligner(root: Path, seed: int = 0) -> Qwen3ForcedAligner:
    root.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(root)
    tokenizer = load_word_tokenizer(root)
    vocab = tokenizer.get_vocab_size()
    cfg = AlignerConfig(
        audio=AudioEncoderConfig(layers=2, d_model=64, heads=4, ffn_dim=128, output_dim=64, conv_channels=32),
        text=TextDecoderConfig(
            vocab_size=vocab + 4, hidden=64, ffn_dim=128, layers=2, heads=4, kv_heads=2, head_dim=16
        ),
        audio_token_id=vocab,
        audio_start_token_id=vocab + 1,
        audio_end_token_id=vocab + 2,
        timestamp_token_id=vocab + 3,
    )
    torch.manual_seed(seed)
    model = ForcedAlignerModel(cfg).eval()
    with torch.no_grad():  # context-dominated hidden states, so slot classes vary along the text
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.02)
            elif param.dim() >= 2:
                param.normal_(0.0, 2.0 / param[0].numel() ** 0.5)
    return Qwen3ForcedAligner(model, tokenizer)
