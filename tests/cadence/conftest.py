"""Fixtures of the tests of `cadence` itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.cluster.harness import Cluster


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of the module's own, not persisted: what `--gateways 2` needs."""
    redis = Cluster(tmp_path_factory.mktemp("redis"))
    redis.start_redis(persistent=False)
    try:
        yield redis.redis_url
    finally:
        redis.stop()
