"""`cadence serve | say | bench`. Every flag of `serve` can also be set by an environment variable
(CADENCE_<FLAG>, e.g. CADENCE_PORT=9000); a flag on the command line wins."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cadence.engines import ENGINES, EngineOptions


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"CADENCE_{name.upper()}", default)


def _option(
    p: argparse.ArgumentParser, flag: str, help: str, *, env: str, shown: str | None = None, **kw: Any
) -> None:
    """A flag whose help names its variable and its default (`shown`, else the value it takes). A
    default given as text goes through `type` as the flag's value would, so a bad variable is
    refused with the same usage error as a bad flag."""
    default = "%(default)s" if shown is None else shown
    p.add_argument(flag, help=f"{help} [{env}; default: {default}]", **kw)


def _switch(
    p: argparse.ArgumentParser, flag: str, help: str, *, env: str, off: bool = False, **kw: Any
) -> None:
    """An on/off flag: `--x` turns on what is off (its variable =1), `--no-x` turns off what is on
    (its variable =0). The help says whether the flag is in effect when not given."""
    name = env.removeprefix("CADENCE_")
    if off:
        default = _env(name, "1") != "0"
        text = f"{help} [{env}=0; default: {'off' if default else 'on'}]"
        p.add_argument(flag, action="store_false", default=default, help=text, **kw)
    else:
        default = _env(name, "0") == "1"
        text = f"{help} [{env}=1; default: {'on' if default else 'off'}]"
        p.add_argument(flag, action="store_true", default=default, help=text, **kw)


def _port(text: str) -> int:
    """`--port N`: a TCP port (0: any free one); the socket layer would take a larger number modulo
    65536 and listen on another port than the one asked for."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be a TCP port, 0 to 65535 (not {text!r})")
    return port


def _streams(text: str) -> int | None:
    """`--max-streams N` or `auto` (None)."""
    if text == "auto":
        return None
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError("--max-streams must be a positive number or auto")
    return count


def _share(text: str) -> float:
    """`--kv-memory F`: a share of the GPU's memory, above 0 and below 1."""
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 < share < 1:
        raise argparse.ArgumentTypeError(
            "--kv-memory must be a share of the GPU's memory, above 0 and below 1"
        )
    return share


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cadence serve",
        description="Run the speech gateway. Every flag can also be set by the environment variable in its "
        "brackets; a flag on the command line wins.",
    )
    _option(
        p,
        "--host",
        "listen address (a non-loopback one needs API keys or --insecure)",
        env="CADENCE_HOST",
        default=_env("host", "127.0.0.1"),
    )
    _option(
        p, "--port", "listen port", env="CADENCE_PORT", type=_port, default=_env("port", "8000") or "8000"
    )
    _option(
        p,
        "--engine",
        "the speech engine (null: a tone generator for load tests)",
        env="CADENCE_ENGINE",
        choices=ENGINES,
        default=_env("engine", "espeak"),
    )
    _option(
        p,
        "--model",
        "Qwen3-TTS-12Hz checkpoint directory (--engine qwen3)",
        env="CADENCE_MODEL",
        shown="none",
        default=_env("model", None),
    )
    _option(
        p,
        "--aligner",
        "Qwen3-ForcedAligner directory: word times from the aligner",
        env="CADENCE_ALIGNER",
        shown="none",
        default=_env("aligner", None),
    )
    _switch(
        p,
        "--aligner-forced-times",
        "benchmarks with random weights: the aligner runs as always, its words get the times of the "
        "benchmark's speech rate (engine.alignment.forced_times), so sync probes behave as a trained model's",
        env="CADENCE_ALIGNER_FORCED_TIMES",
    )
    _option(p, "--device", "auto, cpu, cuda or cuda:N", env="CADENCE_DEVICE", default=_env("device", "auto"))
    _option(
        p,
        "--dtype",
        "fp8: bf16 with the talker's decoder linears in FP8 (GPUs of compute capability >= 8.9); "
        "auto: bfloat16 on a GPU, float32 on the CPU",
        env="CADENCE_DTYPE",
        default=_env("dtype", "auto"),
        choices=("auto", "float32", "bfloat16", "fp8"),
    )
    _switch(
        p,
        "--eager",
        "no CUDA graphs (with them, a GPU engine captures its graphs at start-up)",
        env="CADENCE_EAGER",
    )
    _switch(
        p,
        "--no-fused-layers",
        "the talker's and code predictor's layers on eager ops instead of the fused kernels (the one "
        "kernel fallback: the smaller kernels fall back by themselves when their start-up check fails)",
        env="CADENCE_FUSED_LAYERS",
        off=True,
        dest="fused_layers",
    )
    _option(
        p,
        "--scheduler",
        "a setting of the Qwen3 engine's scheduler (engine.qwen3.scheduler.SchedulerConfig), e.g. "
        "--scheduler max_early_codec_rows=96; repeatable (the variable: space-separated)",
        env="CADENCE_SCHEDULER",
        shown="none",
        action="append",
        metavar="FIELD=JSON",
        default=(_env("scheduler", "") or "").split(),
    )
    _option(
        p,
        "--max-streams",
        "the most streams the engine admits, within what its measured cost keeps in real time "
        "(auto: from the GPU's memory for qwen3, from the cost measured at start for espeak)",
        env="CADENCE_MAX_STREAMS",
        type=_streams,
        default=_env("max_streams", "auto") or "auto",
        shown="auto",
    )
    _option(
        p,
        "--kv-memory",
        "qwen3 on a GPU: the share of its memory for talker KV slots, one per stream (--max-streams auto "
        "takes as many as it holds)",
        env="CADENCE_KV_MEMORY",
        type=_share,
        default=_env("kv_memory", "0.4") or "0.4",
        shown="0.25",
    )
    _option(
        p,
        "--upstream",
        "vLLM-Omni server base URL for --engine vllm-omni (e.g. http://host:8091)",
        env="CADENCE_UPSTREAM",
        shown="none",
        default=_env("upstream", None),
    )
    _option(
        p,
        "--upstream-streams",
        "concurrent vLLM-Omni generations; keep <= the server's --max-num-seqs",
        env="CADENCE_UPSTREAM_STREAMS",
        type=int,
        default=_env("upstream_streams", "8") or "8",
    )
    _switch(
        p,
        "--upstream-word-timestamps",
        "ask vLLM-Omni for aligned word times (a server started with --forced-aligner)",
        env="CADENCE_UPSTREAM_WORD_TIMESTAMPS",
    )
    _option(
        p,
        "--api-keys-file",
        "hashed API keys, one per line (python -m gateway.auth new NAME); the keys "
        "themselves may also come in CADENCE_API_KEYS",
        env="CADENCE_API_KEYS_FILE",
        shown="none",
        default=_env("api_keys_file", None),
    )
    _option(
        p,
        "--allowed-origins",
        "comma-separated browser origins allowed to open WebSockets",
        env="CADENCE_ALLOWED_ORIGINS",
        shown="none",
        default=_env("allowed_origins", ""),
    )
    _option(
        p,
        "--voices-dir",
        "where registered voices are kept",
        env="CADENCE_VOICES_DIR",
        shown="none",
        default=_env("voices_dir", None),
    )
    _switch(p, "--insecure", "serve a non-loopback host without API keys", env="CADENCE_INSECURE")
    _option(
        p,
        "--gpus",
        "'all' or N: one engine worker process per GPU behind this gateway; 0: the engine in this process",
        env="CADENCE_GPUS",
        shown="one worker for --engine qwen3 on a GPU",
        default=_env("gpus", None),
    )
    _option(
        p,
        "--gateways",
        "K or auto: K gateway processes share the port (SO_REUSEPORT), each in front of its own share "
        "of the GPUs; needs --redis (auto: one per GPU when --gpus names more than one)",
        env="CADENCE_GATEWAYS",
        default=_env("gateways", "1"),
    )
    _option(
        p,
        "--redis",
        "redis://HOST:PORT/DB: share voices, quotas and control with other replicas",
        env="CADENCE_REDIS",
        shown="none",
        default=_env("redis", None),
    )
    _option(
        p,
        "--replica-id",
        "this replica's name in Redis",
        env="CADENCE_REPLICA_ID",
        shown="host:port",
        default=_env("replica_id", None),
    )
    _option(
        p,
        "--quota-sessions",
        "open WebSocket sessions per API key (across replicas with --redis)",
        env="CADENCE_QUOTA_SESSIONS",
        type=int,
        default=_env("quota_sessions", "100") or "100",
    )
    _option(
        p,
        "--quota-utterances",
        "utterances in progress per API key",
        env="CADENCE_QUOTA_UTTERANCES",
        type=int,
        default=_env("quota_utterances", "64") or "64",
    )
    _option(
        p,
        "--quota-chars-per-minute",
        "text characters per minute per API key",
        env="CADENCE_QUOTA_CHARS_PER_MINUTE",
        type=int,
        default=_env("quota_chars_per_minute", "100000") or "100000",
    )
    _option(
        p,
        "--log-level",
        "debug, info, warning or error",
        env="CADENCE_LOG_LEVEL",
        default=_env("log_level", "info"),
    )
    return p


def serve_main(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    from cadence.engines import build_engine
    from engine.qwen3.scheduler import SchedulerConfig

    try:
        SchedulerConfig().override(args.scheduler)  # a bad setting stops here, not in the engine's worker
    except ValueError as e:
        raise SystemExit(f"--scheduler: {e}") from e
    from gateway.auth import KeyStore

    try:  # a missing file or a bad line stops here, in one line, before the engine loads
        KeyStore.load(args.api_keys_file, os.environ.get("CADENCE_API_KEYS"))
    except OSError as e:
        raise SystemExit(f"--api-keys-file {args.api_keys_file}: {e.strerror}") from e
    except ValueError as e:
        sources = [f"--api-keys-file {args.api_keys_file}"] if args.api_keys_file else []
        sources += ["CADENCE_API_KEYS"] if os.environ.get("CADENCE_API_KEYS") else []
        raise SystemExit(f"{' or '.join(sources)}: {e}") from e
    from gateway.config import GatewayConfig
    from gateway.quotas import QuotaLimits
    from gateway.server import serve

    options = EngineOptions(
        name=args.engine,
        model=args.model,
        aligner=args.aligner,
        aligner_forced_times=args.aligner_forced_times,
        device=args.device,
        dtype=args.dtype,
        eager=args.eager,
        fused_layers=args.fused_layers,
        max_streams=args.max_streams,
        kv_memory=args.kv_memory,
        scheduler=tuple(args.scheduler),
        gpus=args.gpus,
        upstream=args.upstream,
        upstream_streams=args.upstream_streams,
        upstream_word_timestamps=args.upstream_word_timestamps,
    )
    config = GatewayConfig(
        api_keys_file=args.api_keys_file,
        voices_dir=args.voices_dir,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        quota_limits=QuotaLimits(args.quota_sessions, args.quota_utterances, args.quota_chars_per_minute),
        redis_url=args.redis,
        replica_id=args.replica_id or f"{args.host}:{args.port}",
    )
    from cadence.gateways import GatewayPlan, gateway_count, serve_gateways

    gateways = gateway_count(args.gateways, args.gpus)
    if gateways > 1:
        plan = GatewayPlan(options, config, args.host, args.port, args.log_level, args.insecure)
        return serve_gateways(plan, gateways)
    serve(
        build_engine(options),
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

  cadence --version   this release
"""


def version() -> str:
    """The installed release, or the checkout's (pyproject.toml) when run from a source tree."""
    from importlib import metadata
    from pathlib import Path

    try:
        return metadata.version("cadence")
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        if not pyproject.exists():
            return "unknown"
        return str(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"cadence {version()}")
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
