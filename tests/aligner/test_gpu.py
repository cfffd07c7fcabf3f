"""The aligner on CUDA in bf16 (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import sdpa_kernel

from aligner.model import ATTENTION_BACKENDS
from aligner.qwen3 import Qwen3ForcedAligner, model_audio
from bench.gpu_aligner_bench import build_aligner, make_batch
from tests.aligner.conftest import noise
from tests.aligner.test_checkpoint import write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_batch_gives_the_cpu_spans_and_ordered_times(tmp_path):
    root = write_checkpoint(tmp_path / "ckpt")
    cpu = Qwen3ForcedAligner.from_directory(root, device="cpu")
    gpu = Qwen3ForcedAligner.from_directory(root, device="cuda")
    assert gpu.model.lm_head.weight.dtype == torch.bfloat16
    batch = [
        (noise(2.0, 24000, 1), 24000, "Hello world, the aligner!", "English"),
        (noise(11.0, 16000, 2), 16000, "你好，世界。", "Chinese"),
    ]
    on_cpu, on_gpu = cpu.align(batch), gpu.align(batch)
    for words_cpu, words_gpu in zip(on_cpu, on_gpu, strict=True):
        assert [(w.text, w.char_start, w.char_end) for w in words_gpu] == [
            (w.text, w.char_start, w.char_end) for w in words_cpu
        ]
        times = [t for w in words_gpu for t in (w.start_s, w.end_s)]
        assert times == sorted(times)


def _classes(aligner: Qwen3ForcedAligner, batch) -> list[int]:
    waves = model_audio([(audio, rate) for audio, rate, _, _ in batch])
    return aligner.slot_classes(waves, [aligner.splitter.words(text, lang) for *_, text, lang in batch])


@pytest.fixture(scope="module")
def real_shapes() -> Qwen3ForcedAligner:
    """The 0.6B shapes in bf16, random weights, graphs captured."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    aligner = build_aligner(torch.device("cuda"), torch.bfloat16)
    assert aligner.graphs is not None
    with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
        aligner.graphs.capture()
    return aligner


@pytest.mark.parametrize("size", [1, 5, 40])
def test_graphs_replay_what_the_eager_passes_compute(real_shapes, size):
    """Graphs == eager on the same packed rows, bit for bit."""
    aligner, graphs = real_shapes, real_shapes.graphs
    batch = make_batch(size, 2.5) + make_batch(1, 11.0)  # the long clip takes two windows
    aligner.graphs = None
    try:
        eager = _classes(aligner, batch)
    finally:
        aligner.graphs = graphs
    before = graphs.replays
    graphed = _classes(aligner, batch)
    assert graphs.replays == before + 2  # the encoder's stack and the decoder both replayed
    assert graphed == eager
    assert len(set(eager)) > 1


def test_batches_in_flight_together_give_the_words_of_calls_in_turn(real_shapes):
    """Two batches submitted before either is collected (the worker's overlap, the graphs' static
    buffers shared): each gets the words its own call gives."""
    first, second = make_batch(5, 2.5), make_batch(9, 4.0)
    in_turn = real_shapes.align(first), real_shapes.align(second)
    a = real_shapes.submit(first)
    b = real_shapes.submit(second)
    assert (real_shapes.collect(a), real_shapes.collect(b)) == in_turn
    assert a.ready() and b.ready()
