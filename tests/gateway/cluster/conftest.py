"""Fixtures of the cluster tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.cluster.store import Store
from tests.gateway.cluster.harness import Cluster


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Cluster]:
    """A real redis-server of its own, not persisted, stopped after the test."""
    server = Cluster(tmp_path)
    server.start_redis(persistent=False)
    yield server
    server.stop()


@pytest.fixture
async def stores(redis_server: Cluster) -> AsyncIterator[list[Store]]:
    """Two stores (two replicas' views) on `redis_server`, closed after the test."""
    made = [Store(redis_server.redis_url, probe_s=0.05) for _ in range(2)]
    yield made
    for store in made:
        await store.close()
