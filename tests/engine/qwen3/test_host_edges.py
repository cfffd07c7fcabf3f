"""Host-side bookkeeping of the Qwen3 runner on edges the usual streams do not reach (tiny random
CustomVoice model, CPU): an in-context clone's reference clip runs through its Code2Wav slot once
per slot, whether its prompt is prefilled again after a preemption or a step fails between the
prompt and the Code2Wav launch."""

from __future__ import annotations

import pytest
import torch

from engine.api import SynthesisRequest, TextSegment
from engine.qwen3.engine import Qwen3Engine, _Voice
from engine.qwen3.plan import PrefillChunk, StepPlan
from engine.qwen3.runner import RowSampling, SegmentPrompt
from tests.engine.qwen3.test_qwen3_engine import bundle, checkpoint, make_engine  # noqa: F401

pytestmark = pytest.mark.reference
REF_FRAMES = 4


def clone_prompt(engine: Qwen3Engine, with_clip: bool = True) -> SegmentPrompt:
    """A prepared prompt; with_clip: it carries reference codes, as an in-context clone's does (only
    the Code2Wav priming reads them here, so a preset prompt stands in for the clone's)."""
    request = SynthesisRequest(request_id="x", voice="ryan", language="English")
    prompt = engine._segment_prompt(
        TextSegment("Hello there.", char_start=0), request, _Voice(speaker="ryan"), None
    )
    engine.runner.prepare([prompt])
    if with_clip:
        prompt.ref_codes = torch.randint(0, 64, (REF_FRAMES, 16), generator=torch.Generator().manual_seed(0))
    return prompt


def whole_prompt(
    rid: str, prompt: SegmentPrompt, kv_slot: int, codec_slot: int, samples: bool
) -> PrefillChunk:
    n = engine_prompt_len(prompt)
    return PrefillChunk(
        request_id=rid,
        kv_slot=kv_slot,
        codec_slot=codec_slot,
        start=0,
        length=n,
        prompt_len=n,
        payload=prompt,
        samples_frame=samples,
        frame_index=0,
        utterance_frame=0,
        sampling=RowSampling(seed=1, greedy=True),
    )


def engine_prompt_len(prompt: SegmentPrompt) -> int:
    assert prompt.embeds is not None
    return int(prompt.embeds.prefill.shape[0])


@pytest.mark.parametrize("state_cache", [0, 64 << 20], ids=["no-state-cache", "state-cache"])
def test_a_clone_prefilled_again_after_a_preemption_keeps_one_run_of_its_clip(bundle, state_cache) -> None:  # noqa: F811
    engine = make_engine(bundle, codec_state_cache_bytes=state_cache, prefix_cache_bytes=0)
    runner, codec = engine.runner, engine.codec
    prompt = clone_prompt(engine)
    runner.execute(StepPlan(step=1, prefill=[whole_prompt("a", prompt, 0, 0, False)], codec_resets=[0]))
    assert int(codec.positions[0]) == REF_FRAMES
    after_clip = codec.slot_state(0)
    # preempted before its first frame: a new talker slot, the same Code2Wav slot (no reset)
    runner.execute(StepPlan(step=2, freed_kv_slots=[0], prefill=[whole_prompt("a", prompt, 1, 0, False)]))
    assert int(codec.positions[0]) == REF_FRAMES
    for before, now in zip(after_clip, codec.slot_state(0), strict=True):
        assert torch.equal(before, now)


def test_a_clip_left_by_a_failed_step_never_reaches_the_next_owner_of_its_slot(bundle, monkeypatch) -> None:  # noqa: F811
    engine = make_engine(bundle, prefix_cache_bytes=0)
    runner, codec = engine.runner, engine.codec
    sample = runner._sample

    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("device fault")

    monkeypatch.setattr(runner, "_sample", fail)
    with pytest.raises(RuntimeError, match="device fault"):
        runner.execute(
            StepPlan(step=1, prefill=[whole_prompt("a", clone_prompt(engine), 0, 0, True)], codec_resets=[0])
        )
    monkeypatch.setattr(runner, "_sample", sample)
    # the failed request's slots go to a preset-voice request, its Code2Wav slot reset
    plain = clone_prompt(engine, with_clip=False)
    runner.execute(StepPlan(step=2, prefill=[whole_prompt("b", plain, 0, 0, False)], codec_resets=[0]))
    assert int(codec.positions[0]) == 0
