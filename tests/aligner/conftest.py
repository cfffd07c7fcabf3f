from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint written by the reference classes (skips without qwen_asr)."""
    from tests.aligner.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_forced_aligner"))


@pytest.fixture(scope="session")
def reference(tiny_checkpoint: Path):
    import torch

    from tests.qwen_reference import import_qwen_asr

    qwen_asr = import_qwen_asr()
    return qwen_asr.Qwen3ForcedAligner.from_pretrained(
        str(tiny_checkpoint), dtype=torch.float32, device_map="cpu"
    )


@pytest.fixture(scope="session")
def ours(tiny_checkpoint: Path):
    from aligner.qwen3 import Qwen3ForcedAligner

    return Qwen3ForcedAligner.from_directory(tiny_checkpoint, device="cpu")


def noise(seconds: float, rate: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * rate))).astype(np.float32)
