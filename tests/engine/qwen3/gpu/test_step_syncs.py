"""The engine's step waits for the GPU only where it reads results: the sampled codes and the
decoded audio. Every other host->device copy (prompt ids, slot tables, codec resets) must not
block, or the host could not plan a step while the GPU still runs the last one's Code2Wav chunks.
Checked with torch's sync debug mode on a tiny random model (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import inspect
import warnings

import pytest
import torch

from engine.api import SynthesisRequest, TextSegment
from engine.qwen3.runner import Runner
from tests.engine.qwen3.utils import engine_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def lines_of(fn) -> set[int]:
    source, first = inspect.getsourcelines(fn)
    return set(range(first, first + len(source)))


def test_step_blocks_only_to_read_codes_and_audio(tmp_path):
    # a plain event loop: the GPU machine's pytest has no asyncio plugin
    asyncio.run(_steps_block_only_to_read(tmp_path))


async def _steps_block_only_to_read(tmp_path):
    from engine.qwen3.engine import Qwen3Engine
    from tests.reference_builders import build_reference_tts, load_ours

    b, codec = load_ours(build_reference_tts("custom_voice", tmp_path / "tiny"), "cuda")
    engine = Qwen3Engine(
        b.config,
        b.generation,
        b.tokenizer,
        b.talker,
        codec,
        engine_config(
            max_streams=4, kv_slots=4, max_len=128, max_batch=4, enforce_eager=True, progress_bar=False
        ),
    )
    engine._ready = True
    assert engine.runner.defers_codec
    allowed = lines_of(Runner._sample) | lines_of(Runner._read_codes) | lines_of(Runner._launch_codec)
    # a first round compiles the Triton kernels (start-up work, done while graphs are captured in
    # serving); the second round is the steady state that must not block
    for round_ in ("warm", "check"):
        for i, text in enumerate(["Hello world. How are you?", "The quick brown fox jumps.", "Good morning"]):
            stream = engine.open(
                SynthesisRequest(request_id=f"{round_}{i}", voice="ryan", language="English", max_frames=12)
            )
            stream.push(TextSegment(text, char_start=0))
            stream.close_text()
        blocking = []
        for _ in range(60):
            if not engine.core.has_work():
                break
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    outs = engine.core.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            engine.core._emit(outs)
            blocking += [
                f"{w.filename}:{w.lineno}"
                for w in caught
                if "synchroniz" in str(w.message)
                and not (w.filename.endswith("engine/qwen3/runner.py") and w.lineno in allowed)
            ]
    assert not engine.scheduler.has_work(), "the requests should have finished"
    assert not blocking, sorted(set(blocking))


def test_a_large_code2wav_launch_does_not_wait_for_the_gpu(tmp_path):
    """A chunk's codes over 64 KiB copied from pageable memory would make the host wait until the
    stream's queued work is done; from pinned memory the launch returns while the GPU is still busy."""
    from engine.qwen3.engine import Qwen3Engine
    from engine.qwen3.plan import CodecChunk
    from tests.reference_builders import build_reference_tts, load_ours

    b, codec = load_ours(build_reference_tts("custom_voice", tmp_path / "tiny"), "cuda")
    engine = Qwen3Engine(
        b.config,
        b.generation,
        b.tokenizer,
        b.talker,
        codec,
        engine_config(
            max_streams=4, kv_slots=4, max_len=128, max_batch=4, enforce_eager=True, progress_bar=False
        ),
    )
    runner = engine.runner
    frames = 160  # 4 rows x 160 frames x 16 codes x 8 bytes = 80 KiB
    rows = [
        CodecChunk(
            request_id=f"r{i}", codec_slot=i, first_frame=0, codes=[[i + 1] * 16] * frames, first_chunk=False
        )
        for i in range(4)
    ]
    runner._decode_codec(rows)  # warm: kernels loaded, allocator primed
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the launch
    busy = torch.cuda.Event()
    busy.record()
    out = runner._decode_codec(rows)
    assert not busy.query(), "the launch waited for the GPU's queued work"
    torch.cuda.synchronize()
    assert out.shape == (4, frames * runner.samples_per_frame)
