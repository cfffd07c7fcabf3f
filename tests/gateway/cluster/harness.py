"""A real cluster on loopback: redis-server and nginx (configs from deploy/) in front of
`cadence serve` replicas, each a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (OSError, httpx.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout_s} s")
        time.sleep(0.05)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Replica:
    name: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    workdir: Path
    redis_port: int = field(default_factory=free_port)
    nginx_port: int = field(default_factory=free_port)
    replicas: list[Replica] = field(default_factory=list)
    redis: subprocess.Popen[bytes] | None = None
    nginx: subprocess.Popen[bytes] | None = None
    _starts: int = 0

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def front(self) -> str:
        return f"http://127.0.0.1:{self.nginx_port}"

    # -- redis --------------------------------------------------------------------------------
    def start_redis(self, persistent: bool = True) -> None:
        """redis-server on `redis_port` with deploy/'s config; not `persistent`: an empty store
        that keeps nothing (a fresh directory, no AOF, no snapshots)."""
        self._starts += 1
        data = self.workdir / ("redis" if persistent else f"redis-volatile-{self._starts}")
        data.mkdir(exist_ok=True)
        volatile = [] if persistent else ["--appendonly", "no", "--save", ""]
        self.redis = subprocess.Popen(
            [
                "redis-server",
                str(DEPLOY / "redis" / "redis.conf"),
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(data),
                "--daemonize",
                "no",
                "--logfile",
                "",
                "--maxmemory",
                "256mb",
                *volatile,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open(self.redis_port), 10, "redis-server")

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.send_signal(signal.SIGTERM)  # a clean shutdown: AOF flushed
            self.redis.wait(10)
            self.redis = None

    def kill_redis(self) -> None:
        """SIGKILL: no shutdown at all (what the last second of the AOF held may be lost)."""
        if self.redis is not None:
            self.redis.send_signal(signal.SIGKILL)
            self.redis.wait(10)
            self.redis = None

    def pause_redis(self) -> None:
        """SIGSTOP: the store hangs; its sockets stay open and nothing answers."""
        assert self.redis is not None
        self.redis.send_signal(signal.SIGSTOP)

    def resume_redis(self) -> None:
        assert self.redis is not None
        self.redis.send_signal(signal.SIGCONT)

    # -- replicas -----------------------------------------------------------------------------
    def start_replicas(
        self, count: int, engine: str, keys_file: Path, *extra: str, env_extra: dict[str, str] | None = None
    ) -> None:
        for i in range(count):
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
            env.pop("CADENCE_API_KEYS", None)
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cadence.cli",
                    "serve",
                    "--engine",
                    engine,
                    "--port",
                    str(port),
                    "--redis",
                    self.redis_url,
                    "--replica-id",
                    f"r{i + 1}",
                    "--api-keys-file",
                    str(keys_file),
                    "--log-level",
                    "warning",
                    *extra,
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(self.workdir / f"r{i + 1}.log", "wb"),
            )
            self.replicas.append(Replica(f"r{i + 1}", port, process))
        for replica in self.replicas:
            wait_until(
                lambda r=replica: httpx.get(f"{r.http}/readyz", timeout=1).status_code == 200,
                30,
                f"replica {replica.name}",
            )

    def kill(self, replica: Replica) -> None:
        replica.process.send_signal(signal.SIGKILL)
        replica.process.wait(10)

    # -- nginx --------------------------------------------------------------------------------
    def start_nginx(self) -> None:
        conf_dir = self.workdir / "nginx"
        conf_dir.mkdir(exist_ok=True)
        for sub in ("logs", "tmp"):
            (conf_dir / sub).mkdir(exist_ok=True)
        shutil.copy(DEPLOY / "nginx" / "cadence-locations.conf", conf_dir / "cadence-locations.conf")
        recipe = (DEPLOY / "nginx" / "cadence-cluster.conf").read_text()
        servers = "".join(
            f"    server 127.0.0.1:{r.port} max_fails=1 fail_timeout=10s;\n" for r in self.replicas
        )
        recipe = re.sub(r"(?m)^    server 127\.0\.0\.1:\d+ [^\n]*\n", "", recipe)
        recipe = recipe.replace("    least_conn;\n", "    least_conn;\n" + servers)
        recipe = recipe.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{self.nginx_port};")
        recipe = recipe.replace("/var/log/nginx/cadence.log", str(conf_dir / "logs" / "access.log"))
        (conf_dir / "cadence-cluster.conf").write_text(recipe)
        tmp = conf_dir / "tmp"
        (conf_dir / "nginx.conf").write_text(
            f"worker_processes 1;\npid {conf_dir / 'nginx.pid'};\nerror_log {conf_dir / 'logs' / 'error.log'};\n"
            "daemon off;\nevents { worker_connections 1024; }\n"
            "http {\n"
            f"  client_body_temp_path {tmp}/body;\n  proxy_temp_path {tmp}/proxy;\n"
            f"  fastcgi_temp_path {tmp}/fastcgi;\n  uwsgi_temp_path {tmp}/uwsgi;\n  scgi_temp_path {tmp}/scgi;\n"
            "  include cadence-cluster.conf;\n}\n"
        )
        self.nginx = subprocess.Popen(
            [
                "nginx",
                "-p",
                str(conf_dir),
                "-c",
                str(conf_dir / "nginx.conf"),
                "-e",
                str(conf_dir / "logs" / "error.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: httpx.get(f"{self.front}/nginx-health", timeout=1).status_code == 200, 10, "nginx")

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.send_signal(signal.SIGQUIT)
            try:
                self.nginx.wait(5)
            except subprocess.TimeoutExpired:
                self.nginx.kill()
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            try:
                replica.process.wait(10)
            except subprocess.TimeoutExpired:
                replica.process.kill()
        if self.redis is not None:
            self.redis.kill()  # also a paused one
            self.redis.wait(5)


@contextlib.contextmanager
def two_keyed_replicas(workdir: Path, env_extra: dict[str, str]) -> Iterator[tuple[Cluster, tuple[str, str]]]:
    """Redis and two eSpeak replicas that know the keys `alpha` and `beta` (`env_extra` for both:
    one CADENCE_TOKEN_SECRET makes a token minted on one honoured by the other)."""
    from gateway.auth import new_key

    key_a, stored_a = new_key("alpha", iterations=1_000)
    key_b, stored_b = new_key("beta", iterations=1_000)
    keys_file = workdir / "keys"
    keys_file.write_text(f"{stored_a.line()}\n{stored_b.line()}\n")
    c = Cluster(workdir)
    try:
        c.start_redis()
        c.start_replicas(2, "espeak", keys_file, env_extra=env_extra)
        yield c, (key_a, key_b)
    finally:
        c.stop()


needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (scripts/test installs it)"
)


def tools_available() -> bool:
    return all(shutil.which(tool) for tool in ("redis-server", "nginx"))


def redis_cli(server: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["redis-cli", "-p", str(server.redis_port), *args], capture_output=True, text=True, timeout=10
    )


@contextlib.asynccontextmanager
async def endless_script(server: Cluster, busy_reply_ms: int) -> AsyncIterator[None]:
    """A Lua script that never ends: the store answers nothing, then (after `busy_reply_ms`) every
    command with BUSY, until `SCRIPT KILL` (the script is killed on leaving in any case)."""
    await asyncio.to_thread(redis_cli, server, "config", "set", "busy-reply-threshold", str(busy_reply_ms))
    script = await asyncio.create_subprocess_exec(
        *("redis-cli", "-p", str(server.redis_port), "eval", "while true do end", "0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        if script.returncode is None:
            script.kill()
            await script.wait()
