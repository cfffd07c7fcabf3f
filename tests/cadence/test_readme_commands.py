"""The README's commands as a new user types them, each a real `cadence` process against a real
gateway on loopback: what `cadence say` writes and where, what it says when something is wrong
(one line and a non-zero status, never a traceback), Ctrl-C mid-stream, and the same for
`cadence bench`, `cadence serve --api-keys-file` and `python -m gateway.auth new NAME`."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.auth import new_key

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CADENCE_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@dataclass
class Gateway:
    url: str
    key: str


def start_gateway(engine: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli", "serve", "--engine", engine, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the gateway exited before it was ready"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the gateway was not ready in time")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    """`cadence serve --engine espeak` with one API key."""
    key, stored = new_key("readme", iterations=1000)
    process, port = start_gateway("espeak", clean_env(CADENCE_API_KEYS=stored.line()))
    try:
        yield Gateway(f"ws://127.0.0.1:{port}/v1/stream", key)
    finally:
        stop(process)


def cadence(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "cadence.cli", *args],
        cwd=cwd,
        env=clean_env(),
        input=None if stdin is None else stdin.encode(),
        capture_output=True,
        timeout=90,
    )


def one_line_error(result: subprocess.CompletedProcess[bytes], lines: int = 1) -> str:
    """The whole of stderr: a line (or the few given), no traceback, no interpreter noise."""
    err = result.stderr.decode(errors="replace").strip()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert len(err.splitlines()) == lines, err
    return err


def read_wav(data: bytes) -> tuple[int, int]:
    with wave.open(io.BytesIO(data)) as wav:
        return wav.getframerate(), wav.getnframes()


def test_the_readme_say_command_writes_a_wav_whose_words_fit_its_audio(
    gateway: Gateway, tmp_path: Path
) -> None:
    result = cadence(
        "say",
        "Hello from Cadence.",
        "-o",
        "hello.wav",
        "--words",
        "--url",
        gateway.url,
        "--token",
        gateway.key,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rate, frames = read_wav((tmp_path / "hello.wav").read_bytes())
    rows = [line.split() for line in result.stdout.decode().splitlines()]
    assert [row[2] for row in rows] == ["Hello", "from", "Cadence"]
    assert abs(float(rows[-1][1]) - frames / rate) < 0.05  # the last word ends where the audio does


@pytest.mark.parametrize("name", ["hello.mp3", "hello.flac", "hello.opus", "hello.ogg"])
def test_say_refuses_an_output_name_of_another_format_instead_of_writing_wav_into_it(
    gateway: Gateway, tmp_path: Path, name: str
) -> None:
    result = cadence("say", "Hello.", "-o", name, "--url", gateway.url, "--token", gateway.key, cwd=tmp_path)
    assert result.returncode == 2
    err = result.stderr.decode()
    assert "WAV" in err and "/v1/audio/speech" in err, err
    assert not (tmp_path / name).exists()


def test_say_dash_output_writes_the_wav_to_stdout_and_the_words_to_stderr(
    gateway: Gateway, tmp_path: Path
) -> None:
    result = cadence(
        "say",
        "Hello there.",
        "-o",
        "-",
        "--words",
        "--url",
        gateway.url,
        "--token",
        gateway.key,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rate, frames = read_wav(result.stdout)
    assert rate == 24000 and frames > rate // 4
    assert "Hello" in result.stderr.decode() and "there" in result.stderr.decode()
    assert list(tmp_path.iterdir()) == []  # no file named "-"


def test_say_into_a_missing_folder_is_one_line(gateway: Gateway, tmp_path: Path) -> None:
    result = cadence(
        "say", "Hello.", "-o", "no/such/dir/x.wav", "--url", gateway.url, "--token", gateway.key, cwd=tmp_path
    )
    assert result.returncode == 2
    assert "no/such/dir/x.wav" in one_line_error(result)


@pytest.mark.parametrize("text", ["", "   "])
def test_say_with_nothing_to_say_is_an_error_not_an_empty_wav(
    gateway: Gateway, tmp_path: Path, text: str
) -> None:
    result = cadence("say", text, "--url", gateway.url, "--token", gateway.key, cwd=tmp_path)
    assert result.returncode == 2
    assert "nothing to say" in result.stderr.decode()
    assert not (tmp_path / "out.wav").exists()


def test_say_at_a_wrong_path_names_the_stream_endpoint(gateway: Gateway, tmp_path: Path) -> None:
    wrong = gateway.url.replace("/v1/stream", "/v1/wrong")
    result = cadence("say", "Hello.", "--url", wrong, "--token", gateway.key, cwd=tmp_path)
    assert result.returncode == 2
    err = one_line_error(result)
    assert wrong in err and "/v1/stream" in err.replace(wrong, ""), err


@pytest.mark.parametrize("token", [None, "ck_readme_wrong", "garbage"])
def test_say_without_a_good_key_says_to_pass_one_with_token(
    gateway: Gateway, tmp_path: Path, token: str | None
) -> None:
    extra = [] if token is None else ["--token", token]
    result = cadence("say", "Hello.", "--url", gateway.url, *extra, cwd=tmp_path)
    assert result.returncode == 2
    err = one_line_error(result)
    assert "--token" in err and "refused" in err, err
    assert not (tmp_path / "out.wav").exists()


def test_ctrl_c_mid_stream_ends_say_with_one_line_and_status_130(tmp_path: Path) -> None:
    """The null engine speaks in real time, so a long text is still streaming when Ctrl-C comes."""
    server, port = start_gateway("null", clean_env())
    try:
        text = " ".join(["This sentence keeps the stream going for a while."] * 20)
        say = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cadence.cli",
                "say",
                text,
                "--words",
                "--url",
                f"ws://127.0.0.1:{port}/v1/stream",
            ],
            cwd=tmp_path,
            env=clean_env(PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert say.stdout is not None
        assert say.stdout.readline()  # a word has come: the stream is under way
        say.send_signal(signal.SIGINT)
        _, err = say.communicate(timeout=30)
    finally:
        stop(server)
    result = subprocess.CompletedProcess(say.args, say.returncode, b"", err)
    assert "interrupted" in one_line_error(result)
    assert say.returncode == 130
    assert not (tmp_path / "out.wav").exists()


def test_bench_with_no_gateway_is_one_line(tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{free_port()}/v1/stream"
    result = cadence("bench", "--url", url, "--corpus", str(ROOT / "deploy/bench/corpus.jsonl"), cwd=tmp_path)
    assert result.returncode == 2
    assert f"no gateway is listening at {url}" in one_line_error(result, lines=2)  # and how to start one


def test_bench_with_a_missing_corpus_is_one_line(tmp_path: Path) -> None:
    result = cadence("bench", "--corpus", "missing.jsonl", cwd=tmp_path)
    assert result.returncode == 2
    assert "missing.jsonl" in one_line_error(result)


@pytest.mark.parametrize("content", [None, "ck_readme_the_key_itself\n"])
def test_serve_with_a_missing_or_malformed_keys_file_is_one_line(tmp_path: Path, content: str | None) -> None:
    keys = tmp_path / "keys.txt"
    if content is not None:
        keys.write_text(content)
    result = cadence(
        "serve", "--engine", "null", "--port", str(free_port()), "--api-keys-file", str(keys), cwd=tmp_path
    )
    assert result.returncode != 0
    assert "keys.txt" in one_line_error(result)


def test_a_new_key_with_a_bad_name_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.auth", "new", "alice_bob"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "letters, digits or '-'" in one_line_error(result)
