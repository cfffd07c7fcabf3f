"""How soon a crashed engine worker serves again: `cadence serve` up to /readyz, its engine worker
killed (SIGKILL), the time until the pool's replacement is counted alive, then one stream through the
gateway to show it serves.

    python -m bench.worker_replacement -o worker-replacement.json \
        --bench-args "--voice ryan --language English --model-shapes 1.7B" -- --engine qwen3 --model CKPT
    python -m bench.worker_replacement -- --engine espeak --gpus 1      # the same on a CPU worker
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import free_port, run_record, write_json


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def engine_worker(server: int) -> int:
    """The pid of the server's engine worker: its multiprocessing child that is not the tracker."""
    for pid in _descendants(server):
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline:
            return pid
    raise RuntimeError("the server has no engine worker process")


def wait_for(check: Any, deadline_s: float, server: subprocess.Popen[bytes]) -> float:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode})")
        try:
            if check():
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not within {deadline_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=None)
    parser.add_argument("--bench-args", default="", help="more `cadence bench` flags for the stream after")
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: `cadence serve` flags")
    args = parser.parse_args(argv)
    serve_args = [a for a in args.serve_args if a != "--"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--port", str(port), *serve_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: _get(f"{base}/readyz").get("ready"), args.deadline_s, server)
        ready_s = time.monotonic() - started
        print(f"ready {ready_s:.1f} s after the server started")
        worker = engine_worker(server.pid)
        os.kill(worker, signal.SIGKILL)

        def replaced() -> bool:
            engine = _get(f"{base}/v1/load")["engine"]
            figures = engine["figures"]
            return bool(
                engine["ready"]
                and figures["worker_restarts"] >= 1
                and figures["workers_alive"] == figures["workers"]
            )

        replaced_s = wait_for(replaced, args.deadline_s, server)
        print(f"worker {worker} killed: its replacement alive {replaced_s:.1f} s later")
        after = Path(os.environ.get("TMPDIR", "/tmp")) / f"worker-replacement-{port}.json"
        bench = subprocess.run(
            [sys.executable, "-m", "cadence.cli", "bench", "--url", f"ws://127.0.0.1:{port}/v1/stream"]
            + ["--concurrency", "1", "--min-seconds", "3", "--max-seconds", "10", "--warmup-seconds", "0"]
            + ["-o", str(after), *shlex.split(args.bench_args)],
            capture_output=True,
            timeout=120,
        )
        point = json.loads(after.read_text())["points"][0] if bench.returncode == 0 else {}
        print(f"then one stream: TTFA p50 {point.get('ttfa_p50_ms')} ms, errors {point.get('errors')}")
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    record = {
        **run_record(argv),
        "ready_s": round(ready_s, 1),
        "replacement_alive_s": round(replaced_s, 1),
        "after": {k: point.get(k) for k in ("requests", "errors", "ttfa_p50_ms", "ttfa_p90_ms", "rtf_p90")},
    }
    print(json.dumps(record["after"]))
    if args.out is not None:
        write_json(args.out, record)
    return 0 if point and not point.get("errors") else 1


if __name__ == "__main__":
    raise SystemExit(main())
