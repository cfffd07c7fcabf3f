"""Fixtures of the cluster tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.cluster.harness import Cluster


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Cluster]:
    """A real redis-server of its own, not persisted, stopped after the test."""
    server = Cluster(tmp_path)
    server.start_redis(persistent=False)
    yield server
    server.stop()
