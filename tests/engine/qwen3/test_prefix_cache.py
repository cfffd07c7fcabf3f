"""Prompt-prefix KV reuse (tiny random models, CPU, fp32, greedy): a request served from a cached
prefix gives the same codes as without the cache (CustomVoice with an instruction, an in-context
clone), the prefix positions are not prefilled again, two voices never share an entry, and the
byte budget evicts the least recent prefix. Also the live load figures of load()."""

from __future__ import annotations

import pytest
import torch

from engine.api import SynthesisRequest, TextSegment
from engine.qwen3.engine import Qwen3Engine
from engine.qwen3.models.layers import KVCache
from engine.qwen3.plan import StepPlan
from engine.qwen3.prefix_cache import PrefixKVCache, prefix_key, prefix_length
from engine.qwen3.prompt_builder import build_prompt_embeds
from engine.qwen3.prompts import PromptRequest, tokenize_request
from tests.engine.qwen3.test_qwen3_engine import bundle, checkpoint, drive, make_engine  # noqa: F401
from tests.engine.qwen3.test_voice_clone import clip
from tests.engine.qwen3.utils import engine_config

pytestmark = pytest.mark.reference
INSTRUCT = "Speak slowly and warmly."
TEXTS = ("Hello there, nice to meet you.", "Quite a different sentence, really.")


def recording(engine: Qwen3Engine) -> list[StepPlan]:
    """Every plan the runner executes."""
    plans: list[StepPlan] = []
    execute = engine.runner.execute

    def record(plan: StepPlan, while_waiting=None):  # type: ignore[no-untyped-def]
        plans.append(plan)
        return execute(plan, while_waiting)

    engine.runner.execute = record  # type: ignore[method-assign]
    return plans


async def speak(
    engine: Qwen3Engine, rid: str, text: str, frames: int = 6, **voice: object
) -> list[list[int]]:
    stream = engine.open(
        SynthesisRequest(request_id=rid, language="English", greedy=True, max_frames=frames, **voice)
    )  # type: ignore[arg-type]
    state = engine.scheduler.requests[rid]
    stream.push(TextSegment(text, char_start=0))
    stream.close_text()
    drive(engine)
    assert state.status.name == "FINISHED_STOPPED"
    return state.codes


def first_chunks(plans: list[StepPlan], rid: str) -> list[tuple[int, int, int]]:
    """(start, length, copied) of a request's prefill chunks."""
    return [(c.start, c.length, c.copied) for p in plans for c in p.prefill if c.request_id == rid]


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory) -> Qwen3Engine:
    from tests.reference_builders import build_reference_tts

    path = build_reference_tts("base", tmp_path_factory.mktemp("tiny_base_prefix"))
    torch.manual_seed(0)
    eng = Qwen3Engine.from_pretrained(
        path,
        "cpu",
        torch.float32,
        engine_config(
            max_streams=4, kv_slots=4, max_len=160, max_batch=4, enforce_eager=True, progress_bar=False
        ),
    )
    eng._ready = True
    return eng


# -- the prefix is text-independent, and as long as it can be --------------------------------------
def _embeds(engine: Qwen3Engine, text: str, **req: object):  # type: ignore[no-untyped-def]
    pr = PromptRequest(text=text, language="English", **req)  # type: ignore[arg-type]
    tokens = tokenize_request(engine.tokenizer, engine.cfg, pr)
    emb = build_prompt_embeds(
        engine.talker,
        engine.cfg,
        tokens,
        speaker_embedding=pr.speaker_embedding,
        ref_codes=pr.ref_codes,
        non_streaming=pr.non_streaming,
    )
    has_speaker = pr.speaker_embedding is not None or tokens.speaker_id is not None
    ref_frames = None if pr.ref_codes is None else pr.ref_codes.shape[0]
    n = prefix_length(
        tokens,
        has_speaker=has_speaker,
        ref_frames=ref_frames,
        non_streaming=pr.non_streaming,
        prompt_len=emb.prefill.shape[0],
    )
    return emb.prefill, n


def _check_prefix(engine: Qwen3Engine, **req: object) -> int:
    (a, n), (b, m) = _embeds(engine, TEXTS[0], **req), _embeds(engine, TEXTS[1], **req)
    assert n == m and n > 0
    assert torch.equal(a[:n], b[:n])  # shared by every text of the voice
    assert not torch.equal(a[n], b[n])  # the next position already depends on the text
    return n


def test_prefix_is_the_text_independent_part_of_every_prompt_mode(bundle, base_engine) -> None:  # noqa: F811
    cv = make_engine(bundle)
    plain = _check_prefix(cv, speaker="ryan")
    assert _check_prefix(cv, speaker="ryan", instruct=INSTRUCT) > plain  # the instruction is prefix too
    assert _check_prefix(cv, speaker="ryan", non_streaming=True) == plain
    voice = torch.randn(base_engine.cfg.talker.hidden_size)
    codes = torch.randint(0, 2048, (40, 16), generator=torch.Generator().manual_seed(1))
    xvec = _check_prefix(base_engine, speaker_embedding=voice)
    icl = _check_prefix(
        base_engine, speaker_embedding=voice, ref_codes=codes, ref_text="A reference transcript."
    )
    assert icl > xvec  # the transcript's positions are shared too
    assert (
        _check_prefix(
            base_engine,
            speaker_embedding=voice,
            ref_codes=codes,
            ref_text="A reference transcript.",
            non_streaming=True,
        )
        == icl
    )  # transcript shorter than the frames: same prefix


# -- reuse gives the same codes, and skips the prefix ----------------------------------------------
async def test_custom_voice_with_instruction_from_the_cache_equals_no_cache(bundle) -> None:  # noqa: F811
    cached, plain = make_engine(bundle), make_engine(bundle, prefix_cache_bytes=0)
    assert plain.prefix_cache is None and cached.prefix_cache is not None
    voice = {"voice": "ryan", "instructions": INSTRUCT}
    plans = recording(cached)
    first = await speak(cached, "a", TEXTS[0], **voice)
    second = await speak(cached, "b", TEXTS[1], **voice)
    assert cached.prefix_cache.hits == 1 and cached.prefix_cache.misses == 1 and len(cached.prefix_cache) == 1
    assert first == await speak(plain, "a", TEXTS[0], **voice)
    assert second == await speak(plain, "b", TEXTS[1], **voice) and len(second) == 6

    n = cached.prefix_cache.positions_reused
    _, expect = _embeds(cached, TEXTS[1], speaker="ryan", instruct=INSTRUCT)
    assert n == expect
    miss, hit = first_chunks(plans, "a"), first_chunks(plans, "b")
    assert miss[0][0] == 0 and miss[0][2] == 0
    assert hit[0][0] == n and hit[0][2] == n  # prefill starts after the copied prefix
    prompt_b = _embeds(cached, TEXTS[1], speaker="ryan", instruct=INSTRUCT)[0].shape[0]
    assert sum(length for _, length, _ in hit) == prompt_b - n  # only the text part was prefilled
    copies = [c for p in plans for c in p.prefix_copies]
    assert [(c.length, c.key) for c in copies] == [(n, copies[0].key)] and len(copies) == 1
    figures = cached.load().extra
    assert figures["prefix_cache_hits"] == 1 and figures["prefix_positions_reused"] == n


async def test_in_context_clone_from_the_cache_equals_no_cache(base_engine) -> None:
    await base_engine.register_voice("icl", clip(3.0), 16000, "Another reference sentence.")
    voice = base_engine._voices["icl"]
    voice.ref_codes = torch.randint(0, 2048, (30, 16), generator=torch.Generator().manual_seed(3))
    cache = base_engine.prefix_cache
    assert cache is not None
    plans = recording(base_engine)
    hits = cache.hits
    base_engine.prefix_cache = None  # the same engine without reuse: the reference codes
    base_engine.runner.prefix_cache = None
    base_engine.scheduler.prefix_lookup = None
    try:
        reference = [await speak(base_engine, f"ref{i}", t, voice="icl") for i, t in enumerate(TEXTS)]
    finally:
        base_engine.prefix_cache = base_engine.runner.prefix_cache = cache
        base_engine.scheduler.prefix_lookup = cache.lookup
    served = [await speak(base_engine, f"icl{i}", t, voice="icl") for i, t in enumerate(TEXTS)]
    assert cache.hits == hits + 1
    assert served == reference and all(len(c) == 6 for c in served)
    hit = first_chunks(plans, "icl1")
    assert hit[0][2] > 0 and hit[0][0] == hit[0][2]


# -- isolation and the budget ----------------------------------------------------------------------
async def test_two_voices_never_share_an_entry(bundle) -> None:  # noqa: F811
    engine = make_engine(bundle)
    other = next(s for s in engine.cfg.speakers if s.lower() != "ryan")
    await speak(engine, "a", TEXTS[0], voice="ryan")
    await speak(engine, "b", TEXTS[0], voice=other)
    await speak(engine, "c", TEXTS[0], voice="ryan", instructions=INSTRUCT)
    cache = engine.prefix_cache
    assert cache is not None and len(cache) == 3 and cache.hits == 0 and cache.misses == 3
    await speak(engine, "d", TEXTS[1], voice=other)
    assert cache.hits == 1

    tokens = tokenize_request(engine.tokenizer, engine.cfg, PromptRequest(text="x y", language="English"))
    emb = torch.randn(8)
    twin = emb.clone()
    twin[3] += 1e-3
    keys = {
        prefix_key("m", tokens, speaker_embedding=e, ref_codes=None, non_streaming=False, length=9)
        for e in (emb, twin, emb.clone())
    }
    assert len(keys) == 2  # one element apart: two voices; equal bytes: one


async def test_the_byte_budget_evicts_the_least_recent_prefix(bundle) -> None:  # noqa: F811
    engine = make_engine(bundle)
    speakers = [s for s in engine.cfg.speakers][:3]
    await speak(engine, "probe", TEXTS[0], voice=speakers[0])
    cache = engine.prefix_cache
    assert cache is not None
    one = cache.bytes
    small = PrefixKVCache(max_bytes=2 * one)  # room for two voices' prefixes
    engine.prefix_cache = engine.runner.prefix_cache = small
    engine.scheduler.prefix_lookup = small.lookup
    for i, s in enumerate(speakers):
        await speak(engine, f"v{i}", TEXTS[0], voice=s)
        assert small.bytes <= small.max_bytes
    assert len(small) == 2 and small.evictions == 1
    await speak(engine, "again0", TEXTS[1], voice=speakers[0])  # evicted: computed again
    await speak(engine, "again2", TEXTS[1], voice=speakers[2])  # still there
    assert small.misses == 4 and small.hits == 1
    assert PrefixKVCache(max_bytes=one - 1).store("k", engine.runner.cache, 0, 4) is True
    too_small = PrefixKVCache(max_bytes=16)
    assert too_small.store("k", engine.runner.cache, 0, 4) is False and len(too_small) == 0


# -- live load figures ------------------------------------------------------------------------------
async def test_load_reports_live_figures(bundle) -> None:  # noqa: F811
    engine = make_engine(bundle)
    await speak(engine, "a", TEXTS[0], voice="ryan")
    f = engine.load().extra
    assert f["active_streams"] == 0 and f["queued_requests"] == 0
    assert f["kv_blocks_in_use"] == 0 and f["kv_blocks_total"] == 4
    assert f["batch_decode"] == 1 and f["batch_prefill"] == 1 and f["batch_sample"] == 1
    assert f["step_ms_decode"] > 0 and f["step_ms_prefill"] > 0 and f["step_ms_codec"] > 0
    assert f["steps"] == engine.core.steps and f["requests_finished"] == 1
    assert f["ttfa_samples"] == 1 and f["ttfa_p50_ms"] >= 0


def test_one_write_copies_a_prefix_into_several_slots_and_nothing_else() -> None:
    k = torch.randn(2, 6, 3, 16, 4)  # layers, slots, kv heads, positions, head dim
    cache = KVCache(k, torch.randn_like(k))
    before = KVCache(cache.k.clone(), cache.v.clone())
    prefixes = PrefixKVCache(max_bytes=1 << 20)
    assert prefixes.store("voice", cache, 0, 5)
    assert prefixes.copy_into_slots("voice", cache, torch.tensor([2, 4])) == 5
    for slot in (2, 4):
        assert torch.equal(cache.k[:, slot, :, :5], before.k[:, 0, :, :5])
        assert torch.equal(cache.v[:, slot, :, :5], before.v[:, 0, :, :5])
        assert torch.equal(cache.k[:, slot, :, 5:], before.k[:, slot, :, 5:])  # later positions kept
    for slot in (0, 1, 3, 5):
        assert torch.equal(cache.k[:, slot], before.k[:, slot]) and torch.equal(
            cache.v[:, slot], before.v[:, slot]
        )
