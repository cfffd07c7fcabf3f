"""The arrows of the house (shared design: engine and aligner never import gateway or clients;
the gateway sees only the public faces of engine and aligner; clients import only gateway.messages
and install without torch; the scheduler side of the engine is torch-free)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("cadence", "gateway", "engine", "aligner", "clients")
TORCH_FREE = {
    "engine.api",
    "engine.bridge",
    "engine.qwen3.request",
    "engine.qwen3.scheduler",
    "engine.qwen3.plan",
    "engine.qwen3.kv_cache",
    "engine.qwen3.core",
    "engine.espeak.engine",
    "engine.espeak.lib",
    "engine.espeak.text",
    "engine.null",
    "engine.vllm_omni.engine",
    "engine.workers",
    "engine.alignment.engine",
    "engine.alignment.capacity",
    "engine.alignment.track",
    "engine.qwen3.reference_audio",
}
THIRD_PARTY_TORCH = ("torch", "triton", "transformers")


def imports_of(source: str, module: str) -> set[str]:
    """Absolute names of every module `source` imports (relative imports resolved)."""
    package = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base)
                found.add(f"{prefix}.{node.module}" if node.module else prefix)
            elif node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def violations(module: str, imported: set[str]) -> list[str]:
    top = module.split(".")[0]
    bad: list[str] = []
    for name in sorted(imported):
        head = name.split(".")[0]
        if top in ("engine", "aligner") and head in ("gateway", "clients", "cadence"):
            bad.append(f"{module} imports {name}: {top} must not depend on {head}")
        if top == "engine" and head == "aligner":  # the aligner fulfils engine.alignment.api
            bad.append(f"{module} imports {name}: the engine must not depend on the aligner")
        if top == "gateway":
            if head == "engine" and not (name == "engine" or name.startswith("engine.api")):
                bad.append(f"{module} imports {name}: the gateway sees only engine.api")
            if head == "aligner" and not (name == "aligner" or name.startswith("aligner.api")):
                bad.append(f"{module} imports {name}: the gateway sees only aligner.api")
            if head in ("clients", "cadence"):
                bad.append(f"{module} imports {name}: the gateway must not depend on {head}")
        if top == "clients" and head in PROJECT and head != "clients":
            if not (name == "gateway" or name.startswith("gateway.messages")):
                bad.append(f"{module} imports {name}: clients may use only gateway.messages")
        if module in TORCH_FREE and head in THIRD_PARTY_TORCH:
            bad.append(f"{module} imports {name}: this module must stay torch-free")
        if module == "gateway.messages" and head not in sys.stdlib_module_names and head != "__future__":
            bad.append(f"{module} imports {name}: the wire schema is stdlib-only")
    return bad


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PROJECT:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def test_every_arrow_points_the_right_way() -> None:
    problems = []
    for module, path in project_modules().items():
        problems += violations(module, imports_of(path.read_text(encoding="utf-8"), module))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("engine.qwen3.runner", "from gateway.session import Session", "must not depend on gateway"),
        ("aligner.qwen3", "import clients.client", "must not depend on clients"),
        ("gateway.app", "from engine.qwen3.runner import Runner", "sees only engine.api"),
        ("gateway.app", "from aligner import qwen3", "sees only aligner.api"),
        ("engine.alignment.engine", "from aligner.api import Aligner", "must not depend on the aligner"),
        ("clients.client", "from engine.api import AudioChunk", "only gateway.messages"),
        ("clients.client", "from gateway import session", "only gateway.messages"),
        ("engine.qwen3.scheduler", "import torch", "torch-free"),
        ("engine.qwen3.scheduler", "from . import runner\nimport torch.nn", "torch-free"),
        ("gateway.messages", "import numpy", "stdlib-only"),
    ],
)
def test_the_checker_catches_a_wrong_arrow(module: str, source: str, expected: str) -> None:
    found = violations(module, imports_of(source, module))
    assert any(expected in line for line in found), found


def test_relative_imports_are_resolved() -> None:
    assert "engine.api" in imports_of("from ..api import Engine", "engine.qwen3.scheduler")
    assert "engine.qwen3.plan" in imports_of("from .plan import StepPlan", "engine.qwen3.scheduler")
    assert "engine.qwen3.models.talker" in imports_of(
        "from .models.talker import Talker", "engine.qwen3.runner"
    )
    assert "engine.qwen3.models" in imports_of("from ..models import talker", "engine.qwen3.models.codec")


def test_clients_import_without_torch() -> None:
    """The client must work where torch is absent: block it and import the client modules."""
    code = (
        "import sys\n"
        "for blocked in ('torch', 'transformers', 'engine', 'aligner'):\n"
        "    sys.modules[blocked] = None\n"
        "import importlib, pkgutil, clients\n"
        "names = [m.name for m in pkgutil.iter_modules(clients.__path__) if m.name != 'loadtest']\n"
        "for name in names:\n"
        "    importlib.import_module('clients.' + name)\n"
        "print(len(names))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_gateway_and_the_torch_free_engines_import_without_torch() -> None:
    """Not only their own imports: nothing they pull in may need torch (the eSpeak default
    engine and the gateway run where torch is absent)."""
    modules = sorted(TORCH_FREE | {"gateway.app", "gateway.server", "gateway.protocol", "cadence.cli"})
    code = (
        "import sys, importlib\n"
        "for blocked in ('torch', 'transformers'):\n"
        "    sys.modules[blocked] = None\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_session_protocol_does_no_io() -> None:
    """gateway.protocol is sans-I/O: neither it nor anything it pulls in needs an event loop or a
    socket (the callers, gateway.session and gateway.twilio, do the I/O)."""
    code = (
        "import sys\n"
        "for blocked in ('asyncio', 'socket', 'selectors', 'starlette', 'uvicorn', 'websockets'):\n"
        "    sys.modules[blocked] = None\n"
        "import gateway.protocol\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
