"""How `cadence serve` starts and stops at its edges: the exit status after a signal's orderly
shutdown, bad flags and variables refused with a usage error (not a traceback), a port that is
out of range or taken, and a stop that arrives while the gateway processes are still starting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from cadence.cli import _serve_parser, serve_main
from cadence.engines import EngineOptions
from cadence.gateways import GatewayPlan, serve_gateways
from gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(port: int, process: subprocess.Popen[bytes], within_s: float = 40) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the gateway exited before it was ready"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the gateway was not ready in time")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_and_exits_0_without_a_traceback(signum: int) -> None:
    """The signal asks for the orderly shutdown; once it is done the process ends with status 0,
    not by the signal again (143) nor with a KeyboardInterrupt traceback (Ctrl-C)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CADENCE_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--engine", "null", "--port", str(port)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_ready(port, process)
        process.send_signal(signum)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = err.decode(errors="replace")
    assert "Shutting down" in text  # the orderly shutdown ran
    assert "Traceback" not in text, text
    assert process.returncode == 0, (process.returncode, text[-2000:])


def test_a_port_out_of_range_is_refused_not_taken_modulo_65536(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:  # the parser alone: a port it let through would be served
        _serve_parser().parse_args(["--engine", "null", "--port", "99999"])
    assert stopped.value.code == 2
    assert "0 to 65535" in capsys.readouterr().err
    assert _serve_parser().parse_args(["--port", "0"]).port == 0


@pytest.mark.parametrize(
    ("variable", "value", "flag"),
    [
        ("CADENCE_PORT", "abc", "--port"),
        ("CADENCE_PORT", "70000", "--port"),
        ("CADENCE_MAX_STREAMS", "0", "--max-streams"),
        ("CADENCE_KV_MEMORY", "2", "--kv-memory"),
        ("CADENCE_QUOTA_SESSIONS", "many", "--quota-sessions"),
        ("CADENCE_UPSTREAM_STREAMS", "x", "--upstream-streams"),
    ],
)
def test_a_bad_variable_is_a_usage_error_and_its_flag_still_wins(
    variable: str, value: str, flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(variable, value)
    parser = _serve_parser()  # building the parser does not fail on the variable
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args([])
    assert stopped.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    good = {"--port": "9000", "--max-streams": "4", "--kv-memory": "0.5"}.get(flag, "7")
    assert getattr(parser.parse_args([flag, good]), flag[2:].replace("-", "_")) is not None


def test_the_defaults_keep_their_types(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("CADENCE_")]:
        monkeypatch.delenv(name)
    args = _serve_parser().parse_args([])
    assert (args.port, args.max_streams, args.kv_memory) == (8000, None, 0.4)
    assert (args.upstream_streams, args.quota_sessions, args.quota_utterances) == (8, 100, 64)
    assert args.quota_chars_per_minute == 100000
    monkeypatch.setenv("CADENCE_PORT", "9100")
    monkeypatch.setenv("CADENCE_MAX_STREAMS", "12")
    args = _serve_parser().parse_args([])
    assert (args.port, args.max_streams) == (9100, 12)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--gateways", "two"], "--gateways must be a positive number or auto"),
        (["--gpus", "two"], "--gpus must be 'all' or a positive number"),
        (["--gpus", "two", "--gateways", "auto"], "--gpus must be 'all' or a positive number"),
    ],
)
def test_a_bad_count_is_a_clear_error(flags: list[str], says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("CADENCE_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as stopped:
        serve_main(["--engine", "null", "--port", str(free_port()), *flags])
    assert str(stopped.value.code) == says


def test_several_gateways_on_a_port_in_use_say_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        config = GatewayConfig(redis_url="redis://127.0.0.1:1/0")
        plan = GatewayPlan(EngineOptions(name="null"), config, "127.0.0.1", port, "warning", False)
        with pytest.raises(SystemExit, match=f"cannot bind 127.0.0.1:{port}: .*in use"):
            serve_gateways(plan, 2)


HURRIED = """
import os, signal, sys
from cadence.engines import EngineOptions
from cadence.gateways import GatewayPlan, Supervisor
from gateway.config import GatewayConfig

class Hurried(Supervisor):
    last = None

    def _start(self, index):
        Hurried.last = self
        super()._start(index)
        if index == 0:  # the stop arrives while the later gateways are still to start
            os.kill(os.getpid(), signal.SIGTERM)

if __name__ == "__main__":  # a spawned gateway imports this module again
    config = GatewayConfig(drain_timeout_s=1.0, replica_id="t")
    plan = GatewayPlan(EngineOptions(name="null"), config, "127.0.0.1", int(sys.argv[1]), "warning", False)
    code = Hurried(plan, [None, None, None]).run()
    print("exit codes", [p.exitcode for p in Hurried.last.processes if p is not None], flush=True)
    sys.exit(code)
"""


def test_a_stop_while_the_gateways_start_stops_them_all_at_once(tmp_path: Path) -> None:
    """No gateway started after the signal is left to run until the parent's deadline (drain + 10 s)
    and then killed: the parent starts no more, and stops at once the ones it started."""
    script = tmp_path / "hurried.py"
    script.write_text(textwrap.dedent(HURRIED))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(free_port())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    # each one it started stopped on the signal (by it before serving, or after its drain); none was
    # killed at the deadline
    assert "exit codes [" in done.stdout.decode(), done.stdout
    codes = done.stdout.decode().split("exit codes ")[1].strip()
    assert "-9" not in codes, codes
    assert took < 8, f"the parent waited {took:.1f} s for gateways it never signalled"
