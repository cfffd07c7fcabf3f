"""One-position prompt chunks ride in the talker's decode batch (tiny random model, CPU, fp32,
greedy): prompts prefilled a position at a time beside decoding rows give exactly the codes of the
usual chunked prefill, and never reach the separate prefill forward."""

from __future__ import annotations

import pytest

from engine.api import SynthesisRequest, TextSegment
from engine.qwen3.engine import Qwen3Engine
from tests.engine.qwen3.test_prefix_cache import recording
from tests.engine.qwen3.test_qwen3_engine import bundle, checkpoint, drive, make_engine  # noqa: F401

pytestmark = pytest.mark.reference
TEXTS = ("Hello there, nice to meet you.", "Quite a different sentence, really.", "A third one.")


def speak_together(engine: Qwen3Engine) -> dict[str, list[list[int]]]:
    """Three requests, the second and third opened while the first decodes."""
    states = {}
    for i, text in enumerate(TEXTS):
        rid = f"r{i}"
        stream = engine.open(
            SynthesisRequest(request_id=rid, voice="ryan", language="English", greedy=True, max_frames=8)
        )
        states[rid] = engine.scheduler.requests[rid]
        stream.push(TextSegment(text, char_start=0))
        stream.close_text()
        drive(engine, max_steps=3 if i < len(TEXTS) - 1 else 400)
    drive(engine)
    return {rid: s.codes for rid, s in states.items()}


async def test_prompts_a_position_at_a_time_in_the_decode_batch_give_the_same_codes(bundle) -> None:  # noqa: F811
    usual = speak_together(make_engine(bundle, prefix_cache_bytes=0))
    merged_engine = make_engine(bundle, prefix_cache_bytes=0, max_prefill_chunk=1)
    separate_calls = []
    prefill = merged_engine.runner._prefill
    merged_engine.runner._prefill = lambda chunks: separate_calls.append(chunks) or prefill(chunks)  # type: ignore[method-assign]
    plans = recording(merged_engine)
    merged = speak_together(merged_engine)
    assert merged == usual and all(len(codes) == 8 for codes in merged.values())
    assert separate_calls == []
    mixed = [p for p in plans if p.decode and p.prefill]
    assert mixed, "no step mixed decoding rows with prompt positions"
    assert all(c.length == 1 for p in plans for c in p.prefill)


async def test_prompt_chunks_padded_into_buckets_equal_the_eager_forward(bundle) -> None:  # noqa: F811
    bucketed = make_engine(bundle, prefix_cache_bytes=0)
    eager = make_engine(bundle, prefix_cache_bytes=0)
    eager.runner.config.prefill_row_buckets = (1,)  # two rows or more no longer fit a bucket
    eager.runner.config.prefill_len_buckets = (4,)  # nor do chunks longer than 4 positions
    paths: dict[str, int] = {"bucket": 0, "eager": 0}
    for engine in (bucketed, eager):
        for name in paths:
            method = getattr(engine.runner, f"_prefill_{name}")

            def counted(*args, _method=method, _name=name):  # type: ignore[no-untyped-def]
                paths[_name] += 1
                return _method(*args)

            setattr(engine.runner, f"_prefill_{name}", counted)
    first = speak_together(bucketed)
    assert paths == {"bucket": len(TEXTS), "eager": 0}
    assert speak_together(eager) == first
    assert paths["eager"] == len(TEXTS)


INSTRUCTION = "Speak slowly, please."  # a prompt of 24 positions; without an instruction: 10


def speak_pair(engine: Qwen3Engine) -> dict[str, list[list[int]]]:
    """A long prompt, and four steps later a short one: in chunks of 3 positions both prompts end
    in the same step, the long one on a full chunk ahead of the short one's single position."""
    states = {}
    for rid, voice in (("long", {"instructions": INSTRUCTION}), ("short", {})):
        stream = engine.open(
            SynthesisRequest(
                request_id=rid, voice="ryan", language="English", greedy=True, max_frames=6, **voice
            )
        )  # type: ignore[arg-type]
        states[rid] = engine.scheduler.requests[rid]
        stream.push(TextSegment(TEXTS[0], char_start=0))
        stream.close_text()
        drive(engine, max_steps=4 if rid == "long" else 400)
    return {rid: s.codes for rid, s in states.items()}


async def test_codes_reach_their_requests_when_one_position_and_longer_prompt_chunks_share_a_step(
    bundle,  # noqa: F811
) -> None:
    usual = speak_pair(make_engine(bundle, prefix_cache_bytes=0))
    engine = make_engine(bundle, prefix_cache_bytes=0, max_prefill_chunk=3)
    plans = recording(engine)
    assert speak_pair(engine) == usual
    ends = [[(c.request_id, c.length) for c in p.prefill if c.samples_frame] for p in plans]
    # the runner samples one-position chunks before longer ones; the codes still reach their requests
    assert [("long", 3), ("short", 1)] in ends
