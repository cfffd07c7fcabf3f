"""The Triton kernels on the CPU, under Triton's interpreter: one test per check of
tests/engine/qwen3/kernels/interpret_checks.py, which runs once per session in a child process (TRITON_INTERPRET
must be set before triton is imported, and this process has imported it already). The check names
are read from that file without importing it; see its docstring for adding a check."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("interpret_checks.py")
ROOT = SCRIPT.parents[4]
TIMEOUT_S = 240


def declared_checks() -> dict[str, str | None]:
    """{name: xfail reason or None} of every function decorated with @check / @check(...) in SCRIPT."""
    found: dict[str, str | None] = {}
    for node in ast.parse(SCRIPT.read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Name) and decorator.id == "check":
                found[node.name] = None
            elif isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "check":
                reasons = [kw.value for kw in decorator.keywords if kw.arg == "xfail"]
                found[node.name] = ast.literal_eval(reasons[0]) if reasons else None
    return found


CHECKS = declared_checks()


def params() -> list[Any]:
    return [
        pytest.param(name, id=name, marks=[pytest.mark.xfail(reason=reason, strict=True)] if reason else [])
        for name, reason in CHECKS.items()
    ]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    """Every check's result, from one run of the script; {"": failure text} if the run itself failed."""
    pytest.importorskip("triton")  # engine[...] installs it with torch; without it there is nothing to run
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        run = subprocess.run(
            [sys.executable, str(SCRIPT)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        out = [
            s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in (exc.stdout, exc.stderr)
        ]
        return {"": f"interpret_checks.py ran past {TIMEOUT_S} s; its output:\n{out[0]}\n{out[1][-4000:]}"}
    found: dict[str, Any] = {}
    for line in run.stdout.splitlines():
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and "name" in result:
            found[result["name"]] = result
    found[""] = f"exit status {run.returncode}; stderr (tail):\n{run.stderr[-4000:]}"
    return found


def test_the_checks_are_declared() -> None:
    assert len(CHECKS) >= 8, f"found only {sorted(CHECKS)} in {SCRIPT.name}"


def test_every_check_that_ran_is_a_test(results: dict[str, Any]) -> None:
    """A check registered in a way the reading above misses would run but never be reported."""
    ran = set(results) - {""}
    assert ran <= set(CHECKS), f"not collected as tests: {sorted(ran - set(CHECKS))}"


@pytest.mark.parametrize("name", params())
def test_kernel_under_the_interpreter(results: dict[str, Any], name: str) -> None:
    result = results.get(name)
    assert result is not None, f"{name} reported no result ({results['']})"
    assert result["ok"], f"{name}: {result['detail']}"
