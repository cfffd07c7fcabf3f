"""FP8 talker weights against bf16 at the real Qwen3-TTS-1.7B shapes, random weights.

    python bench/gpu_fp8_bench.py --out deploy/bench/fp8-h200-1.7b.json   # H200: about 3 minutes
    python bench/gpu_fp8_bench.py --tiny --device cpu --out fp8-smoke.json  # smoke test (emulated FP8)

Variants: bf16 and FP8 with targets from engine.qwen3.models.fp8.TARGETS ("talker": the talker's decoder
linears; "+code_predictor": also the code predictor's; "+heads": also codec_head and the lm_heads).
Every model starts from the same fp32 random weights (embeddings N(0, 0.02) as in
bench/random_checkpoint.py); FP8 quantises the bf16 copy.

1. Logits: talker prefill logits (random prompts made of text and codec embeddings) and the code
   predictor's first-codebook logits, against fp32 and bf16: relative error (Frobenius), top-50
   overlap, argmax agreement. Repeated with activation-outlier channels (a few hidden channels of
   every RMSNorm weight scaled up), the case per-token activation scales find hardest.
2. Greedy codes over --frames frames for --rows prompts: free-running (fraction of frames whose 16
   codes equal the reference's, first divergence per row) and teacher-forced (the model reads the
   reference's codes, so each frame is judged on the same history). bf16 against fp32 is the
   yardstick: random weights make many near-ties, so a divergence says little on its own.
3. Engine figures through bench/gpu_engine_bench.py (scheduler -> runner -> update, CUDA graphs):
   steps/s, frames/s, real-time streams and TTFA p50 per batch size, one step's talker and predictor
   graph times, weight bytes and peak memory.

A compact table closes the output; --out writes everything as JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_engine_bench as engine_bench  # noqa: E402
from engine.qwen3.models.config import parse_config  # noqa: E402
from engine.qwen3.models.fp8 import fp8_memory, quantize_talker  # noqa: E402
from engine.qwen3.models.sampler import SamplingParams  # noqa: E402
from engine.qwen3.models.talker import Talker  # noqa: E402

TOP_K = 50


# -- models -----------------------------------------------------------------------------------------
@torch.no_grad()
def build_models(args: argparse.Namespace, cfg) -> dict[str, Talker]:
    """fp32 reference, its bf16 copy, and one FP8 model per variant (quantised from the bf16 copy)."""
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    with dev:
        ref = Talker(cfg.talker).float().eval()
    for name, p in ref.named_parameters():
        if "embedding" in name:
            p.normal_(0.0, 0.02)
    ref.reset_rope(dev)
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    models = {"fp32": ref, "bf16": bf16}
    for variant in args.variants:
        q = copy.deepcopy(bf16)
        quantize_talker(q, variant.split("+"))
        models[f"fp8:{variant}"] = q
    return models


@torch.no_grad()
def random_prompts(talker: Talker, cfg, rows: int, length: int, gen: torch.Generator) -> Tensor:
    """[rows, length, H] fp32: text-track plus codec-track embeddings of random ids."""
    dev = talker.model.norm.weight.device
    text_ids = torch.randint(0, cfg.talker.text_vocab_size, (rows, length), generator=gen).to(dev)
    codec_ids = torch.randint(0, cfg.talker.vocab_size, (rows, length), generator=gen).to(dev)
    return (talker.embed_text(text_ids) + talker.embed_codec(codec_ids)).float()


def dtype_of(talker: Talker) -> torch.dtype:
    return talker.model.norm.weight.dtype  # codec_head may be FP8 ("heads")


# -- logits -----------------------------------------------------------------------------------------
@torch.no_grad()
def prefill_logits(talker: Talker, embeds: Tensor) -> Tensor:
    b, t, _ = embeds.shape
    dev, dt = embeds.device, dtype_of(talker)
    cache = talker.allocate_cache(b, t + 1, dev, dt)
    positions = torch.arange(t, device=dev).expand(b, t)
    hidden = talker(embeds.to(dt), positions, cache, torch.arange(b, device=dev), t + 1)
    return talker.logits(hidden).float().reshape(b * t, -1)


@torch.no_grad()
def predictor_logits(talker: Talker, hidden: Tensor, first: Tensor) -> Tensor:
    """The code predictor's codebook-1 logits for talker states `hidden` [B, H] and codes `first` [B]."""
    cp, dt = talker.code_predictor, dtype_of(talker)
    b = hidden.shape[0]
    cache = cp.allocate_cache(b, hidden.device, dt)
    x = cp.small_to_mtp_projection(torch.stack((hidden.to(dt), talker.embed_codec(first)), dim=1))
    positions = torch.arange(2, device=x.device).expand(b, 2)
    out = cp.model.run_layers(x, positions, cache, torch.arange(b, device=x.device), cp.cache_len)
    return cp.lm_head[0](out[:, -1]).float()


def compare_logits(got: Tensor, ref: Tensor) -> dict:
    k = min(TOP_K, ref.shape[-1])
    top_got, top_ref = got.topk(k, dim=-1).indices, ref.topk(k, dim=-1).indices
    overlap = (top_got[:, :, None] == top_ref[:, None, :]).any(-1).float().mean()
    return dict(
        rel_err=float((got - ref).norm() / ref.norm()),
        top50_overlap=float(overlap),
        argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
    )


@torch.no_grad()
def logit_figures(models: dict[str, Talker], cfg, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(args.seed + 1)
    ref = models["fp32"]
    embeds = random_prompts(ref, cfg, args.prefill_batch, args.prefill_len, gen)
    dev = embeds.device
    hidden = torch.randn(args.prefill_batch * 8, cfg.talker.hidden_size, generator=gen).to(dev)
    first = torch.randint(0, cfg.talker.code_predictor.vocab_size, (hidden.shape[0],), generator=gen).to(dev)
    talker = {name: prefill_logits(m, embeds) for name, m in models.items()}
    predictor = {name: predictor_logits(m, hidden, first) for name, m in models.items()}
    out: dict = {}
    for name in models:
        if name == "fp32":
            continue
        row = {
            "talker_vs_fp32": compare_logits(talker[name], talker["fp32"]),
            "predictor_vs_fp32": compare_logits(predictor[name], predictor["fp32"]),
        }
        if name != "bf16":
            row["talker_vs_bf16"] = compare_logits(talker[name], talker["bf16"])
            row["predictor_vs_bf16"] = compare_logits(predictor[name], predictor["bf16"])
        out[name] = row
    return out


@torch.no_grad()
def add_activation_outliers(models: dict[str, Talker], channels: int, factor: float, seed: int) -> None:
    """Scale a few hidden channels of every RMSNorm weight (the inputs of every linear) by `factor`,
    the same channels in every model: LLM-like activation outliers."""
    gen = torch.Generator().manual_seed(seed)
    for talker in models.values():
        for stack in (talker.model, talker.code_predictor.model):
            picked = torch.randperm(stack.shape.hidden_size, generator=gen)[:channels]
            for layer in stack.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight[picked.to(norm.weight.device)] *= factor
            gen.manual_seed(seed)  # the same channels in the next model


# -- greedy codes -----------------------------------------------------------------------------------
@torch.no_grad()
def greedy_codes(
    talker: Talker, cfg, prompts: Tensor, frames: int, text_track: Tensor, teacher: Tensor | None = None
) -> Tensor:
    """Greedy talker + code predictor for every row of `prompts` [R, T, H] -> codes [R, frames, G].

    teacher [R, frames, G]: rows read these codes as their history instead of their own."""
    r, t, _ = prompts.shape
    dev, dt = prompts.device, dtype_of(talker)
    max_len = t + frames + 1
    cache = talker.allocate_cache(r, max_len, dev, dt)
    cp_cache = talker.code_predictor.allocate_cache(r, dev, dt)
    slots = torch.arange(r, device=dev)
    params = SamplingParams.build([1.0] * r, [0] * r, [1.0] * r, [True] * r, dev)
    seed = torch.zeros(r, dtype=torch.long, device=dev)
    codebook = cfg.talker.code_predictor.vocab_size  # control ids above it are never sampled
    hidden = talker(prompts.to(dt), torch.arange(t, device=dev).expand(r, t), cache, slots, max_len)[:, -1]
    out = []
    for f in range(frames):
        first = talker.logits(hidden)[:, :codebook].float().argmax(-1)
        codes = talker.predict_codes(hidden, first, params, seed, seed + 16 * f, cp_cache)
        out.append(codes)
        history = codes if teacher is None else teacher[:, f]
        x = talker.frame_embedding(history) + text_track.to(dt)
        pos = torch.full((r, 1), t + f, device=dev, dtype=torch.long)
        hidden = talker(x[:, None], pos, cache, slots, max_len)[:, 0]
    return torch.stack(out, dim=1)


def compare_codes(got: Tensor, ref: Tensor) -> dict:
    frame_match = (got == ref).all(-1)  # [R, F]
    frames = frame_match.shape[1]
    mismatch = ~frame_match
    first = torch.where(
        mismatch.any(-1),
        mismatch.float().argmax(-1),
        torch.full_like(mismatch[:, 0], frames, dtype=torch.long),
    )
    return dict(
        frames_equal=float(frame_match.float().mean()),
        code0_equal=float((got[..., 0] == ref[..., 0]).float().mean()),
        codes_equal=float((got == ref).float().mean()),
        first_divergence=[int(v) for v in first.tolist()],
        first_divergence_median=float(first.float().median()),
    )


@torch.no_grad()
def greedy_figures(models: dict[str, Talker], cfg, args: argparse.Namespace) -> dict:
    """Free-running codes of every model; teacher-forced: bf16 on fp32's codes, FP8 on bf16's."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompts = random_prompts(models["fp32"], cfg, args.rows, args.prompt, gen)
    text_track = models["fp32"].embed_text(torch.tensor([cfg.tts_pad_id], device=prompts.device))[0].float()
    free: dict[str, Tensor] = {}
    out: dict = {}
    for name, talker in models.items():
        t0 = time.perf_counter()
        free[name] = greedy_codes(talker, cfg, prompts, args.frames, text_track)
        if name == "fp32":
            continue
        teacher_name = "fp32" if name == "bf16" else "bf16"
        forced = greedy_codes(talker, cfg, prompts, args.frames, text_track, teacher=free[teacher_name])
        out[name] = {
            "free_vs_fp32": compare_codes(free[name], free["fp32"]),
            f"forced_vs_{teacher_name}": compare_codes(forced, free[teacher_name]),
            "seconds": time.perf_counter() - t0,
        }
        if name != "bf16":
            out[name]["free_vs_bf16"] = compare_codes(free[name], free["bf16"])
    return out


# -- engine -----------------------------------------------------------------------------------------
def engine_args(args: argparse.Namespace, dtype: str, targets: tuple[str, ...]) -> argparse.Namespace:
    """gpu_engine_bench's options (its defaults, our sizes)."""
    return argparse.Namespace(
        tiny=args.tiny,
        device=args.device,
        dtype=dtype,
        fp8_targets=targets,
        codec_dtype=args.codec_dtype,
        frames=args.engine_frames,
        prompt=args.engine_prompt,
        max_len=512,
        kv_buckets=[128, 256],
        max_codec_batch=min(64, max(args.engine_batches)),
        eager=args.device == "cpu",
        batches=args.engine_batches,
        profile_batch=-1,
        watchdog=600.0,
    )


def engine_figures(args: argparse.Namespace, name: str) -> dict:
    dtype, targets = ("bfloat16", ()) if name == "bf16" else ("fp8", tuple(name.split(":", 1)[1].split("+")))
    if args.device == "cpu" and dtype == "bfloat16":
        dtype = "float32"
    eargs = engine_args(args, dtype, targets)
    t0 = time.perf_counter()
    runner, cfg = engine_bench.build(eargs, max(args.engine_batches))
    # graphs only for the measured batch sizes (others pad up to them), to keep capture short
    runner.batches = sorted(set(args.engine_batches))
    runner.codec_batches = sorted({1, runner.max_codec_batch})
    captured = runner.capture()
    built = time.perf_counter() - t0
    rows = []
    for b in args.engine_batches:
        engine_bench.run_batch(runner, cfg, argparse.Namespace(**{**vars(eargs), "frames": 4}), b)  # warm-up
        row = engine_bench.run_batch(runner, cfg, eargs, b) | engine_bench.breakdown(runner, b)
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(name, rows[-1], flush=True)
    mem = fp8_memory(runner.talker)
    cuda = runner.device.type == "cuda"
    out = dict(
        build_and_capture_s=round(built, 1),
        graphs=captured,
        rows=rows,
        fp8_layers=mem.layers,
        weight_bytes_saved=mem.saved_bytes,
        talker_bytes=sum(t.numel() * t.element_size() for t in runner.talker.state_dict().values()),
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    )
    del runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


# -- report -----------------------------------------------------------------------------------------
def print_tables(result: dict) -> None:
    print(f"\nlogits (relative error / top-{TOP_K} overlap / argmax agreement)")
    print(
        f"{'model':<34} {'talker vs fp32':>22} {'talker vs bf16':>22} {'predictor vs fp32':>22} {'outliers vs bf16':>22}"
    )

    def cell(d: dict | None) -> str:
        return "-" if d is None else f"{d['rel_err']:.4f} {d['top50_overlap']:.3f} {d['argmax_agree']:.2f}"

    for name, row in result["logits"].items():
        outl = result.get("logits_outliers", {}).get(name, {})
        print(
            f"{name:<34} {cell(row['talker_vs_fp32']):>22} {cell(row.get('talker_vs_bf16')):>22} "
            f"{cell(row['predictor_vs_fp32']):>22} {cell(outl.get('talker_vs_bf16')):>22}"
        )
    print(
        f"\ngreedy codes, {result['config']['frames']} frames x {result['config']['rows']} rows "
        "(frames equal / first divergence median)"
    )
    print(f"{'model':<34} {'free vs fp32':>18} {'free vs bf16':>18} {'teacher-forced':>24}")
    for name, row in result["greedy"].items():
        forced_key = next(k for k in row if k.startswith("forced_vs_"))
        free_bf16 = row.get("free_vs_bf16")

        def g(d: dict | None) -> str:
            return "-" if d is None else f"{d['frames_equal']:.3f} {d['first_divergence_median']:>5.0f}"

        forced = row[forced_key]
        print(
            f"{name:<34} {g(row['free_vs_fp32']):>18} {g(free_bf16):>18} "
            f"{forced_key[7:]:>9} {forced['frames_equal']:.3f} c0 {forced['code0_equal']:.3f}"
        )
    if result.get("engine"):
        print(
            f"\n{'engine':<34} {'B':>4} {'step ms':>8} {'frames/s':>9} {'RT streams':>10} {'TTFA p50':>9} "
            f"{'talker':>7} {'pred':>7} {'saved MiB':>9}"
        )
        for name, eng in result["engine"].items():
            for r in eng["rows"]:
                print(
                    f"{name:<34} {r['batch']:>4} {r['step_ms']:>8.2f} {r['frames_per_s']:>9.0f} "
                    f"{r['streams_rt']:>10.0f} {r['ttfa_ms_p50']:>9.1f} {r['talker_ms']:>7.2f} "
                    f"{r['predictor_ms']:>7.2f} {eng['weight_bytes_saved'] / 2**20:>9.0f}"
                )


def environment(device: str) -> dict:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[1],
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    return dict(
        machine=platform.node(),
        gpu=gpu,
        torch=torch.__version__,
        commit=commit,
        command="python " + " ".join(sys.argv),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (smoke test)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument(
        "--variants", nargs="+", default=["talker", "talker+code_predictor", "talker+code_predictor+heads"]
    )
    ap.add_argument(
        "--engine-variants",
        nargs="*",
        default=["talker", "talker+code_predictor"],
        help="FP8 variants measured in the engine besides bf16 (none: skip FP8 engine runs)",
    )
    ap.add_argument("--frames", type=int, default=200, help="greedy frames per row")
    ap.add_argument("--rows", type=int, default=8, help="greedy prompts")
    ap.add_argument("--prompt", type=int, default=32, help="greedy prompt length")
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=64)
    ap.add_argument("--outlier-channels", type=int, default=4)
    ap.add_argument("--outlier-factor", type=float, default=20.0)
    ap.add_argument("--engine-batches", type=int, nargs="*", default=[1, 256, 512])
    ap.add_argument("--engine-frames", type=int, default=60)
    ap.add_argument("--engine-prompt", type=int, default=40)
    ap.add_argument("--codec-dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    cfg = parse_config(engine_bench.model_config(args.tiny)[0])
    result: dict = dict(
        environment(args.device),
        config=dict(
            shapes="tiny" if args.tiny else "1.7B",
            frames=args.frames,
            rows=args.rows,
            prompt=args.prompt,
            prefill=[args.prefill_batch, args.prefill_len],
            variants=args.variants,
            outliers=[args.outlier_channels, args.outlier_factor],
            engine_batches=args.engine_batches,
        ),
    )

    models = build_models(args, cfg)
    result["weights"] = {
        name: dict(fp8_layers=fp8_memory(m).layers, bytes_saved=fp8_memory(m).saved_bytes)
        for name, m in models.items()
        if name.startswith("fp8")
    }
    result["logits"] = logit_figures(models, cfg, args)
    print(f"logits done at {time.perf_counter() - t_start:.0f} s", flush=True)
    result["greedy"] = greedy_figures(models, cfg, args)
    print(f"greedy done at {time.perf_counter() - t_start:.0f} s", flush=True)
    if args.outlier_channels > 0:
        add_activation_outliers(models, args.outlier_channels, args.outlier_factor, args.seed)
        result["logits_outliers"] = logit_figures(models, cfg, args)
    del models
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    write(args.out, result, t_start)  # the accuracy figures survive a failing engine run
    if args.engine_batches:
        result["engine"], result["engine_errors"] = {}, {}
        for name in ["bf16"] + [f"fp8:{v}" for v in args.engine_variants]:
            try:
                result["engine"][name] = engine_figures(args, name)
            except Exception as e:  # noqa: BLE001 - report it, measure the other variants
                result["engine_errors"][name] = f"{type(e).__name__}: {e}"
                print(f"engine run {name} failed: {result['engine_errors'][name]}", flush=True)
    write(args.out, result, t_start)
    print_tables(result)
    print(f"\nwrote {args.out} ({result['seconds']} s)")


def write(path: Path, result: dict, t_start: float) -> None:
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
