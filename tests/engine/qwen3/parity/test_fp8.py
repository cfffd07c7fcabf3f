"""FP8 weights (engine.qwen3.models.fp8): quantisation maths, Fp8Linear against nn.Linear, which modules
quantize_linears replaces, state-dict round trips, the engine end to end with the fp32 emulation on
the CPU, and (CUDA with FP8 tensor cores only) torch._scaled_mm and the Triton quantiser against
the emulation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bench.random_checkpoint import model_config
from engine.qwen3.models import fp8
from engine.qwen3.models.config import parse_config
from engine.qwen3.models.fp8 import (
    FP8_MAX,
    Fp8Linear,
    SharedInput,
    dequantize_rows,
    emulated_scaled_mm,
    fp8_memory,
    fp8_unsupported_reason,
    quantize_linears,
    quantize_rows,
    quantize_talker,
)
from engine.qwen3.models.layers import KVCache
from engine.qwen3.models.talker import Talker
from tests.engine.qwen3.utils import engine_config

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; values
# below the smallest normal (2^-6 of the scale unit) move by at most half a subnormal step (2^-10)
REL_ROUNDING = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10
# A product of two such roundings summed over K: about 3.5 % in practice; the bound leaves room
LINEAR_REL_ERROR_BOUND = 0.05


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def tiny_talker(seed: int = 0) -> Talker:
    torch.manual_seed(seed)
    talker = Talker(parse_config(model_config("tiny")).talker).eval()
    talker.reset_rope("cpu")
    return talker


def prefill_logits(talker: Talker, embeds: torch.Tensor) -> torch.Tensor:
    b, t, _ = embeds.shape
    cache = talker.allocate_cache(b, t + 1, "cpu", embeds.dtype)
    positions = torch.arange(t).expand(b, t)
    with torch.no_grad():
        return talker.logits(talker(embeds, positions, cache, torch.arange(b), t + 1))


# -- quantisation maths -----------------------------------------------------------------------------
def test_quantize_rows_error_is_within_e4m3_rounding_and_scales_map_amax_to_448():
    torch.manual_seed(0)
    t = torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]  # rows over six decades
    values, scale = quantize_rows(t)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    torch.testing.assert_close(scale, t.abs().amax(-1, keepdim=True) / FP8_MAX)
    assert torch.equal(values.float().abs().amax(-1), torch.full((64,), FP8_MAX))  # each row's amax -> 448
    back = dequantize_rows(values, scale)
    bound = torch.maximum(t.abs() * REL_ROUNDING, scale * SUBNORMAL_HALF_STEP) * (1 + 1e-5)
    assert bool(((back - t).abs() <= bound).all())
    assert float((back - t).abs().max()) > 0  # it does round


def test_a_row_of_zeros_quantises_to_zeros_without_nan():
    t = torch.zeros(3, 32)
    t[1] = torch.linspace(-1, 1, 32)
    values, scale = quantize_rows(t)
    assert not torch.isnan(values.float()).any() and not torch.isnan(scale).any()
    assert torch.equal(values[0].float(), torch.zeros(32)) and torch.equal(values[2].float(), torch.zeros(32))


def test_fp8_linear_is_close_to_nn_linear_on_random_data():
    torch.manual_seed(1)
    for k, n, bias in ((64, 96, True), (256, 384, False), (1024, 128, True)):
        linear = nn.Linear(k, n, bias=bias)
        q = Fp8Linear.from_linear(linear, emulate=True)
        x = torch.randn(3, 7, k)
        with torch.no_grad():
            ref, got = linear(x), q(x)
        assert got.shape == ref.shape
        err = rel_error(got, ref)
        assert 0.005 < err < LINEAR_REL_ERROR_BOUND, (k, n, err)


def test_per_channel_scales_keep_small_channels_accurate_beside_an_outlier_and_a_zero_channel():
    torch.manual_seed(2)
    linear = nn.Linear(128, 64, bias=True)
    with torch.no_grad():
        linear.weight[3] = 0.0
        linear.weight[7] *= 1e6  # one huge output channel
    q = Fp8Linear.from_linear(linear, emulate=True)
    x = torch.randn(16, 128)
    x[5] = 0.0  # a token of zeros
    with torch.no_grad():
        ref, got = linear(x), q(x)
    assert torch.equal(got[:, 3], linear.bias[3].expand(16))  # zero channel: exactly the bias
    assert torch.equal(got[5], linear.bias.detach())  # zero token: exactly the bias
    small = [c for c in range(64) if c not in (3, 7)]
    assert rel_error(got[:, small], ref[:, small]) < LINEAR_REL_ERROR_BOUND  # outlier did not spread
    assert rel_error(got[:, 7], ref[:, 7]) < LINEAR_REL_ERROR_BOUND
    # a single per-tensor scale would flush the small channels: the per-channel scales are what helps
    w = linear.weight.detach()
    per_tensor = (w / (w.abs().max() / FP8_MAX)).to(torch.float8_e4m3fn).float() * (w.abs().max() / FP8_MAX)
    assert rel_error(x @ per_tensor[small].t(), x @ w[small].t()) > 5 * LINEAR_REL_ERROR_BOUND


def test_emulation_equals_torch_scaled_mm_where_the_cpu_build_has_it():
    torch.manual_seed(3)
    xq, sx = quantize_rows(torch.randn(9, 64))
    wq, sw = quantize_rows(torch.randn(48, 64))
    try:
        ref = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t().contiguous(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm is not available on this CPU build: {e}")
    torch.testing.assert_close(emulated_scaled_mm(xq, sx, wq, sw.squeeze(1)), ref, rtol=1e-5, atol=1e-5)


def test_a_failing_triton_kernel_falls_back_to_the_torch_ops_with_a_warning(monkeypatch):
    def broken(x):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fp8, "triton_quantize_rows", broken)
    monkeypatch.setitem(fp8._triton_state, "enabled", True)
    x = torch.randn(3, 32)
    with pytest.warns(RuntimeWarning, match="no kernel here"):
        values, scale = fp8.guarded_triton_quantize_rows(x)
    ref_values, ref_scale = quantize_rows(x)
    assert torch.equal(values.float(), ref_values.float()) and torch.equal(scale, ref_scale)
    assert fp8._triton_state["enabled"] is False
    assert fp8._device_quantizer(torch.device("cuda")) is quantize_rows


# -- the module -------------------------------------------------------------------------------------
def test_dtype_casts_keep_fp8_weights_and_fp32_scales_and_parameters_report_the_compute_dtype():
    talker = tiny_talker()
    quantize_talker(talker, ("talker",), emulate=True)
    talker.to(torch.bfloat16)
    q = talker.model.layers[0].self_attn.q_proj
    assert isinstance(q, Fp8Linear)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale.dtype == torch.float32
    assert {p.dtype for p in talker.parameters()} == {torch.bfloat16}
    assert talker.codec_head.weight.dtype == torch.bfloat16


def test_sibling_layers_quantise_a_shared_input_once(monkeypatch):
    calls = []

    def counting(x):
        calls.append(x.shape)
        return quantize_rows(x)

    shared = SharedInput()
    x = torch.randn(4, 16)
    first = shared.quantize(x, counting)
    assert shared.quantize(x, counting) is first and len(calls) == 1
    x.add_(1.0)  # modified in place: quantised again
    assert not torch.equal(shared.quantize(x, counting)[0].float(), first[0].float()) and len(calls) == 2
    shared.quantize(x.clone(), counting)
    assert len(calls) == 3

    monkeypatch.setattr(fp8, "quantize_rows", counting)
    talker = tiny_talker()
    quantize_talker(talker, ("talker",), emulate=True)
    calls.clear()
    prefill_logits(talker, torch.randn(1, 5, talker.cfg.hidden_size))
    # per layer: q/k/v share one, o, gate/up share one, down
    assert len(calls) == 4 * talker.cfg.shape.num_hidden_layers

    twin = copy.deepcopy(talker)  # siblings of a copy share a new cache of their own
    a, b = talker.model.layers[0].self_attn, twin.model.layers[0].self_attn
    assert b.q_proj.shared is b.v_proj.shared and b.q_proj.shared is not a.q_proj.shared
    assert b.q_proj.shared.quantized is None and a.q_proj.shared.quantized is not None


def test_quantize_linears_replaces_exactly_the_targets():
    talker = tiny_talker()
    layers = talker.cfg.shape.num_hidden_layers
    names = quantize_talker(talker, ("talker",), emulate=True)
    projections = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    assert names == [f"model.layers.{i}.{p}" for i in range(layers) for p in projections]
    quantised = {n for n, m in talker.named_modules() if isinstance(m, Fp8Linear)}
    assert quantised == set(names)
    assert isinstance(talker.codec_head, nn.Linear)
    assert isinstance(talker.text_projection.linear_fc1, nn.Linear)
    assert all(isinstance(m, nn.Linear) for m in talker.code_predictor.lm_head)
    assert isinstance(talker.model.codec_embedding, nn.Embedding)

    more = quantize_talker(talker, ("code_predictor", "heads"), emulate=True)
    cp_layers = talker.cfg.code_predictor.shape.num_hidden_layers
    assert len(more) == 7 * cp_layers + 1 + talker.cfg.code_predictor.num_code_groups - 1
    assert "codec_head" in more and "code_predictor.lm_head.0" in more
    assert not any(n.startswith("text_projection") or "small_to_mtp" in n for n in more)
    with pytest.raises(ValueError, match="unknown FP8 target"):
        quantize_talker(talker, ("embeddings",))


def test_quantize_linears_honours_include_and_exclude_patterns():
    m = nn.Sequential(
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)),
        nn.Embedding(4, 8),
        nn.LayerNorm(8),
    )
    assert quantize_linears(m, include=("*",), exclude=("2.1",), emulate=True) == ["0", "2.0"]
    assert [type(x).__name__ for x in (m[0], m[2][0], m[2][1], m[3], m[4])] == [
        "Fp8Linear",
        "Fp8Linear",
        "Linear",
        "Embedding",
        "LayerNorm",
    ]
    assert m[0].shared is not m[2][0].shared  # different parents quantise their inputs separately
    with torch.no_grad():
        assert m[2](m[0](torch.randn(2, 8))).shape == (2, 8)


def test_fp8_memory_counts_bytes_saved():
    talker = tiny_talker()
    names = quantize_talker(talker, ("talker",), emulate=True)
    replaced = [talker.get_submodule(n) for n in names]
    weights = sum(m.weight.numel() for m in replaced)
    channels = sum(m.out_features for m in replaced)
    mem = fp8_memory(talker)
    assert mem.layers == len(names)
    assert mem.weight_bytes_before == 4 * weights  # fp32 model
    assert mem.weight_bytes_after == weights + 4 * channels
    assert mem.saved_bytes == 3 * weights - 4 * channels > 0


def test_quantised_state_dict_round_trips_into_a_fresh_quantised_model():
    source = tiny_talker(seed=0)
    quantize_talker(source, ("talker", "code_predictor"), emulate=True)
    state = source.state_dict()
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.mlp.up_proj.weight_scale" in state
    target = tiny_talker(seed=1)
    quantize_talker(target, ("talker", "code_predictor"), emulate=True)
    target.load_state_dict(state, strict=True)
    embeds = torch.randn(2, 6, source.cfg.hidden_size)
    assert torch.equal(prefill_logits(target, embeds), prefill_logits(source, embeds))
    plain = tiny_talker()
    with pytest.raises(RuntimeError, match="weight_scale"):
        plain.load_state_dict(state, strict=True)  # an unquantised model refuses fp8 weights


def test_quantised_talker_logits_stay_close_to_fp32():
    ref = tiny_talker()
    q = copy.deepcopy(ref)
    quantize_talker(q, ("talker",), emulate=True)
    torch.manual_seed(4)
    embeds = torch.randn(3, 12, ref.cfg.hidden_size)
    a, b = prefill_logits(ref, embeds), prefill_logits(q, embeds)
    assert 0 < rel_error(b, a) < 0.1
    top_ref, top_q = a.topk(10, dim=-1).indices, b.topk(10, dim=-1).indices
    overlap = (top_ref[..., :, None] == top_q[..., None, :]).any(-1).float().mean()
    assert overlap > 0.8


def test_code_predictor_runs_quantised_with_its_own_cache():
    talker = tiny_talker()
    quantize_talker(talker, ("talker", "code_predictor"), emulate=True)
    from engine.qwen3.models.sampler import SamplingParams

    b = 2
    params = SamplingParams.build([1.0] * b, [0] * b, [1.0] * b, [True] * b, "cpu")
    hidden = torch.randn(b, talker.cfg.hidden_size)
    with torch.no_grad():
        codes = talker.predict_codes(
            hidden,
            torch.tensor([5, 9]),
            params,
            torch.zeros(b, dtype=torch.long),
            torch.zeros(b, dtype=torch.long),
        )
        again = talker.predict_codes(
            hidden,
            torch.tensor([5, 9]),
            params,
            torch.zeros(b, dtype=torch.long),
            torch.zeros(b, dtype=torch.long),
            KVCache.allocate(
                talker.cfg.code_predictor.shape, b, talker.code_predictor.cache_len, "cpu", torch.float32
            ),
        )
    assert codes.shape == (b, talker.cfg.num_code_groups) and torch.equal(codes, again)


# -- wiring -----------------------------------------------------------------------------------------
def test_fp8_is_refused_without_fp8_tensor_cores():
    from cadence.cli import _serve_parser
    from cadence.engines import EngineOptions, build_engine

    assert "CUDA" in (fp8_unsupported_reason("cpu") or "")
    assert _serve_parser().parse_args(["--dtype", "fp8"]).dtype == "fp8"
    with pytest.raises(SystemExit, match="fp8"):
        build_engine(EngineOptions(name="qwen3", model="unused", device="cpu", dtype="fp8"))


@pytest.mark.reference
async def test_engine_streams_greedy_audio_with_emulated_fp8_equal_to_offline_generation(tmp_path):

    from engine.api import SynthesisRequest, TextSegment
    from engine.qwen3.engine import Qwen3Engine
    from engine.qwen3.generate import GenerationRequest, generate_codes
    from engine.qwen3.prompt_builder import build_prompt
    from engine.qwen3.prompts import PromptRequest
    from tests.reference_builders import build_reference_tts, load_ours

    b, codec = load_ours(build_reference_tts("custom_voice", tmp_path / "cv"))
    fp32_talker = copy.deepcopy(b.talker)
    names = quantize_talker(b.talker, ("talker", "code_predictor"), emulate=True)
    assert names and fp8_memory(b.talker).saved_bytes > 0
    engine = Qwen3Engine(
        b.config,
        b.generation,
        b.tokenizer,
        b.talker,
        codec.eval(),
        engine_config(
            max_streams=2, kv_slots=2, max_len=96, max_batch=2, enforce_eager=True, progress_bar=False
        ),
    )
    engine._ready = True
    calls = []
    for m in b.talker.modules():
        if isinstance(m, Fp8Linear):
            m.register_forward_hook(lambda *_: calls.append(1))
    text, frames = "Hello world. How are you?", 6
    stream = engine.open(
        SynthesisRequest(request_id="a", voice="ryan", language="English", greedy=True, max_frames=frames)
    )
    state = engine.scheduler.requests["a"]
    stream.push(TextSegment(text, char_start=0))
    stream.close_text()
    for _ in range(100):
        if not engine.core.has_work():
            break
        engine.core._emit(engine.core.step())
    chunks = [c async for c in stream]
    assert chunks[-1].final
    audio = torch.cat([torch.from_numpy(c.samples) for c in chunks])
    assert audio.numel() == state.frames_generated * 1920 and bool(torch.isfinite(audio).all())

    def offline(talker: Talker) -> torch.Tensor:
        prompt = build_prompt(
            talker, b.config, b.tokenizer, PromptRequest(text=text, language="English", speaker="ryan")
        )
        (codes,) = generate_codes(
            talker, [GenerationRequest(prompt=prompt, greedy=True, max_frames=frames)], b.generation
        )
        return codes

    assert len(calls) >= 7 * b.config.talker.shape.num_hidden_layers * frames  # the engine ran the fp8 layers
    # the offline path agrees with the engine (exactly in fp32; here padding and summation order can move
    # an activation across an fp8 rounding boundary, and this tiny random model has near-ties)
    engine_codes, fp8_codes = torch.tensor(state.codes), offline(b.talker)
    assert engine_codes.shape == fp8_codes.shape == (frames, b.config.talker.num_code_groups)
    assert torch.equal(engine_codes[0], fp8_codes[0])
    assert float((engine_codes == fp8_codes).float().mean()) > 0.5
    assert offline(fp32_talker).shape == fp8_codes.shape


# -- CUDA (FP8 tensor cores) ------------------------------------------------------------------------
def _need_fp8_gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = fp8_unsupported_reason("cuda")
    if reason:
        pytest.skip(reason)
    return torch.device("cuda")


@pytest.mark.gpu
def test_gpu_scaled_mm_equals_the_emulation():
    dev = _need_fp8_gpu()
    torch.manual_seed(5)
    for m in (1, 7, 256):
        linear = nn.Linear(2048, 1024, bias=False, device=dev, dtype=torch.bfloat16)
        native, emulated = Fp8Linear.from_linear(linear), Fp8Linear.from_linear(linear, emulate=True)
        x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
        xq, sx = quantize_rows(x)
        got = torch._scaled_mm(
            xq, native.weight.t(), scale_a=sx, scale_b=native.weight_scale[None, :], out_dtype=torch.float32
        )
        ref = emulated_scaled_mm(xq, sx, native.weight, native.weight_scale)
        # the tensor cores sum FP8 products in an accumulator narrower than fp32 between promotions:
        # about 2^-12 of the outputs' scale (~1), far below a wrong scale's or layout's error
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
        with torch.no_grad():
            torch.testing.assert_close(native(x).float(), emulated(x).float(), rtol=2e-2, atol=2e-2)
            assert rel_error(native(x), linear(x)) < LINEAR_REL_ERROR_BOUND


@pytest.mark.gpu
def test_gpu_triton_quantiser_matches_the_torch_ops():
    dev = _need_fp8_gpu()
    if fp8.triton is None:
        pytest.skip("Triton is not installed")
    torch.manual_seed(6)
    for k in (1024, 2048, 3072, 6144):
        x = torch.randn(33, k, device=dev, dtype=torch.bfloat16) * 4
        x[0] = 0
        x[1, 3] = 1e4
        q, s = fp8.triton_quantize_rows(x)
        q_ref, s_ref = quantize_rows(x)
        assert torch.equal(s, s_ref)
        assert float((q.float() != q_ref.float()).float().mean()) < 1e-3  # at most rare last-bit ties


@pytest.mark.gpu
def test_gpu_fp8_linear_replays_in_a_cuda_graph():
    dev = _need_fp8_gpu()
    torch.manual_seed(7)
    talker = Talker(parse_config(model_config("tiny")).talker).to(dev, torch.bfloat16).eval()
    talker.reset_rope(dev)
    quantize_talker(talker, ("talker", "code_predictor"))
    static = torch.randn(4, 1, talker.cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    cache = talker.allocate_cache(4, 33, dev, torch.bfloat16)
    positions, slots = torch.zeros(4, 1, dtype=torch.long, device=dev), torch.arange(4, device=dev)

    def step() -> torch.Tensor:
        return talker.logits(talker(static, positions, cache, slots, 33))

    with torch.no_grad():
        eager = step()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = step()
        static.copy_(torch.randn_like(static))
        graph.replay()
        torch.testing.assert_close(out, step())
        assert not torch.equal(out, eager)


# -- the GPU benchmark's CPU smoke mode ------------------------------------------------------------
def test_fp8_bench_smoke_mode_writes_every_figure(tmp_path, monkeypatch):
    import json
    import sys

    from bench import gpu_fp8_bench

    out = tmp_path / "fp8.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "gpu_fp8_bench.py",
            "--tiny",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--frames",
            "3",
            "--rows",
            "2",
            "--prompt",
            "6",
            "--prefill-batch",
            "2",
            "--prefill-len",
            "8",
            "--variants",
            "talker",
            "talker+code_predictor",
            "--engine-variants",
            "talker",
            "--engine-batches",
            "1",
            "2",
            "--engine-frames",
            "3",
            "--engine-prompt",
            "6",
        ],
    )
    gpu_fp8_bench.main()
    result = json.loads(out.read_text())
    assert set(result["logits"]) == {"bf16", "fp8:talker", "fp8:talker+code_predictor"}
    bf16, fp8_talker = result["logits"]["bf16"], result["logits"]["fp8:talker"]
    assert 0 < bf16["talker_vs_fp32"]["rel_err"] < fp8_talker["talker_vs_fp32"]["rel_err"] < 0.5
    # the predictor is only quantised in the second variant
    assert fp8_talker["predictor_vs_bf16"]["rel_err"] == 0.0
    assert result["logits"]["fp8:talker+code_predictor"]["predictor_vs_bf16"]["rel_err"] > 0
    assert set(result["logits_outliers"]) == set(result["logits"])
    greedy = result["greedy"]["fp8:talker"]
    assert (
        len(greedy["free_vs_bf16"]["first_divergence"]) == 2
        and 0 <= greedy["forced_vs_bf16"]["frames_equal"] <= 1
    )
    assert "forced_vs_fp32" in result["greedy"]["bf16"]
    engine = result["engine"]
    assert set(engine) == {"bf16", "fp8:talker"}
    assert [r["batch"] for r in engine["fp8:talker"]["rows"]] == [1, 2]
    assert all(r["frames"] == r["batch"] * 3 for r in engine["fp8:talker"]["rows"])
    assert engine["fp8:talker"]["weight_bytes_saved"] > 0 == engine["bf16"]["fp8_layers"]
    assert result["engine_errors"] == {}
