"""`cadence serve | say | bench`. Every flag of `serve` can also be set by an environment variable
(CADENCE_<FLAG>, e.g. CADENCE_PORT=9000); a flag on the command line wins."""

from __future__ import annotations

import argparse
import os
import sys

from cadence.engines import ENGINES, EngineOptions


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"CADENCE_{name.upper()}", default)


def _streams(text: str) -> int | None:
    """`--max-streams N` or `auto` (None)."""
    if text == "auto":
        return None
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError("--max-streams must be a positive number or auto")
    return count


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cadence serve", description="Run the speech gateway.")
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("port", "8000") or 8000))
    p.add_argument("--engine", choices=ENGINES, default=_env("engine", "espeak"))
    p.add_argument("--model", default=_env("model", None), help="Qwen3-TTS checkpoint directory")
    p.add_argument("--aligner", default=_env("aligner", None), help="Qwen3-ForcedAligner directory")
    p.add_argument("--device", default=_env("device", "auto"))
    p.add_argument(
        "--dtype",
        default=_env("dtype", "auto"),
        choices=("auto", "float32", "bfloat16", "fp8"),
        help="fp8: bf16 with the talker's decoder linears in FP8 (GPUs of compute capability >= 8.9)",
    )
    p.add_argument("--eager", action="store_true", default=_env("eager", "0") == "1", help="no CUDA graphs")
    p.add_argument(
        "--codec-overlap",
        action="store_true",
        default=_env("codec_overlap", "0") == "1",
        help="Code2Wav on a CUDA stream of its own, beside the next step's talker",
    )
    p.add_argument(
        "--no-first-chunk-lane",
        dest="first_chunk_lane",
        action="store_false",
        default=_env("first_chunk_lane", "1") != "0",
        help="decode first chunks after the step's later Code2Wav chunks, on one stream",
    )
    p.add_argument(
        "--no-fused-layers",
        dest="fused_layers",
        action="store_false",
        default=_env("fused_layers", "1") != "0",
        help="talker and code predictor layers on eager ops instead of the fused kernels",
    )
    p.add_argument(
        "--scheduler",
        action="append",
        metavar="FIELD=JSON",
        default=(_env("scheduler", "") or "").split(),
        help="a setting of the Qwen3 engine's scheduler (engine.qwen3.scheduler.SchedulerConfig), e.g. "
        "--scheduler urgent_codec_chunks=true (repeatable; the variable: space-separated)",
    )
    p.add_argument(
        "--max-streams",
        type=_streams,
        default=_streams(_env("max_streams", "auto") or "auto"),
        help="the most streams the engine admits, within what its measured cost keeps in real time "
        "(auto: from the GPU's memory for qwen3, from the cost measured at start for espeak)",
    )
    p.add_argument(
        "--upstream",
        default=_env("upstream", None),
        help="vLLM-Omni server base URL for --engine vllm-omni (e.g. http://host:8091)",
    )
    p.add_argument(
        "--upstream-streams",
        type=int,
        default=int(_env("upstream_streams", "8") or 8),
        help="concurrent vLLM-Omni generations; keep <= the server's --max-num-seqs",
    )
    p.add_argument(
        "--upstream-word-timestamps",
        action="store_true",
        default=_env("upstream_word_timestamps", "0") == "1",
        help="ask vLLM-Omni for aligned word times (server started with --forced-aligner)",
    )
    p.add_argument(
        "--api-keys-file",
        default=_env("api_keys_file", None),
        help="hashed API keys, one per line (python -m gateway.auth new NAME); also CADENCE_API_KEYS",
    )
    p.add_argument(
        "--allowed-origins",
        default=_env("allowed_origins", ""),
        help="comma-separated browser origins allowed to open WebSockets",
    )
    p.add_argument("--voices-dir", default=_env("voices_dir", None), help="where registered voices are kept")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=_env("insecure", "0") == "1",
        help="serve a non-loopback host without API keys",
    )
    p.add_argument(
        "--gpus",
        default=_env("gpus", None),
        help="'all' or N: one engine worker process per GPU behind this gateway; 0: the engine "
        "in this process (default: one worker for --engine qwen3 on a GPU)",
    )
    p.add_argument(
        "--redis",
        default=_env("redis", None),
        help="redis://HOST:PORT/DB: share voices, quotas and control with other replicas",
    )
    p.add_argument(
        "--replica-id",
        default=_env("replica_id", None),
        help="this replica's name in Redis (default: host:port)",
    )
    p.add_argument(
        "--quota-sessions",
        type=int,
        default=int(_env("quota_sessions", "100") or 100),
        help="open WebSocket sessions per API key (across replicas with --redis)",
    )
    p.add_argument(
        "--quota-utterances",
        type=int,
        default=int(_env("quota_utterances", "64") or 64),
        help="utterances in progress per API key",
    )
    p.add_argument(
        "--quota-chars-per-minute", type=int, default=int(_env("quota_chars_per_minute", "100000") or 100000)
    )
    p.add_argument("--log-level", default=_env("log_level", "info"))
    return p


def serve_main(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    from cadence.engines import build_engine
    from engine.qwen3.scheduler import SchedulerConfig

    try:
        SchedulerConfig().override(args.scheduler)  # a bad setting stops here, not in the engine's worker
    except ValueError as e:
        raise SystemExit(f"--scheduler: {e}") from e
    from gateway.config import GatewayConfig
    from gateway.quotas import QuotaLimits
    from gateway.server import serve

    engine = build_engine(
        EngineOptions(
            name=args.engine,
            model=args.model,
            aligner=args.aligner,
            device=args.device,
            dtype=args.dtype,
            eager=args.eager,
            codec_overlap=args.codec_overlap,
            first_chunk_lane=args.first_chunk_lane,
            fused_layers=args.fused_layers,
            max_streams=args.max_streams,
            scheduler=tuple(args.scheduler),
            gpus=args.gpus,
            upstream=args.upstream,
            upstream_streams=args.upstream_streams,
            upstream_word_timestamps=args.upstream_word_timestamps,
        )
    )
    config = GatewayConfig(
        api_keys_file=args.api_keys_file,
        voices_dir=args.voices_dir,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        quota_limits=QuotaLimits(args.quota_sessions, args.quota_utterances, args.quota_chars_per_minute),
        redis_url=args.redis,
        replica_id=args.replica_id or f"{args.host}:{args.port}",
    )
    serve(
        engine,
        host=args.host,
        port=args.port,
        config=config,
        log_level=args.log_level,
        insecure=args.insecure,
    )
    return 0


USAGE = """usage: cadence <command> [options]

commands:
  serve   run the gateway (cadence serve --help)
  say     speak a text through a running gateway into a WAV file (cadence say --help)
  bench   the closed-loop load test / benchmark (cadence bench --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve_main(rest)
    if command == "say":
        from clients.say import say_main

        return say_main(rest)
    if command == "bench":
        from clients.loadtest import bench_main

        return bench_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
