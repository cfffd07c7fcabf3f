"""Code2Wav on two CUDA streams (the first-chunk lane): the later chunks queue behind the sampling on
the talker's stream and the first chunks replay their lane on a stream of the highest priority. The
audio must be what an engine that decodes every chunk in its step on one stream gives, and what the
offline decoder gives (tiny random model, CUDA graphs; skipped without CUDA)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from engine.api import SynthesisRequest, TextSegment, float_samples

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

TEXTS = {
    "a": ("Hello world. How are you?", 9),
    "b": ("The quick brown fox jumps over the lazy dog.", 23),
    "c": ("Good morning", 4),
    "d": ("One two three four five six seven.", 31),
    "e": ("A longer sentence that keeps going for a while.", 40),
    "f": ("Yes.", 2),
}


def test_the_first_chunk_lane_gives_the_one_stream_audio(tmp_path):
    asyncio.run(_compare(tmp_path))  # a plain event loop: the GPU machine's pytest has no asyncio plugin


async def _run(bundle, defer: bool) -> tuple[dict[str, list[list[int]]], dict[str, np.ndarray], int]:
    from engine.qwen3.engine import Qwen3Engine
    from tests.engine.qwen3.utils import engine_config

    b, codec = bundle
    engine = Qwen3Engine(
        b.config,
        b.generation,
        b.tokenizer,
        b.talker,
        codec,
        engine_config(
            max_streams=8, kv_slots=8, max_len=128, max_batch=8, progress_bar=False, defer_codec=defer
        ),
    )
    engine.runner.capture()
    engine._ready = True
    streams, states = {}, {}
    for rid, (text, frames) in TEXTS.items():  # staggered: first chunks meet other streams' later ones
        streams[rid] = engine.open(
            SynthesisRequest(request_id=rid, voice="ryan", language="English", greedy=True, max_frames=frames)
        )
        states[rid] = engine.scheduler.requests[rid]
        streams[rid].push(TextSegment(text, char_start=0))
        streams[rid].close_text()
        engine.core._emit(engine.core.step())
    for _ in range(400):
        if not engine.core.has_work():
            break
        engine.core._emit(engine.core.step())
    audio = {rid: np.concatenate([float_samples(c.samples) async for c in s]) for rid, s in streams.items()}
    first_lane = sum(1 for k in engine.runner.graphs.graphs if k[0] == "codec_first")
    return {rid: st.codes for rid, st in states.items()}, audio, first_lane


async def _compare(tmp_path) -> None:
    from tests.reference_builders import build_reference_tts, load_ours

    bundle = load_ours(build_reference_tts("custom_voice", tmp_path / "tiny"), "cuda")
    codes_one, audio_one, lanes_one = await _run(bundle, defer=False)
    codes_lane, audio_lane, lanes_lane = await _run(bundle, defer=True)
    assert lanes_one == 0 and lanes_lane > 0
    _, codec = bundle
    for rid, (_, frames) in TEXTS.items():
        assert codes_one[rid] == codes_lane[rid] and len(codes_one[rid]) == frames, rid
        with torch.no_grad():
            offline = codec.decode(torch.tensor(codes_one[rid], device="cuda")[None])[0].float().cpu().numpy()
        scale = float(np.abs(offline).max()) or 1.0
        assert audio_lane[rid].shape == offline.shape, rid
        np.testing.assert_allclose(audio_lane[rid], audio_one[rid], atol=1e-3 * scale, err_msg=rid)
        np.testing.assert_allclose(audio_lane[rid], offline, atol=1e-2 * scale, err_msg=rid)  # cuDNN TF32
