"""Build the engine named on the command line. Imports are lazy: each engine pulls in only its own
dependencies (the eSpeak engine needs no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import Engine

ENGINES = ("espeak", "qwen3", "null")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    name: str = "espeak"
    model: str | None = None  # Qwen3-TTS checkpoint directory
    aligner: str | None = None  # Qwen3-ForcedAligner checkpoint directory
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    eager: bool = False  # no CUDA graphs
    max_streams: int = 256  # concurrent streams the engine admits


def build_engine(options: EngineOptions) -> Engine:
    if options.name == "espeak":
        from engine.espeak import EspeakEngine

        return EspeakEngine()
    if options.name == "null":
        from engine.null import NullEngine

        return NullEngine()
    if options.name == "qwen3":
        if not options.model:
            raise SystemExit("--engine qwen3 needs --model DIR (a Qwen3-TTS-12Hz checkpoint directory)")
        import torch

        from engine.qwen3_engine import Qwen3Engine, Qwen3EngineConfig

        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype_name = options.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
        batch = min(512, options.max_streams)
        config = Qwen3EngineConfig(
            max_streams=options.max_streams, max_batch=batch, enforce_eager=options.eager or device == "cpu"
        )
        return Qwen3Engine.from_pretrained(options.model, device, getattr(torch, dtype_name), config)
    raise SystemExit(f"unknown engine {options.name!r}; choose one of {', '.join(ENGINES)}")
