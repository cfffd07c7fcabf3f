"""Build the engine named on the command line. Imports are lazy: each engine pulls in only its own
dependencies (the eSpeak engine needs no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.api import Engine

ENGINES = ("espeak", "qwen3", "vllm-omni", "null")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    name: str = "espeak"
    model: str | None = None  # Qwen3-TTS checkpoint directory
    aligner: str | None = None  # Qwen3-ForcedAligner checkpoint directory
    aligner_forced_times: bool = False  # benchmarks: words at the benchmark's speech rate (forced_times)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "fp8" (bf16 + FP8 talker linears)
    eager: bool = False  # no CUDA graphs
    fused_layers: bool = True  # talker and code predictor layers through the fused kernels (CUDA bf16)
    # the most streams the engine admits; within it, the engine admits what its measured cost keeps
    # in real time. None ("auto"): qwen3, the talker slots the KV budget holds; espeak, what its
    # worker keeps in real time alone, measured at start; null, no bound
    max_streams: int | None = None
    kv_memory: float = 0.4  # qwen3 on a GPU: the share of its memory given to talker KV slots
    scheduler: tuple[str, ...] = ()  # qwen3: "FIELD=JSON" settings of engine.qwen3.scheduler.SchedulerConfig
    upstream: str | None = None  # vllm-omni: the vLLM-Omni server's base URL
    upstream_streams: int = 8  # vllm-omni: concurrent upstream generations (<= its --max-num-seqs)
    upstream_word_timestamps: bool = False  # vllm-omni: the server runs --forced-aligner
    # "all" or N: one engine worker process per GPU (engine.workers); "0": the engine in the
    # gateway's process; None: one worker for the Qwen3 engine on a GPU (see default_gpus)
    gpus: str | None = None


def gpu_count(gpus: str) -> int:
    """`--gpus all` -> the visible CUDA devices; `--gpus N` -> N."""
    if gpus != "all":
        try:
            count = int(gpus)
        except ValueError:
            count = 0
        if count < 1:
            raise SystemExit("--gpus must be 'all' or a positive number")
        return count
    import torch

    count = torch.cuda.device_count()
    if count < 1:
        raise SystemExit("--gpus all: no CUDA device is visible")
    return count


def build_worker_pool(options: EngineOptions) -> Engine:
    """One worker process per GPU, each seeing only its own device (CUDA_VISIBLE_DEVICES)."""
    import functools
    from dataclasses import replace

    from engine.workers import WorkerPoolEngine, WorkerSpec

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else None
    device = options.device if options.device in ("auto", "cpu") else "cuda"
    specs = []
    for i in range(gpu_count(options.gpus or "1")):
        single = replace(options, gpus="0", device=device)  # in the worker: the engine itself
        gpu = ids[i] if ids and i < len(ids) else str(i)
        specs.append(
            WorkerSpec(functools.partial(build_engine, single), {"CUDA_VISIBLE_DEVICES": gpu}, f"gpu{gpu}")
        )
    return WorkerPoolEngine(specs)


def default_gpus(options: EngineOptions, cuda_available: bool) -> str | None:
    """The Qwen3 engine on a GPU runs in a worker process unless told otherwise: its step thread then
    shares no interpreter lock with the gateway's event loop. An explicit device index keeps it
    in-process on that device."""
    if options.gpus is not None:
        return None if options.gpus == "0" else options.gpus
    on_gpu = options.device == "cuda" or (options.device == "auto" and cuda_available)
    return "1" if options.name == "qwen3" and on_gpu else None


def build_engine(options: EngineOptions) -> Engine:
    gpus = options.gpus
    if gpus is None and options.name == "qwen3" and options.device in ("auto", "cuda"):
        import torch

        gpus = default_gpus(options, torch.cuda.is_available())
    if gpus and gpus != "0":
        from dataclasses import replace

        return build_worker_pool(replace(options, gpus=gpus))
    if options.aligner:
        from dataclasses import replace

        return with_aligner(build_engine(replace(options, aligner=None)), options)
    if options.name == "espeak":
        from engine.espeak.engine import EspeakEngine

        return EspeakEngine(max_streams=options.max_streams)
    if options.name == "null":
        from engine.null import NullEngine

        return NullEngine() if options.max_streams is None else NullEngine(max_streams=options.max_streams)
    if options.name == "vllm-omni":
        if not options.upstream:
            raise SystemExit(
                "--engine vllm-omni needs --upstream URL (a vLLM-Omni server, e.g. http://host:8091)"
            )
        from engine.vllm_omni.engine import VllmOmniConfig, VllmOmniEngine

        return VllmOmniEngine(
            VllmOmniConfig(
                upstream=options.upstream,
                max_streams=options.upstream_streams,
                queue_limit=64
                if options.max_streams is None
                else max(0, options.max_streams - options.upstream_streams),
                word_timestamps=options.upstream_word_timestamps,
            )
        )
    if options.name == "qwen3":
        return build_qwen3(options)
    raise SystemExit(f"unknown engine {options.name!r}; choose one of {', '.join(ENGINES)}")


def build_qwen3(options: EngineOptions) -> Engine:
    if not options.model:
        raise SystemExit("--engine qwen3 needs --model DIR (a Qwen3-TTS-12Hz checkpoint directory)")
    import torch

    from engine.qwen3.engine import Qwen3Engine, Qwen3EngineConfig
    from engine.qwen3.runner import RunnerConfig
    from engine.qwen3.scheduler import SchedulerConfig

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = options.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    fp8 = dtype_name == "fp8"
    if fp8:
        from engine.qwen3.models.fp8 import fp8_unsupported_reason

        reason = fp8_unsupported_reason(device)
        if reason:
            raise SystemExit(f"--dtype fp8: {reason}")
        dtype_name = "bfloat16"  # everything else stays bf16; the chosen linears are quantised after loading
    if device.startswith("cuda"):  # talker KV: about 56 MiB per 1.7B stream
        kv_budget = int(
            options.kv_memory * torch.cuda.get_device_properties(torch.device(device)).total_memory
        )
    else:
        kv_budget = 2 << 30
    # the batch, its Code2Wav rows and the step's token budget follow the talker slots the KV budget
    # holds (SchedulerConfig.sized), and so do the streams with --max-streams auto
    scheduler = SchedulerConfig(
        codec_slots=options.max_streams or 0, max_batch=0, max_codec_rows=0, max_tokens_per_step=0
    ).override(options.scheduler)
    config = Qwen3EngineConfig(
        scheduler=scheduler,
        runner=RunnerConfig(
            enforce_eager=options.eager or device == "cpu", fused_layers=options.fused_layers
        ),
        kv_budget_bytes=kv_budget,
    )
    engine = Qwen3Engine.from_pretrained(options.model, device, getattr(torch, dtype_name), config)
    if fp8:  # before start(): the CUDA graphs are captured over the quantised layers
        from engine.qwen3.models.fp8 import DEFAULT_TARGETS, quantize_talker

        quantize_talker(engine.talker, DEFAULT_TARGETS)
    return engine


def with_aligner(engine: Engine, options: EngineOptions) -> Engine:
    """Words from the Qwen3 forced aligner in `options.aligner` (loaded in start(), off the loop)."""
    from engine.alignment.engine import AlignedEngine
    from engine.alignment.forced_times import ForcedTimesAligner

    def load_aligner() -> object:
        import torch

        from aligner.qwen3 import Qwen3ForcedAligner

        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        aligner = Qwen3ForcedAligner.from_directory(options.aligner or "", device)
        return ForcedTimesAligner(aligner) if options.aligner_forced_times else aligner

    return AlignedEngine(engine, load_aligner)  # type: ignore[arg-type]
