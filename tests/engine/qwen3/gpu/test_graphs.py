"""CUDA-graph replay equals eager execution: talker decode step, sampling + code-predictor loop,
Code2Wav streaming step (tiny random model; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.models.codec import Code2Wav
from engine.qwen3.models.config import parse_config
from engine.qwen3.models.talker import Talker
from engine.qwen3.runner import RowSampling, Runner, RunnerConfig, _pcm16

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def tiny_config() -> dict:
    decoder = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    return dict(
        model_type="qwen3_tts",
        tts_model_type="custom_voice",
        tts_model_size="1b7",
        talker_config=dict(
            decoder,
            vocab_size=3072,
            text_vocab_size=512,
            text_hidden_size=64,
            num_code_groups=16,
            codec_pad_id=2148,
            codec_bos_id=2149,
            codec_eos_token_id=2150,
            codec_think_id=2154,
            codec_nothink_id=2155,
            codec_think_bos_id=2156,
            codec_think_eos_id=2157,
            codec_language_id={"english": 2050},
            spk_id={"ryan": 3061},
            spk_is_dialect={"ryan": False},
            rope_scaling=dict(mrope_section=[4, 2, 2], interleaved=True, rope_type="default"),
            code_predictor_config=dict(
                decoder, hidden_size=32, head_dim=16, vocab_size=2048, num_code_groups=16
            ),
        ),
    )


CODEC = dict(
    codebook_dim=16,
    codebook_size=2048,
    latent_dim=32,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    decoder_dim=64,
)


def tiny_runner(
    dtype: torch.dtype = torch.float32,
    codec_frame_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 25),
    **config: object,
) -> Runner:
    """A captured runner over the tiny random model: 8 slots with sampling settings, random caches."""
    torch.manual_seed(0)
    cfg = parse_config(tiny_config())
    with torch.device("cuda"):
        talker = Talker(cfg.talker).eval().to(dtype)
        codec = Code2Wav(CODEC).eval()
        for p in codec.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.1)
    talker.reset_rope("cuda")
    r = Runner(
        talker,
        codec,
        cfg,
        RunnerConfig(max_len=64, max_codec_batch=4, **config),  # type: ignore[arg-type]
        num_slots=8,
        codec_slots=4,
        max_batch=8,
        codec_frame_buckets=codec_frame_buckets,
    )
    with torch.no_grad():
        for slot in range(8):
            r.p_float[slot] = torch.tensor([0.9, 1.0, 1.0, 0.9, 1.0])
            r.p_int[slot] = torch.tensor([50, 50, 1234 + slot, 0, 1 << 30])
        r.cache.k.normal_()
        r.cache.v.normal_()
        r.last_codes.random_(0, 2048)
    r.capture()
    return r


@pytest.fixture(scope="module")
def runner() -> Runner:
    return tiny_runner(kv_buckets=(32,))


def _eager_then_graph(runner: Runner, key, fn, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        fn()
        eager = out.clone()
        out.zero_()
        runner.graphs.graphs[key].replay()
        torch.cuda.synchronize()
    return eager, out.clone()


def test_talker_decode_graph_equals_eager(runner):
    b, k = 4, runner.kv_buckets[0]
    runner.d_meta[:, :b] = torch.tensor(
        [[0, 3, 5, 8], [10, 20, 7, 64], [0, 0, 0, 0], [0, 0, 1, 0]], device="cuda"
    )
    runner.d_embeds[:b].normal_()  # row 2 is a prompt position: its input comes from d_embeds
    eager, graph = _eager_then_graph(runner, ("decode", b, k), runner._decode_fn(b, k), runner.d_hidden[:b])
    torch.testing.assert_close(graph, eager)
    assert eager.abs().sum() > 0


def test_prefill_graph_equals_eager(runner):
    r, t = 2, 8
    runner.p_embeds[:r, :t].normal_()
    runner.p_pos[:r, :t] = torch.tensor([list(range(5, 13)), [0, 1, 2] + [runner.scratch] * 5], device="cuda")
    runner.p_rows[:, :r] = torch.tensor([[1, 6], [7, 2]], device="cuda")  # slots, last real position
    eager, graph = _eager_then_graph(runner, ("prefill", r, t), runner._prefill_fn(r, t), runner.p_hidden[:r])
    torch.testing.assert_close(graph, eager)
    assert eager.abs().sum() > 0


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("greedy", [True, False])
def test_sampling_and_code_predictor_graph_equals_eager(runner, greedy, bounded):
    b = 4
    runner.p_bool[:] = greedy
    runner.p_float[:, 2] = 1.0  # no repetition penalty: the seen-mask update cannot change a rerun
    runner.s_meta[:, :b] = torch.tensor([[0, 1, 2, 8], [3, 3, 0, 0], [48, 48, 0, 0]], device="cuda")
    runner.s_hidden[:b].normal_()
    key = ("sample", b, bounded)
    eager, graph = _eager_then_graph(runner, key, runner._sample_fn(b, bounded), runner.s_codes[:b])
    assert torch.equal(graph, eager)  # per-row seeds: the same noise inside and outside the graph
    assert (eager[:, 1:] < 2048).all()


def test_codec_graph_equals_eager_on_a_twin_slot(runner):
    codec = runner.codec
    f = 4
    codes = torch.randint(0, 2048, (1, f, 16), device="cuda")
    with torch.no_grad():
        codec.reset(torch.tensor([0, 1], device="cuda"))
        eager = codec.decode_step(torch.tensor([0], device="cuda"), codes)
        slots, codes_buf, out = runner._codec_buffers(1, f)
        slots.fill_(1)
        codes_buf.copy_(codes)
        runner.codec_graphs.graphs[("codec", 1, f)].replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out, _pcm16(eager))  # the graph writes the int16 PCM the runner hands
    assert int(codec.positions[1]) == f  # the graph advanced the twin slot's state


def test_graph_bank_is_populated_largest_first(runner):
    keys = runner.graph_keys()
    decode = [k for k in keys if k[0] == "decode"]
    assert decode[0][1] == max(runner.batches)
    assert len(runner.graphs) + len(runner.codec_graphs) == len(keys)
    # the codec replays on its own stream, concurrently: it must not share the talker's pool
    assert runner.codec_graphs._pool is not None and runner.codec_graphs._pool != runner.graphs._pool


def test_row_sampling_defaults_force_nothing():
    s = RowSampling(seed=1)
    assert s.end_at > 10**6 and s.min_new_tokens == 2


def test_rows_of_one_size_over_several_replays_of_one_graph_keep_their_own_audio(runner):
    """Each replay of a Code2Wav graph writes the same static output: every slice is copied out
    before the next replay of that bucket."""
    from engine.qwen3.plan import CodecChunk

    codec, f = runner.codec, 4
    codes = torch.randint(0, 2048, (4, f, 16))
    chunks = [
        CodecChunk(request_id=f"r{i}", codec_slot=i, first_frame=0, codes=codes[i].tolist(), first_chunk=True)
        for i in range(4)
    ]
    slots = torch.arange(4, device="cuda")
    size = runner.max_codec_batch
    runner.max_codec_batch = 2  # two slices of 2 rows: the (2, 4) graph replays twice
    try:
        with torch.no_grad():
            codec.reset(slots)
            audio = runner._launch_codec(chunks, [])()
            codec.reset(slots)
            # eager at the graph's shape (two rows a call): other shapes pick other cuDNN kernels
            eager = torch.cat([codec.decode_step(slots[i : i + 2], codes[i : i + 2].cuda()) for i in (0, 2)])
            eager = _pcm16(eager).cpu()  # the runner hands int16 PCM
    finally:
        runner.max_codec_batch = size
    assert ("codec", 2, f) in runner.codec_graphs.graphs
    for i in range(4):
        torch.testing.assert_close(torch.from_numpy(audio[f"r{i}"]), eager[i])
