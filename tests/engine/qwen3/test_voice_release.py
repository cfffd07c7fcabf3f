"""A voice the Qwen3 engine releases (tiny random Base model, CPU): it speaks no more, and
neither the engine nor its prompt cache holds it by name; the voices it keeps speak on."""

from __future__ import annotations

import pytest

from engine.api import SynthesisRequest, TextSegment, UnknownVoice
from engine.qwen3.engine import Qwen3Engine
from tests.engine.qwen3.test_qwen3_engine import drive
from tests.engine.qwen3.test_voice_clone import clip
from tests.engine.qwen3.utils import tiny_base_engine

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Qwen3Engine:
    return tiny_base_engine(tmp_path_factory.mktemp("tiny_base"))


async def frames_spoken(engine: Qwen3Engine, rid: str, voice: str) -> int:
    request = SynthesisRequest(request_id=rid, voice=voice, language="English", greedy=True, max_frames=2)
    stream = engine.open(request)
    stream.push(TextSegment("Hello there.", char_start=0))
    stream.close_text()
    drive(engine)
    return sum([len(chunk.samples) async for chunk in stream]) // 1920


async def test_a_released_voice_speaks_no_more_and_leaves_the_prompt_cache(engine: Qwen3Engine) -> None:
    cache = engine.voice_cache
    assert cache is not None
    await engine.register_voice("gone", clip(2.0), 16000, "A short reference sentence.")
    await engine.register_voice("kept", clip(2.5), 16000, "Another reference sentence.")
    assert await frames_spoken(engine, "before", "gone") == 2
    await engine.unregister_voice("gone")
    with pytest.raises(UnknownVoice):
        engine.open(SynthesisRequest(request_id="after", voice="gone"))
    assert "gone" not in cache and "kept" in cache
    assert cache.stats()["voices_registered"] == 1
    assert await frames_spoken(engine, "still", "kept") == 2
    await engine.unregister_voice("never-registered")  # no error
