"""Code2Wav in bf16 with its fused kernels (RMSNorm, rotary embedding, SnakeBeta, residual) against
the same model on the eager ops, streamed over several steps (skipped without CUDA and Triton)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models import fused_conv, fused_norm, fused_rope, fused_snake
from engine.qwen3.models.codec import Code2Wav

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or fused_snake.triton is None:
    pytest.skip("needs CUDA and Triton", allow_module_level=True)

# the real decoder's attention (16 heads of 64) and a narrow convolution stack
DECODER = dict(
    codebook_dim=64,
    codebook_size=2048,
    latent_dim=128,
    hidden_size=512,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    sliding_window=8,
    decoder_dim=128,
)


def streamed(model: Code2Wav, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    slots = torch.arange(codes.shape[0], device="cuda")
    model.reset(slots)
    out, at = [], 0
    for n in chunks:
        out.append(model.decode_step(slots, codes[:, at : at + n]))
        at += n
    return torch.cat(out, dim=1).float()


@torch.no_grad()
def test_fused_kernels_match_the_eager_ops(monkeypatch):
    torch.manual_seed(0)
    model = Code2Wav(DECODER)
    for name, p in model.named_parameters():
        if name.endswith("embedding_sum"):
            p.data.normal_()
    model.quantizer.refresh()
    model = model.to("cuda", torch.bfloat16).eval()
    model.init_streams(4)
    codes = torch.randint(0, 2048, (3, 12, 16), device="cuda")
    chunks = [1, 2, 4, 5]  # past the 8-frame window
    fused = streamed(model, codes, chunks)
    guards = (fused_norm.guard, fused_rope.guard, fused_conv.guard)
    assert all(g.enabled for g in guards)  # the fused path served
    try:
        for g in guards:
            g.enabled = False
        with monkeypatch.context() as patch:
            patch.setattr(fused_snake, "available", lambda x: False)
            eager = streamed(model, codes, chunks)
    finally:
        for g in guards:
            g.enabled = True
    assert fused.abs().max() > 0.01  # audio, not silence
    torch.testing.assert_close(fused, eager, atol=2e-2, rtol=0)
