"""Fixtures of the aligner-stage tests."""

from __future__ import annotations

import pytest

from engine.alignment.engine import AlignedEngine


@pytest.fixture
async def engines():
    """start(inner, aligner, **options) -> a started AlignedEngine, stopped after the test."""
    made: list[AlignedEngine] = []

    async def start(inner, aligner, **options) -> AlignedEngine:
        engine = AlignedEngine(inner, aligner, **options)
        await engine.start()
        made.append(engine)
        return engine

    yield start
    for engine in made:
        await engine.stop()
