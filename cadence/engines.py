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
        from engine.qwen3_engine import Qwen3Engine

        return Qwen3Engine.from_options(
            model_dir=options.model,
            device=options.device,
            dtype=options.dtype,
            eager=options.eager,
            max_streams=options.max_streams,
        )
    raise SystemExit(f"unknown engine {options.name!r}; choose one of {', '.join(ENGINES)}")
