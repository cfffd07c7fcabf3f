"""The aligner on CUDA in bf16 (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from aligner.qwen3 import Qwen3ForcedAligner
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
