"""The fused decoder layers (engine.qwen3.models.fused_layer) against the eager layers at the real 1.7B
widths, and their CUDA graphs against eager replays of the same fused code (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.qwen3.models import fused_layer
from engine.qwen3.models.config import DecoderShape
from engine.qwen3.models.layers import DecoderStack, KVCache
from engine.qwen3.runner import Runner

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or fused_layer.triton is None:
    pytest.skip("needs CUDA and Triton", allow_module_level=True)

TALKER = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8)
PREDICTOR = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8)


def stack_pair(widths: dict[str, int], layers: int = 3) -> tuple[DecoderStack, DecoderStack]:
    shape = DecoderShape(
        num_hidden_layers=layers,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
        attention_bias=False,
        hidden_act="silu",
        **widths,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        eager = DecoderStack(shape)
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() > 1:
                p.normal_(std=0.02)
            else:
                p.uniform_(0.5, 1.5)
    eager = eager.to(torch.bfloat16)
    fused = copy.deepcopy(eager)
    fused.fuse_layers()
    return eager, fused


def run_both(
    eager: DecoderStack, fused: DecoderStack, x, positions, slots, kv_len, lengths, slot_count, max_len
):
    caches = []
    for _ in range(2):
        c = KVCache.allocate(eager.shape, slot_count, max_len, "cuda", torch.bfloat16)
        caches.append(c)
    torch.manual_seed(1)
    caches[0].k.normal_()
    caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    with torch.no_grad():
        expected = eager.run_layers(x, positions, caches[0], slots, kv_len, lengths)
        got = fused.run_layers(x, positions, caches[1], slots, kv_len, lengths)
    return expected, got, caches


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def test_fusing_keeps_names_values_and_memory():
    eager, fused = stack_pair(TALKER, layers=2)
    assert fused.state_dict().keys() == eager.state_dict().keys()
    for name, value in fused.state_dict().items():
        assert torch.equal(value, eager.state_dict()[name]), name
    attn = fused.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert attn.qkv_weight.shape == (16 * 128 + 2 * 8 * 128, 2048)


def test_talker_decode_with_per_row_lengths_matches_the_eager_layers():
    eager, fused = stack_pair(TALKER)
    b = 64
    x = torch.randn(b, 1, 2048, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(96, device="cuda")[:b]
    positions = torch.randint(0, 400, (b, 1), device="cuda")
    lengths = (positions[:, 0] + 1).to(torch.int32)
    expected, got, caches = run_both(eager, fused, x, positions, slots, 513, lengths, 96, 513)
    assert relative_error(got, expected) < 0.02
    assert relative_error(caches[1].k, caches[0].k) < 0.01  # the new keys landed where eager put them
    rows = slots[:, None], positions
    assert relative_error(caches[1].k[:, rows[0], :, rows[1]], caches[0].k[:, rows[0], :, rows[1]]) < 0.02


def test_talker_prompt_chunk_matches_the_eager_layers():
    eager, fused = stack_pair(TALKER)
    x = torch.randn(4, 16, 2048, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([3, 7, 1, 5], device="cuda")
    positions = torch.arange(16, device="cuda").expand(4, 16) + torch.tensor(
        [[0], [20], [40], [0]], device="cuda"
    )
    expected, got, _ = run_both(eager, fused, x, positions, slots, 64, None, 8, 65)
    assert relative_error(got, expected) < 0.02


@pytest.mark.parametrize("b", [1, 37, 512])
def test_code_predictor_loop_matches_the_eager_layers(b):
    eager, fused = stack_pair(PREDICTOR, layers=5)
    caches = [KVCache.allocate(eager.shape, b, 16, "cuda", torch.bfloat16) for _ in range(2)]
    x = torch.randn(b, 2, 1024, device="cuda").to(torch.bfloat16)
    positions = torch.arange(2, device="cuda").expand(b, 2)
    with torch.no_grad():
        for step in range(4):  # two tokens, then one a step, as CodePredictor.generate
            kv_len = 2 + step
            expected = eager.run_layers(x, positions, caches[0], None, kv_len)
            got = fused.run_layers(x, positions, caches[1], None, kv_len)
            assert relative_error(got, expected) < 0.02, step
            x = expected[:, -1:]
            positions = torch.full((b, 1), kv_len, device="cuda")


def tiny_talker_runner(fused: bool) -> Runner:
    from tests.engine.qwen3.gpu.test_graphs import tiny_runner

    return tiny_runner(torch.bfloat16, codec_frame_buckets=(1,), fused_layers=fused)


def test_the_runner_fuses_its_stacks_at_capture_and_graphs_replay_the_fused_steps():
    r = tiny_talker_runner(fused=True)
    assert r.talker.model.fused and r.talker.code_predictor.model.fused
    assert not tiny_talker_runner(fused=False).talker.model.fused
    b = 4
    r.p_bool[:] = True  # greedy
    r.p_float[:, 2] = 1.0
    r.s_meta[:, :b] = torch.tensor([[0, 1, 2, 6], [3, 3, 0, 0], [48, 48, 0, 0]], device="cuda")
    r.s_hidden[:b].normal_()
    key = ("sample", b, True)
    with torch.no_grad():
        r._sample_fn(b, True)()
        eager = r.s_codes[:b].clone()
        r.s_codes.zero_()
        r.graphs.graphs[key].replay()
        torch.cuda.synchronize()
    assert torch.equal(r.s_codes[:b], eager)
    r.d_meta[:, :b] = torch.tensor([[0, 3, 5, 6], [10, 20, 7, 63], [0, 0, 0, 0], [0, 0, 1, 0]], device="cuda")
    r.d_embeds[:b].normal_()
    k = r.kv_buckets[0]
    with torch.no_grad():
        r._decode_fn(b, k)()
        eager = r.d_hidden[:b].clone()
        r.d_hidden.zero_()
        r.graphs.graphs[("decode", b, k)].replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(r.d_hidden[:b], eager)


def test_fp8_projections_stay_separate_products_beside_the_fused_kernels():
    """An Fp8Linear is not a plain nn.Linear: fusing leaves q/k/v as three products, the kernels serve."""
    from engine.qwen3.models.fp8 import Fp8Linear

    eager, fused = stack_pair(PREDICTOR, layers=1)
    attn = eager.layers[0].self_attn
    attn.q_proj = Fp8Linear.from_linear(attn.q_proj, emulate=True)
    fused = copy.deepcopy(eager)
    fused.fuse_layers()
    assert fused.layers[0].self_attn.qkv_weight is None and fused.layers[0].mlp.gate_up_weight is not None
    caches = [KVCache.allocate(eager.shape, 4, 16, "cuda", torch.bfloat16) for _ in range(2)]
    x = torch.randn(4, 2, 1024, device="cuda").to(torch.bfloat16)
    positions = torch.arange(2, device="cuda").expand(4, 2)
    with torch.no_grad():
        expected = eager.run_layers(x, positions, caches[0], None, 2)
        got = fused.run_layers(x, positions, caches[1], None, 2)
    assert relative_error(got, expected) < 0.02


def test_the_rotation_table_holds_what_rope_cos_sin_computes():
    from engine.qwen3.models.rope import rope_cos_sin

    _, fused = stack_pair(TALKER, layers=1)
    positions = torch.arange(fused.shape.max_position_embeddings, device="cuda").flip(0).reshape(8, -1)
    cos, sin = rope_cos_sin(fused.inv_freq, positions, torch.bfloat16)
    assert torch.equal(fused.rope_cos[positions], cos) and torch.equal(fused.rope_sin[positions], sin)
