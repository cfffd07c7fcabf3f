"""Forced lengths (the benchmark's workload): an utterance's frame count is exact however the
gateway cut its text, on a random checkpoint written by bench/random_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.api import SynthesisRequest, TextSegment
from engine.qwen3.engine import Qwen3Engine, share_frames
from tests.engine.qwen3.utils import engine_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("total", "lengths"), [(93, [40, 10, 50]), (7, [1, 1, 1]), (200, [300]), (5, [3, 90])]
)
def test_frames_are_shared_by_characters_and_sum_to_the_total(total: int, lengths: list[int]) -> None:
    segments = [TextSegment("x" * n, 0) for n in lengths]
    shares = share_frames(total, segments)
    assert sum(shares) == total and all(s >= 1 for s in shares)
    if len(lengths) == 3 and total == 93:
        assert shares[2] > shares[0] > shares[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Qwen3Engine:
    from bench.random_checkpoint import write_checkpoint

    path = tmp_path_factory.mktemp("random_tiny")
    write_checkpoint(path, "tiny", "cpu", ROOT / "deploy" / "bench" / "corpus.jsonl")
    torch.manual_seed(0)
    eng = Qwen3Engine.from_pretrained(
        path,
        "cpu",
        torch.float32,
        engine_config(
            max_streams=4, kv_slots=4, max_len=128, max_batch=4, enforce_eager=True, progress_bar=False
        ),
    )
    eng._ready = True  # steps are driven by hand (no step thread)
    return eng


def drive(engine: Qwen3Engine, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if not engine.core.has_work():
            return
        engine.core._emit(engine.core.step())


async def test_a_multi_sentence_forced_request_yields_exactly_its_frames(engine: Qwen3Engine) -> None:
    text = "Your order has shipped. It will arrive on Tuesday. Thank you for waiting!"
    stream = engine.open(
        SynthesisRequest(request_id="f1", voice="ryan", language="English", forced_frames=23)
    )
    offset = 0
    for sentence in ("Your order has shipped. ", "It will arrive on Tuesday. ", "Thank you for waiting!"):
        stream.push(TextSegment(sentence, char_start=offset))
        offset += len(sentence)
    assert offset == len(text)
    stream.close_text()
    drive(engine)
    chunks = [chunk async for chunk in stream]
    samples = sum(len(c.samples) for c in chunks)
    assert chunks[-1].final and samples == 23 * 1920
    assert np.isfinite(np.concatenate([c.samples for c in chunks])).all()
