"""Shared by the bench scripts: the real gateway in its own process, and the run record."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(engine_name: str, port: int, engine_options: dict[str, Any]) -> None:
    from gateway.config import GatewayConfig
    from gateway.server import serve

    if engine_name == "null":
        from engine.null import NullEngine

        engine: Any = NullEngine(**engine_options)
    else:
        from engine.espeak.engine import EspeakEngine

        engine = EspeakEngine(**engine_options)
    serve(engine, "127.0.0.1", port, GatewayConfig(), log_level="warning")


@dataclass(frozen=True)
class GatewayChild:
    url: str  # the stream endpoint, ws://...
    pid: int


def cpu_times(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds a process has used so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


@contextmanager
def gateway_child(engine_name: str, **engine_options: Any) -> Iterator[GatewayChild]:
    """Run the real gateway (uvicorn + the named engine) in a child process; yield its URL and pid."""
    port = free_port()
    process = mp.get_context("spawn").Process(
        target=_serve, args=(engine_name, port, engine_options), daemon=True
    )
    process.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or not process.is_alive():
            process.terminate()
            raise RuntimeError("the gateway did not become ready")
        time.sleep(0.1)
    try:
        assert process.pid is not None
        yield GatewayChild(f"ws://127.0.0.1:{port}/v1/stream", process.pid)
    finally:
        process.terminate()
        process.join(timeout=10)


@contextmanager
def gateway_process(engine_name: str, **engine_options: Any) -> Iterator[str]:
    """Run the real gateway (uvicorn + the named engine) in a child process; yield its stream URL."""
    with gateway_child(engine_name, **engine_options) as child:
        yield child.url


def run_record(argv: list[str] | None) -> dict[str, Any]:
    args = sys.argv[1:] if argv is None else argv
    module = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "bench"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "commit": commit,
        "python": platform.python_version(),
        # other work on the machine skews every figure here: the 1-minute load average at the start
        "load_average_1m": round(os.getloadavg()[0], 2),
        # output paths by their file name: the record names no machine's folders
        "command": shlex.join(
            ["python", "-m", f"bench.{module}", *(Path(a).name if a.startswith("/") else a for a in args)]
        ),
    }


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
