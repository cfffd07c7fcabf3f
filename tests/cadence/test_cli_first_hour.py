"""What a new user meets first: `cadence --version`, `cadence serve --help`, `cadence say` with no
gateway running, and an unknown language."""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path

import pytest

from cadence.cli import _serve_parser, main
from engine.api import InvalidRequest, SynthesisRequest
from engine.espeak.engine import EspeakEngine

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_projects(capsys) -> None:
    release = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cadence {release}"
    assert main(["--help"]) == 0
    assert "cadence --version" in capsys.readouterr().out


def test_every_serve_flag_says_what_it_does_its_variable_and_its_default(monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith("CADENCE_")]:
        monkeypatch.delenv(name)
    parser = _serve_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 20
    for action in flags:
        text = action.help or ""
        assert len(text.split("[")[0].strip()) > 10, f"{action.option_strings}: no description"
        assert "[CADENCE_" in text and "default: " in text, f"{action.option_strings}: {text!r}"
    shown = parser.format_help()
    assert "[CADENCE_PORT; default: 8000]" in " ".join(shown.split())
    assert "[CADENCE_FUSED_LAYERS=0; default: off]" in " ".join(shown.split())


def test_the_help_shows_a_default_taken_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_PORT", "9100")
    monkeypatch.setenv("CADENCE_EAGER", "1")
    shown = " ".join(_serve_parser().format_help().split())
    assert "[CADENCE_PORT; default: 9100]" in shown and "[CADENCE_EAGER=1; default: on]" in shown


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_say_with_no_gateway_says_how_to_start_one(tmp_path, capsys) -> None:
    url = f"ws://127.0.0.1:{closed_port()}/v1/stream"
    assert main(["say", "Hello.", "-o", str(tmp_path / "out.wav"), "--url", url]) == 2
    err = capsys.readouterr().err
    assert f"no gateway is listening at {url}" in err and "cadence serve" in err and "scripts/serve" in err
    assert not (tmp_path / "out.wav").exists()


async def test_an_unknown_language_lists_the_ones_there_are() -> None:
    engine = EspeakEngine()
    await engine.start()
    try:
        with pytest.raises(InvalidRequest, match="unknown language 'Klingon'; choose one of Auto, English"):
            engine.open(SynthesisRequest("s/u", language="Klingon"))
    finally:
        await engine.stop()
