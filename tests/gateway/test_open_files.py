"""The open-files limit a server (and the load test) raises at start: tested in a child process,
so this one keeps its own limit."""

from __future__ import annotations

import subprocess
import sys

import pytest

resource = pytest.importorskip("resource")

CHILD = """
import resource
from gateway.open_files import raise_open_files_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
now = raise_open_files_limit()
print(now, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def test_the_soft_limit_rises_to_the_hard_one():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    now, soft, hard = (int(v) for v in out.stdout.split())
    assert now == soft
    if hard == resource.RLIM_INFINITY:
        assert soft >= 1 << 20
    else:
        assert soft == hard
