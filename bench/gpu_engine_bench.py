"""Engine-only figures at the real Qwen3-TTS-1.7B shapes, random weights, forced lengths.

    python bench/gpu_engine_bench.py                      # H200: ~5-8 minutes incl. graph capture
    python bench/gpu_engine_bench.py --tiny --device cpu  # smoke test of the script itself

For each batch size: B requests start together (prompt --prompt positions, --frames frames each,
EOS masked until then) and run through scheduler -> runner -> update exactly as in serving.
Reported: steps/s and frames/s in steady decode, time to first audio, then one step's breakdown
(talker decode graph / sampling + predictor graph / codec graph replayed alone), a torch.profiler
table, peak memory and KV bytes per stream. A compact table closes the output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_checkpoint import model_config as checkpoint_config  # noqa: E402
from bench.random_checkpoint import speech_tokenizer_config  # noqa: E402
from engine.api import ChunkSchedule, TextSegment  # noqa: E402
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager  # noqa: E402
from engine.qwen3.models.codec import Code2Wav  # noqa: E402
from engine.qwen3.models.config import parse_config  # noqa: E402
from engine.qwen3.models.talker import Talker  # noqa: E402
from engine.qwen3.prompts import PromptEmbeds, PromptTokens  # noqa: E402
from engine.qwen3.request import Request, Segment  # noqa: E402
from engine.qwen3.runner import RowSampling, Runner, RunnerConfig, SegmentPrompt  # noqa: E402
from engine.qwen3.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def model_config(tiny: bool) -> tuple[dict, dict]:
    """config.json and the Code2Wav decoder config at the real 1.7B shapes (or toy ones)."""
    size = "tiny" if tiny else "1.7B"
    return checkpoint_config(size), speech_tokenizer_config(size)["decoder_config"]


@torch.no_grad()
def build(args: argparse.Namespace, max_batch: int) -> tuple[Runner, object]:
    raw, codec_cfg = model_config(args.tiny)
    cfg = parse_config(raw)
    dev = torch.device(args.device)
    fp8 = args.dtype == "fp8"  # bf16 (fp32 on the CPU), then the chosen linears in FP8
    dtype = (torch.float32 if dev.type == "cpu" else torch.bfloat16) if fp8 else getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(dev):
        talker = Talker(cfg.talker).to(dtype).eval()
        codec = Code2Wav(codec_cfg).to(getattr(torch, args.codec_dtype)).eval()
        for name, p in codec.named_parameters():
            if name.endswith("embedding_sum"):
                p.normal_()
    talker.reset_rope(dev)
    if fp8:
        from engine.qwen3.models.fp8 import DEFAULT_TARGETS, quantize_talker

        quantize_talker(talker, getattr(args, "fp8_targets", DEFAULT_TARGETS))
    codec.quantizer.refresh()
    runner = Runner(
        talker,
        codec,
        cfg,
        RunnerConfig(
            max_len=args.max_len,
            kv_buckets=tuple(args.kv_buckets),
            max_codec_batch=args.max_codec_batch,
            enforce_eager=args.eager,
        ),
        num_slots=max_batch,
        codec_slots=max_batch,
        max_batch=max_batch,
    )
    return runner, cfg


def fake_prompt(runner: Runner, prompt_len: int, hidden: int) -> SegmentPrompt:
    dev, dt = runner.device, runner.dtype
    embeds = PromptEmbeds(
        prefill=torch.randn(prompt_len, hidden, device=dev, dtype=dt) * 0.1,
        trailing=torch.randn(8, hidden, device=dev, dtype=dt) * 0.1,
        tts_pad=torch.zeros(hidden, device=dev, dtype=dt),
    )
    tokens = PromptTokens(text_ids=[], instruct_ids=None, ref_ids=None, language_id=None, speaker_id=None)
    return SegmentPrompt(tokens=tokens, embeds=embeds)


def sync(runner: Runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def run_batch(runner: Runner, cfg, args: argparse.Namespace, b: int) -> dict:
    layout = KVCacheLayout(runner.num_slots, args.max_len, runner.kv_bytes_per_token)
    sched = Scheduler(
        SchedulerConfig(
            max_batch=runner.max_batch,
            codec_slots=runner.codec_slots,
            max_tokens_per_step=max(512, b + args.prompt),
            max_codec_rows=runner.max_codec_batch,
            queue_limit=0,
        ),
        KVCacheManager(layout),
        codec_delivery_steps=int(runner.defers_codec),
    )
    hidden = cfg.talker.hidden_size
    t0 = time.perf_counter()
    for i in range(b):
        r = Request(
            request_id=f"r{i}",
            arrival_time=sched.clock(),
            schedule=ChunkSchedule(first=1),
            sampling=RowSampling(seed=i, min_new_tokens=args.frames, end_at=args.frames),
        )
        r.segments.append(
            Segment(
                TextSegment("x", 0),
                prompt_len=args.prompt,
                max_frames=args.frames,
                payload=fake_prompt(runner, args.prompt, hidden),
            )
        )
        r.text_closed = True
        sched.add_request(r)
    reqs = list(sched.requests.values())
    step_times, decode_steps = [], []
    while sched.has_work():
        s0 = time.perf_counter()
        plan = sched.schedule()
        out = runner.execute(plan)
        sched.update(plan, out)
        dt = time.perf_counter() - s0
        step_times.append(dt)
        if len(plan.decode) == b and not plan.prefill:
            decode_steps.append(dt)
    total = time.perf_counter() - t0
    ttfa = [r.ttfa for r in reqs if r.ttfa is not None]
    med = statistics.median(decode_steps) if decode_steps else float("nan")
    return dict(
        batch=b,
        steps=len(step_times),
        wall_s=total,
        step_ms=1000 * med,
        steps_per_s=1 / med,
        frames_per_s=b / med,
        streams_rt=b / med / 12.5,
        ttfa_ms_p50=1000 * statistics.median(ttfa),
        frames=sum(r.frames_generated for r in reqs),
    )


def time_replay(runner: Runner, key: tuple, iters: int = 20, position: int | None = None) -> float:
    """Replay one graph alone; decode and sampling rows are real slots (at `position` for decode)."""
    bank = runner.codec_graphs if key[0] == "codec" else runner.graphs
    graph = bank.graphs.get(key)
    if graph is None or runner.device.type != "cuda":
        return float("nan")
    runner._reset_static_inputs()
    b = int(key[1])
    if key[0] in ("decode", "sample") and b <= runner.num_slots:
        meta = runner.d_meta if key[0] == "decode" else runner.s_meta
        meta[0, :b] = torch.arange(b, device=runner.device)
        if key[0] == "decode":
            meta[1, :b] = runner.config.max_len - 1 if position is None else position
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def breakdown(runner: Runner, b: int) -> dict:
    from engine.qwen3.cuda_graphs import bucket_for

    bb = bucket_for(b, runner.batches) or b
    k = runner.kv_buckets[-1]
    cb = bucket_for(min(b, runner.max_codec_batch), runner.codec_batches)
    return dict(
        talker_ms=time_replay(runner, ("decode", bb, k)),  # every row at the last position
        talker_ms_mid=time_replay(runner, ("decode", bb, k), position=runner.config.max_len // 2),
        predictor_ms=time_replay(runner, ("sample", bb, True)),
        predictor_ms_full_vocab=time_replay(runner, ("sample", bb, False)),
        codec_ms_4f=time_replay(runner, ("codec", cb, 4)),
    )


def profile(runner: Runner, cfg, args: argparse.Namespace, b: int) -> None:
    """Where one replay of each graph at batch b spends its GPU time: kernel count and top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if runner.device.type != "cuda":
        return
    from engine.qwen3.cuda_graphs import bucket_for

    bb = bucket_for(b, runner.batches)
    for key in (("decode", bb, runner.kv_buckets[-1]), ("sample", bb, True)):
        time_replay(runner, key, iters=3)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            time_replay(runner, key, iters=5)
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        kernels = sum(e.count for e in events) / 6
        total = sum(e.self_device_time_total for e in events) / 6 / 1000
        print(f"\nprofile {key}: {kernels:.0f} kernels per replay, {total:.2f} ms of kernel time")
        print(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--kv-buckets", type=int, nargs="*", default=[128, 256])
    ap.add_argument("--max-codec-batch", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--dtype", default="bfloat16", help="bfloat16 | float32 | fp8 (bf16 + FP8 talker linears)"
    )
    ap.add_argument("--codec-dtype", default="float32")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--profile-batch", type=int, nargs="*", default=[64], help="batch sizes to profile")
    ap.add_argument(
        "--watchdog",
        type=float,
        default=90.0,
        help="print every thread's stack if a phase takes longer than this (s)",
    )
    args = ap.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"
    max_batch = max(args.batches)
    t = time.perf_counter()
    runner, cfg = build(args, max_batch)
    print(f"built in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    n = runner.capture()
    print(f"captured {n} graphs in {time.perf_counter() - t:.1f} s")
    rows = []
    for b in args.batches:
        run_batch(runner, cfg, argparse.Namespace(**{**vars(args), "frames": 4}), b)  # warm-up
        row = run_batch(runner, cfg, args, b) | breakdown(runner, b)
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    for b in args.profile_batch:
        if b in args.batches:
            profile(runner, cfg, args, b)
    peak = torch.cuda.max_memory_allocated() / 2**30 if runner.device.type == "cuda" else float("nan")
    print(
        f"\npeak memory {peak:.2f} GiB; KV bytes per stream {runner.kv_bytes_per_stream / 2**20:.1f} MiB "
        f"({runner.kv_bytes_per_token} B/token, max_len {args.max_len}); "
        f"codec state per stream {runner.codec.state_bytes_per_slot() / 2**20:.2f} MiB"
    )
    print(
        f"\n{'B':>4} {'step ms':>8} {'steps/s':>8} {'frames/s':>9} {'RT streams':>10} {'TTFA p50':>9} "
        f"{'talker':>7} {'tlk mid':>7} {'pred':>7} {'pred fv':>7} {'codec4f':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>4} {r['step_ms']:>8.2f} {r['steps_per_s']:>8.1f} {r['frames_per_s']:>9.0f} "
            f"{r['streams_rt']:>10.0f} {r['ttfa_ms_p50']:>9.1f} {r['talker_ms']:>7.2f} "
            f"{r['talker_ms_mid']:>7.2f} {r['predictor_ms']:>7.2f} {r['predictor_ms_full_vocab']:>7.2f} "
            f"{r['codec_ms_4f']:>7.2f}"
        )


if __name__ == "__main__":
    main()
