"""Qwen3Engine on a tiny random model on the CPU: streaming, cancel, parity with the offline path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.api import SynthesisRequest, TextSegment, float_samples
from engine.qwen3.engine import Qwen3Engine
from engine.qwen3.generate import GenerationRequest, generate_codes
from engine.qwen3.prompt_builder import build_prompt
from engine.qwen3.prompts import PromptRequest
from engine.qwen3.request import RequestStatus
from tests.engine.qwen3.utils import engine_config

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.reference_builders import build_reference_tts

    return build_reference_tts("custom_voice", tmp_path_factory.mktemp("tiny_cv"))


@pytest.fixture(scope="module")
def bundle(checkpoint):
    from tests.reference_builders import load_ours

    torch.manual_seed(0)
    return load_ours(checkpoint)


def make_engine(bundle, **overrides) -> Qwen3Engine:
    b, codec = bundle
    cfg = dict(max_streams=4, kv_slots=4, max_len=128, max_batch=4, enforce_eager=True, progress_bar=False)
    cfg.update(overrides)
    engine = Qwen3Engine(b.config, b.generation, b.tokenizer, b.talker, codec, engine_config(**cfg))
    engine._ready = True  # steps are driven by hand below (no step thread)
    return engine


def drive(engine: Qwen3Engine, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not engine.core.has_work():
            return
        engine.core._emit(engine.core.step())


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def offline_codes(bundle, text: str, frames: int) -> torch.Tensor:
    b, _ = bundle
    prompt = build_prompt(
        b.talker, b.config, b.tokenizer, PromptRequest(text=text, language="English", speaker="ryan")
    )
    (codes,) = generate_codes(
        b.talker, [GenerationRequest(prompt=prompt, greedy=True, max_frames=frames)], b.generation
    )
    return codes


def open_greedy(engine, rid: str, text: str, frames: int):
    stream = engine.open(
        SynthesisRequest(request_id=rid, voice="ryan", language="English", greedy=True, max_frames=frames)
    )
    state = engine.scheduler.requests[rid]
    stream.push(TextSegment(text, char_start=0))
    stream.close_text()
    return stream, state


@pytest.mark.parametrize("defer", [False, True], ids=["codec-now", "codec-deferred"])
async def test_stream_produces_contiguous_audio_with_estimated_words(bundle, defer):
    engine = make_engine(bundle, defer_codec=defer)
    stream, state = open_greedy(engine, "a", "Hello world. How are you?", 5)
    drive(engine)
    chunks = await collect(stream)
    assert chunks[-1].final and len(chunks) >= 3
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset
        offset += len(c.samples)
    assert offset == state.frames_generated * 1920 and state.frames_generated == 5
    assert chunks[0].samples.size == 1920  # first chunk: one frame
    words = [w for c in chunks for w in c.words]
    assert [w.text for w in words] == ["Hello", "world.", "How", "are", "you?"]
    assert words[0].char_start == 0 and words[-1].char_end == len("Hello world. How are you?")
    assert all(w.source == "estimate" and w.start_sample < w.end_sample <= offset for w in words)
    assert state.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("defer", [False, True], ids=["codec-now", "codec-deferred"])
async def test_batched_greedy_output_equals_offline_generation_and_streamed_audio_equals_offline_decode(
    bundle, defer
):
    _, codec = bundle
    engine = make_engine(bundle, defer_codec=defer)
    texts = {
        "a": ("Hello world.", 4),
        "b": ("The quick brown fox jumps over the lazy dog.", 6),
        "c": ("Good morning", 3),
    }
    opened = {rid: open_greedy(engine, rid, text, n) for rid, (text, n) in texts.items()}
    drive(engine)
    for rid, (text, n) in texts.items():
        stream, state = opened[rid]
        expected = offline_codes(bundle, text, n)
        got = torch.tensor(state.codes)
        assert got.shape == expected.shape and torch.equal(got, expected), rid
        audio = np.concatenate([float_samples(c.samples) for c in await collect(stream)])
        with torch.no_grad():
            offline = codec.decode(expected[None])[0].numpy()
        np.testing.assert_allclose(audio, offline, atol=1e-4)


def test_a_streams_deferred_chunk_and_its_frame_decoded_now_leave_one_step_in_order(bundle):
    """A chunk deferred last step and the same stream's frame decoded in this step: one output, in order."""
    from engine.qwen3.plan import CodecChunk, StepPlan

    runner = make_engine(bundle, defer_codec=True).runner
    runner._launch_codec = lambda chunks, resets, first_lane=False: (
        lambda: {c.request_id: np.full(c.num_frames * 1920, c.first_frame, np.float32) for c in chunks}
    )

    def chunk(first_frame: int, frames: int) -> CodecChunk:
        return CodecChunk(
            request_id="x",
            codec_slot=0,
            first_frame=first_frame,
            codes=[[0] * 16] * frames,
            first_chunk=False,
        )

    audio, delivered = runner._run_codec(StepPlan(step=1, codec=[chunk(1, 2)]), [])
    assert audio == {} and delivered == []
    audio, delivered = runner._run_codec(StepPlan(step=2), [chunk(3, 1)])
    assert delivered == [("x", 2), ("x", 1)]
    assert audio["x"].tolist() == [1.0] * 2 * 1920 + [3.0] * 1920


async def test_rows_of_one_chunk_size_beyond_one_batch_keep_their_own_audio_with_static_outputs(bundle):
    """A captured Code2Wav graph writes every replay into one static output; rows of one chunk size
    split over several replays of the same bucket must each be copied out before the next replay."""
    _, codec = bundle
    engine = make_engine(bundle, max_codec_batch=1, defer_codec=True)
    runner = engine.runner
    static: dict[tuple[int, int], torch.Tensor] = {}
    eager = runner._decode_frames

    def like_a_graph(slots, codes, first_lane=False):
        wav = eager(slots, codes, first_lane)
        out = static.setdefault(tuple(wav.shape), torch.empty_like(wav))
        out.copy_(wav)
        return out

    runner._decode_frames = like_a_graph
    texts = {"a": ("Hello world.", 5), "b": ("The quick brown fox jumps over the lazy dog.", 5)}
    opened = {rid: open_greedy(engine, rid, text, n) for rid, (text, n) in texts.items()}
    drive(engine)
    for rid, (stream, state) in opened.items():
        audio = np.concatenate([float_samples(c.samples) for c in await collect(stream)])
        with torch.no_grad():
            offline = codec.decode(torch.tensor(state.codes)[None])[0].numpy()
        np.testing.assert_allclose(audio, offline, atol=1e-4, err_msg=rid)
    assert static  # the static outputs were used


@pytest.mark.parametrize("defer", [False, True], ids=["codec-now", "codec-deferred"])
async def test_multi_segment_utterance_continues_one_codec_stream(bundle, defer):
    _, codec = bundle
    engine = make_engine(bundle, defer_codec=defer)
    stream = engine.open(
        SynthesisRequest(request_id="m", voice="ryan", language="English", greedy=True, max_frames=3)
    )
    state = engine.scheduler.requests["m"]
    stream.push(TextSegment("Hello world.", char_start=0))
    stream.push(TextSegment("Good morning", char_start=13))
    stream.close_text()
    drive(engine)
    chunks = await collect(stream)
    assert [s.first_frame for s in state.done_segments] == [0, 3]
    audio = np.concatenate([float_samples(c.samples) for c in chunks])
    with torch.no_grad():
        offline = codec.decode(torch.tensor(state.codes)[None])[0].numpy()
    np.testing.assert_allclose(audio, offline, atol=1e-4)
    words = [w for c in chunks for w in c.words]
    assert [w.char_start for w in words] == [0, 6, 13, 18]


@pytest.mark.parametrize("defer", [False, True], ids=["codec-now", "codec-deferred"])
async def test_frames_decoded_in_the_step_that_samples_them_keep_the_offline_audio(bundle, defer):
    _, codec = bundle
    engine = make_engine(bundle, defer_codec=defer, max_now_frame_rows=64)
    ticks = itertools.count()
    engine.scheduler.clock = lambda: 0.03 * next(ticks)  # slow steps: every listener runs low
    planned = engine.scheduler._first_audio_now
    now_frames: list[int] = []

    def recording(plan, now):
        out = planned(plan, now)
        now_frames.extend(f.frame for f in out)
        return out

    engine.scheduler._first_audio_now = recording
    texts = {"a": ("Hello world. How are you?", 9), "b": ("The quick brown fox jumps.", 7)}
    opened = {rid: open_greedy(engine, rid, text, n) for rid, (text, n) in texts.items()}
    drive(engine)
    assert sum(1 for f in now_frames if f) >= 4  # later frames went through the path, not only first ones
    # a request keeps the runner's rows as its frames: tuples, which the cyclic collector skips
    assert all(type(f) is tuple for _, state in opened.values() for f in state.codes)
    for rid, (stream, state) in opened.items():
        audio = np.concatenate([float_samples(c.samples) for c in await collect(stream)])
        with torch.no_grad():
            offline = codec.decode(torch.tensor(state.codes)[None])[0].numpy()
        np.testing.assert_allclose(audio, offline, atol=1e-4, err_msg=rid)


async def test_cancel_frees_the_slot_at_the_next_step(bundle):
    engine = make_engine(bundle, kv_slots=1, max_streams=2)
    stream_a, a = open_greedy(engine, "a", "Hello world.", 50)
    stream_b, b = open_greedy(engine, "b", "Good morning", 2)
    for _ in range(2):
        engine.core._emit(engine.core.step())
    assert a.kv_slot == 0 and b.kv_slot is None
    stream_a.cancel()
    assert a.kv_slot == 0  # applied at the next step, not before
    engine.core._emit(engine.core.step())
    assert a.status == RequestStatus.FINISHED_CANCELLED and a.kv_slot is None and a.codec_slot is None
    assert b.kv_slot == 0  # the freed slot went to the waiting request in the same step
    drive(engine)
    chunks_a = await collect(stream_a)
    assert not any(c.final for c in chunks_a)
    assert (await collect(stream_b))[-1].final


def test_load_reports_kv_bytes_per_stream(bundle):
    engine = make_engine(bundle)
    load = engine.load()
    shape = bundle[0].config.talker.shape
    per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 4
    assert load.capacity == 4 and load.active == 0
    assert load.extra["kv_bytes_per_stream"] == per_token * 129
    assert load.extra["kv_bytes_per_token"] == per_token


def test_the_runner_takes_its_sizes_from_the_scheduler_and_sets_its_delivery_steps(bundle):
    """One owner per setting: the runner is built with the scheduler's sizes, and the steps between a
    Code2Wav launch and its audio follow the runner (no setting of the scheduler's)."""
    engine = make_engine(bundle, defer_codec=True, max_batch=3, codec_frame_buckets=(1, 2, 4))
    config = engine.scheduler.config
    assert config is engine.econfig.scheduler
    assert (
        (engine.runner.max_batch, engine.runner.codec_slots)
        == (config.max_batch, config.codec_slots)
        == (3, 4)
    )
    assert engine.runner.codec_frame_buckets == config.codec_frame_buckets == (1, 2, 4)
    assert engine.runner.num_slots == 4 and engine.runner.config is engine.econfig.runner
    assert engine.scheduler.codec_delivery_steps == 1
    assert make_engine(bundle, defer_codec=False).scheduler.codec_delivery_steps == 0
    assert engine.econfig.max_streams == 4
    with pytest.raises(AttributeError):
        engine.econfig.max_streams = 8  # type: ignore[misc]


async def test_deferred_codec_chunks_arrive_with_the_next_step(bundle):
    """Later chunks come with the next step; first chunks and frames decoded in their own step
    with theirs, after the same stream's deferred chunk when both come at once."""
    engine = make_engine(bundle, defer_codec=True)
    engine.scheduler.config.max_now_frame_rows = 0  # slow CPU steps would decode every frame in its step
    steps = []
    execute = engine.runner.execute

    def recording(plan, while_waiting=None):
        out = execute(plan, while_waiting)
        steps.append((plan, out))
        return out

    engine.runner.execute = recording
    stream, state = open_greedy(engine, "d", "The quick brown fox jumps over the lazy dog.", 8)
    drive(engine)
    chunks = await collect(stream)
    assert state.status == RequestStatus.FINISHED_STOPPED and sum(len(c.samples) for c in chunks) == 8 * 1920
    assert [c.sample_offset for c in chunks] == list(np.cumsum([0] + [len(c.samples) for c in chunks[:-1]]))
    later = [[(c.request_id, c.num_frames) for c in plan.codec if not c.first_chunk] for plan, _ in steps]
    assert any(later)
    for i, (plan, out) in enumerate(steps):
        now = [(c.request_id, c.num_frames) for c in plan.codec if c.first_chunk]
        now += [(f.request_id, 1) for f in plan.first_audio_now]
        assert out.delivered == (later[i - 1] if i else []) + now, f"step {i}"
        frames: dict[str, int] = {}
        for rid, n in out.delivered:
            frames[rid] = frames.get(rid, 0) + n
        assert all(out.audio[rid].size == n * 1920 for rid, n in frames.items())


async def test_a_segment_too_long_fails_alone_in_its_prepared_batch(bundle):
    """Text readied in one batch: the segment past max_trailing ends its own request with the error;
    the other request in the batch speaks in full."""
    engine = make_engine(bundle, max_trailing=8)
    long_stream, long_state = open_greedy(
        engine, "long", "This sentence has far too many words for eight text positions.", 3
    )
    short_stream, short_state = open_greedy(engine, "short", "Hi there.", 3)
    assert len(engine.core._text) == 4  # both segments and both closes wait for one step's batch
    drive(engine)
    assert long_state.status == RequestStatus.FINISHED_ERROR
    with pytest.raises(Exception, match="segment text too long"):
        await collect(long_stream)
    assert short_state.status == RequestStatus.FINISHED_STOPPED and short_state.frames_generated == 3
    assert (await collect(short_stream))[-1].final


async def test_a_prompt_that_fails_to_build_fails_alone_in_its_batch(bundle, monkeypatch):
    """Building a batch fails (here: the builder refuses one text, a stand-in for any prompt it
    cannot build): each segment is then built alone, and only the refused one's request ends."""
    engine = make_engine(bundle)
    builder = engine.runner.prompt_builder
    build, batches = builder.build, []

    def refusing(items):
        batches.append(len(items))
        if any(engine.tokenizer.decode(i.tokens.text_ids).count("Refused") for i in items):
            raise ValueError("refused prompt")
        return build(items)

    monkeypatch.setattr(builder, "build", refusing)
    bad_stream, bad_state = open_greedy(engine, "bad", "Refused words.", 3)
    good_stream, good_state = open_greedy(engine, "good", "Hi there.", 3)
    drive(engine)
    assert batches == [2, 1, 1]  # the batch, then each alone
    assert bad_state.status == RequestStatus.FINISHED_ERROR
    with pytest.raises(Exception, match="refused prompt"):
        await collect(bad_stream)
    assert good_state.status == RequestStatus.FINISHED_STOPPED and good_state.frames_generated == 3
    assert (await collect(good_stream))[-1].final


def test_an_unknown_language_lists_the_models_languages(bundle):
    from engine.api import InvalidRequest

    engine = make_engine(bundle)
    with pytest.raises(
        InvalidRequest, match="unsupported language 'Klingon'; this model speaks auto, .*english"
    ):
        engine.open(SynthesisRequest(request_id="k", voice="ryan", language="Klingon"))
    assert "k" not in engine.scheduler.requests
