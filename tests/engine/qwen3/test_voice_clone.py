"""Voice clones in the Qwen3 engine (tiny random Base model, CPU): a registered voice and the same
clip sent one-off give the same audio, and an in-context clone's streamed audio equals upstream's
offline result (decode reference + generated codes, cut the reference off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.api import PCM16_FULL_SCALE, InvalidAudio, SynthesisRequest, TextSegment, float_samples
from engine.qwen3.engine import Qwen3Engine
from engine.qwen3.generate import GenerationRequest, generate_codes
from engine.qwen3.prompt_builder import build_prompt
from engine.qwen3.prompts import PromptRequest
from tests.engine.qwen3.test_qwen3_engine import drive
from tests.engine.qwen3.utils import engine_config

# the engine hands int16 PCM: a sample whose float value differs by less than 1e-5 may round to
# the next step
PCM_TOL = 1e-5 + 1 / PCM16_FULL_SCALE

pytestmark = pytest.mark.reference
TEXT = "Hello there, nice to meet you."


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Qwen3Engine:
    from tests.reference_builders import build_reference_tts

    path = build_reference_tts("base", tmp_path_factory.mktemp("tiny_base"))
    torch.manual_seed(0)
    eng = Qwen3Engine.from_pretrained(
        path,
        "cpu",
        torch.float32,
        engine_config(
            max_streams=4,
            kv_slots=4,
            max_len=160,
            max_batch=4,
            enforce_eager=True,
            progress_bar=False,
            # steps driven by hand on a CPU are far slower than a frame: admission would admit one
            # stream at a time, and these tests are about streams opened together
            headroom=1000.0,
        ),
    )
    eng._ready = True  # steps are driven by hand
    return eng


def clip(seconds: float = 2.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(1)
    return (
        0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
        + 0.05 * rng.standard_normal(t.size)
    ).astype(np.float32)


async def speak(engine: Qwen3Engine, rid: str, frames: int, **voice) -> np.ndarray:
    stream = engine.open(
        SynthesisRequest(request_id=rid, language="English", greedy=True, max_frames=frames, **voice)
    )
    stream.push(TextSegment(TEXT, char_start=0))
    stream.close_text()
    drive(engine)
    return np.concatenate([float_samples(c.samples) async for c in stream])


async def test_a_one_off_clip_speaks_like_the_same_clip_registered(engine: Qwen3Engine) -> None:
    audio = clip()
    await engine.register_voice("narrator", audio, 16000, "A short reference sentence.")
    registered = await speak(engine, "reg", 5, voice="narrator")
    one_off = await speak(engine, "once", 5, ref_audio=(audio, 16000), ref_text="A short reference sentence.")
    assert registered.size == 5 * 1920 and np.abs(registered).max() > 0
    np.testing.assert_allclose(one_off, registered, atol=PCM_TOL)


async def test_an_in_context_clone_continues_its_reference_as_upstream_decodes_it(
    engine: Qwen3Engine,
) -> None:
    await engine.register_voice("icl", clip(3.0), 16000, "Another reference sentence.")
    voice = engine._voices["icl"]
    generator = torch.Generator().manual_seed(3)  # distinct reference codes: priming must matter
    voice.ref_codes = torch.randint(0, 2048, (9, 16), generator=generator)
    streamed = await speak(engine, "icl1", 6, voice="icl")

    prompt = build_prompt(
        engine.runner.talker,
        engine.cfg,
        engine.tokenizer,
        PromptRequest(
            text=TEXT,
            language="English",
            speaker_embedding=voice.speaker_embedding,
            ref_codes=voice.ref_codes,
            ref_text=voice.ref_text,
        ),
    )
    (codes,) = generate_codes(
        engine.runner.talker,
        [GenerationRequest(prompt=prompt, greedy=True, max_frames=6)],
        engine.generation,
    )
    whole = engine.codec.decode(torch.cat([voice.ref_codes, codes])[None])[0]
    upstream = whole[voice.ref_codes.shape[0] * 1920 :].numpy()
    np.testing.assert_allclose(streamed, upstream, atol=1e-4)
    unprimed = engine.codec.decode(codes[None])[0].numpy()
    assert np.abs(unprimed - upstream).max() > 1e-3  # the reference context changes the audio


async def test_a_clones_reference_runs_through_code2wav_once_and_later_requests_copy_its_state(
    engine: Qwen3Engine,
) -> None:
    await engine.register_voice("cached", clip(2.5), 16000, "A third reference sentence.")
    voice = engine._voices["cached"]
    voice.ref_codes = torch.randint(0, 2048, (7, 16), generator=torch.Generator().manual_seed(5))
    states = engine.runner.codec_states
    assert states is not None
    runs = []
    decode_frames = engine.runner._decode_frames
    engine.runner._decode_frames = lambda slots, codes, first_lane=False: (
        runs.append((list(slots), codes.shape[1])) or decode_frames(slots, codes, first_lane)
    )
    try:
        first = await speak(engine, "c1", 5, voice="cached")
        first_run = sum(n for _, n in runs)
        hits = states.hits
        runs.clear()
        again = await speak(engine, "c2", 5, voice="cached")
    finally:
        engine.runner._decode_frames = decode_frames
    assert first_run == 7 + 5  # the reference's frames, then the request's own
    assert sum(n for _, n in runs) == 5  # only the 5 new frames ran: the reference state was copied
    assert states.hits == hits + 1
    np.testing.assert_allclose(again, first, atol=PCM_TOL)


async def test_clones_opened_together_share_one_priming_run(
    engine: Qwen3Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await engine.register_voice("pair", clip(2.0), 16000, "Yet another reference sentence.")
    voice = engine._voices["pair"]
    voice.ref_codes = torch.randint(0, 2048, (6, 16), generator=torch.Generator().manual_seed(6))
    alone = await speak(engine, "p0", 4, voice="pair")
    engine.runner.codec_states._entries.clear()  # cold again: both requests below miss
    # both start in the next step whatever this machine's measured step time allows
    monkeypatch.setattr(engine.scheduler.capacity, "ttfa_target_s", 1e9)
    streams = []
    for rid in ("p1", "p2"):
        stream = engine.open(
            SynthesisRequest(request_id=rid, language="English", greedy=True, max_frames=4, voice="pair")
        )
        stream.push(TextSegment(TEXT, char_start=0))
        stream.close_text()
        streams.append(stream)
    misses, hits = engine.runner.codec_states.misses, engine.runner.codec_states.hits
    drive(engine)
    together = [np.concatenate([float_samples(c.samples) async for c in s]) for s in streams]
    # both primed in one step: one clip, one lookup, one run, its state copied to the other slot
    assert (engine.runner.codec_states.misses, engine.runner.codec_states.hits) == (
        misses + 1,
        hits,
    )
    for audio in together:
        np.testing.assert_allclose(audio, alone, atol=PCM_TOL)


def test_unusable_one_off_clips_are_refused_at_open(engine: Qwen3Engine) -> None:
    with pytest.raises(InvalidAudio):
        engine.open(SynthesisRequest(request_id="bad", ref_audio=(np.zeros(32000, np.float32), 16000)))
    with pytest.raises(InvalidAudio):
        engine.open(SynthesisRequest(request_id="short", ref_audio=(clip(0.3), 16000)))
