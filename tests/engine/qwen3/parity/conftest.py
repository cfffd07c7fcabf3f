"""Session fixtures: tiny random reference checkpoints, built once with the reference package and
saved in the upstream layout, and the loaded reference / engine models for them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.qwen3.loader import Qwen3TTSBundle, load_qwen3_tts
from tests.qwen_reference import import_qwen_tts

KINDS = ("custom_voice", "voice_design", "base")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import_qwen_tts()
    from tests.reference_builders import build_reference_tts

    root = tmp_path_factory.mktemp("qwen_ckpt")
    return {kind: build_reference_tts(kind, root / kind, seed=i) for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="session")
def references(checkpoints: dict[str, Path]) -> dict[str, Any]:
    from tests.reference_builders import load_reference

    return {kind: load_reference(path) for kind, path in checkpoints.items()}


@pytest.fixture(scope="session")
def bundles(checkpoints: dict[str, Path]) -> dict[str, Qwen3TTSBundle]:
    return {kind: load_qwen3_tts(path, "cpu", torch.float32) for kind, path in checkpoints.items()}


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread (and do not fight parallel test workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
