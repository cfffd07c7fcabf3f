"""The Qwen3 engine in a worker process (the default on a GPU) speaks exactly as in the gateway's
process: a tiny random Base model on the CPU, a registered voice and a one-off reference clip."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.engines import EngineOptions, build_engine
from engine.api import Engine, SynthesisRequest, TextSegment
from engine.workers import WorkerPoolEngine
from tests.engine.qwen3.test_voice_clone import clip

pytestmark = [pytest.mark.reference, pytest.mark.timeout(180)]
TEXT = "Hello there, nice to meet you."
REF_TEXT = "A short reference sentence."


async def speak(engine: Engine, rid: str, **voice: object) -> np.ndarray:
    stream = engine.open(
        SynthesisRequest(request_id=rid, language="English", greedy=True, max_frames=5, **voice)
    )  # type: ignore[arg-type]
    stream.push(TextSegment(TEXT, char_start=0))
    stream.close_text()
    return np.concatenate([c.samples async for c in stream])


async def voices_spoken(engine: Engine) -> tuple[np.ndarray, np.ndarray]:
    await engine.start()
    try:
        await engine.register_voice("narrator", clip(), 16000, REF_TEXT)
        registered = await speak(engine, "reg", voice="narrator")
        one_off = await speak(engine, "once", ref_audio=(clip(), 16000), ref_text=REF_TEXT)
        return registered, one_off
    finally:
        await engine.stop()


async def test_a_worker_process_speaks_like_the_engine_in_process(tmp_path) -> None:
    from tests.reference_builders import build_reference_tts

    path = build_reference_tts("base", tmp_path / "tiny_base")
    options = EngineOptions(name="qwen3", model=str(path), device="cpu", max_streams=4)
    worker = build_engine(EngineOptions(**{**_fields(options), "gpus": "1"}))
    in_process = build_engine(EngineOptions(**{**_fields(options), "gpus": "0"}))
    assert isinstance(worker, WorkerPoolEngine) and not isinstance(in_process, WorkerPoolEngine)
    expected = await voices_spoken(in_process)
    got = await voices_spoken(worker)
    for a, b in zip(got, expected, strict=True):  # int16 PCM from the runner, passed on as it is
        assert a.dtype == b.dtype == np.int16 and a.size == 5 * 1920 and np.abs(a).max() > 0
        # the two processes' float sums may differ in their last bits: a sample may round one step apart
        np.testing.assert_allclose(a.astype(np.int32), b.astype(np.int32), atol=1)
    assert worker.load().extra.get("workers_alive") is not None


def _fields(options: EngineOptions) -> dict[str, object]:
    return {name: getattr(options, name) for name in options.__dataclass_fields__}
