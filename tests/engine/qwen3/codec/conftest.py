"""Tiny random reference speech tokenizer (the upstream `qwen_tts` classes) for parity tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.qwen_reference import import_qwen_tts

SAMPLES_PER_FRAME = 1920


def tiny_tokenizer_config_dict() -> dict[str, Any]:
    """Real rates (24 kHz, 1920 samples per frame, 16 codebooks), toy widths."""
    return dict(
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
            num_quantizers=32,
            upsampling_ratios=[8, 6, 5, 4],
        ),
        decoder_config=dict(
            codebook_size=2048,
            codebook_dim=16,
            latent_dim=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=72,
            num_quantizers=16,
            decoder_dim=64,
            upsample_rates=[8, 5, 4, 3],
            upsampling_ratios=[2, 2],
        ),
        encoder_valid_num_quantizers=16,
        input_sample_rate=24000,
        output_sample_rate=24000,
        decode_upsample_rate=1920,
        encode_downsample_rate=1920,
    )


@torch.no_grad()
def liven_decoder(decoder: torch.nn.Module, seed: int = 0) -> None:
    """Random init leaves codebooks at zero and residual scales near zero, which would make
    parity trivially true; draw every decoder weight so each stage shapes the output."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in decoder.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embedding_sum":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif leaf == "cluster_usage":
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif leaf in ("scale", "gamma"):
            p.copy_(torch.rand(p.shape, generator=gen) * 0.5 + 0.25)
        elif leaf in ("alpha", "beta"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    for mod in decoder.modules():
        if isinstance(mod, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
            fan = mod.weight[0].numel() if isinstance(mod, torch.nn.Conv1d) else mod.weight.shape[-1]
            if isinstance(mod, torch.nn.ConvTranspose1d):
                fan = mod.weight.shape[0] * mod.weight.shape[2] // mod.stride[0]
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) / fan**0.5)
            if mod.bias is not None:
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * 0.02)
    # keep each residual unit's contribution small so levels stay near 1 and the output unclipped
    for name, mod in decoder.named_modules():
        if name.endswith("conv2.conv"):
            mod.weight.mul_(0.15)
    decoder.decoder[-1].conv.weight.mul_(0.15)


@pytest.fixture(scope="session")
def reference_tokenizer() -> Any:
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    torch.manual_seed(0)
    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**tiny_tokenizer_config_dict())).eval()
    liven_decoder(model.decoder)
    with torch.no_grad():  # Mimi's codebooks start at zero too (every frame -> code 0)
        gen = torch.Generator().manual_seed(1)
        for name, buf in model.encoder.named_buffers():
            if name.endswith("embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=gen))
    return model


def random_codes(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (batch, frames, 16), generator=gen)


@pytest.fixture(scope="session")
def codec() -> Any:
    """Our tiny Code2Wav with lively random weights (fp32, CPU); no reference package needed."""
    from engine.qwen3.models.codec import Code2Wav

    model = Code2Wav(tiny_tokenizer_config_dict()["decoder_config"]).eval()
    liven_decoder(model)
    model.quantizer.refresh()
    return model
