"""The on-device sampler: per-row seeds, filters, masks, forced length, min_new_tokens."""

from __future__ import annotations

import pytest
import torch

from engine.qwen3.generate import GenerationRequest, generate_codes
from engine.qwen3.models.sampler import (
    TOP_K_BOUND,
    SamplingParams,
    apply_repetition_penalty,
    mask_talker_logits,
    sample,
    suppression_mask,
    top_k_within_bound,
    uniform_noise,
)

V = 64


def params(
    n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False
) -> SamplingParams:
    return SamplingParams.build([temperature] * n, [top_k] * n, [top_p] * n, [greedy] * n, "cpu")


def test_noise_is_uniform_and_depends_only_on_seed_counter_index() -> None:
    u = uniform_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 5]), 4096)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02
    again = uniform_noise(torch.tensor([7, 1]), torch.tensor([3, 0]), 4096)
    assert torch.equal(again[1], u[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_row_draws_independent_of_batch_composition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    seeds, counters = torch.tensor([11, 22, 33]), torch.tensor([4, 9, 0])
    full = sample(logits, params(3, 0.9, 50), seeds, counters)
    order = torch.tensor([2, 0])
    subset = sample(logits[order], params(2, 0.9, 50), seeds[order], counters[order])
    assert torch.equal(subset, full[order])
    # and reproducible
    assert torch.equal(full, sample(logits, params(3, 0.9, 50), seeds, counters))


def test_draws_follow_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)]).expand(4000, -1)
    ids = sample(logits, params(4000), torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    freq = torch.bincount(ids, minlength=V)[:4].float() / 4000
    expected = torch.softmax(logits[0, :4], dim=0)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_and_top_p_respected() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, V).expand(2000, -1)
    ids = sample(logits, params(2000, 1.5, top_k=5), torch.arange(2000), torch.zeros(2000, dtype=torch.long))
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(ids.tolist()) <= allowed and len(set(ids.tolist())) > 1
    # top-p: the smallest set whose mass exceeds p
    probs = torch.softmax(logits[0], 0)
    ids = sample(
        logits, params(2000, 1.0, top_p=0.5), torch.arange(2000), torch.zeros(2000, dtype=torch.long)
    )
    order = probs.argsort(descending=True)
    keep = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    assert set(ids.tolist()) <= set(order[:keep].tolist())


def test_greedy_rows_take_argmax_beside_sampling_rows() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    p = SamplingParams.build([1.0, 1.0], [0, 0], [1.0, 1.0], [True, False], "cpu")
    ids = sample(logits, p, torch.tensor([0, 0]), torch.tensor([0, 0]))
    assert int(ids[0]) == int(logits[0].argmax())


def test_repetition_penalty_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def _talker_masks(step: int, min_new: int, end_at: int) -> torch.Tensor:
    logits = torch.zeros(1, 3072)
    logits[0, 2150] = 100.0  # EOS
    logits[0, 2500] = 1000.0  # a control id: suppressed
    return mask_talker_logits(
        logits,
        step=torch.tensor([step]),
        seen=torch.zeros(1, 3072, dtype=torch.bool),
        repetition_penalty=torch.tensor([1.05]),
        suppress=suppression_mask(3072, 2048, 2150, "cpu"),
        eos_id=2150,
        min_new_tokens=torch.tensor([min_new]),
        end_at=torch.tensor([end_at]),
    )


@pytest.mark.parametrize("step", [0, 1, 2, 5])
def test_suppressed_ids_and_min_new_tokens(step: int) -> None:
    scores = _talker_masks(step, min_new=2, end_at=1 << 40)
    assert torch.isinf(scores[0, 2048:2150]).all() and torch.isinf(scores[0, 2151:]).all()
    ids = sample(
        scores.expand(200, -1), params(200, 0.9, 50), torch.arange(200), torch.zeros(200, dtype=torch.long)
    )
    assert (ids < 2048).all() if step < 2 else (ids == 2150).all()


def test_forced_end_allows_only_eos() -> None:
    scores = _talker_masks(step=4, min_new=4, end_at=4)
    assert int(scores.argmax()) == 2150 and torch.isinf(scores[0, :2150]).all()
    assert torch.isinf(_talker_masks(step=3, min_new=4, end_at=4)[0, 2150])


def test_forced_length_and_seeds_in_generation(bundles: dict) -> None:
    """Sampling mode: forced_frames gives exactly N frames; a row's codes depend only on its seed."""
    from engine.qwen3.prompt_builder import build_prompt
    from engine.qwen3.prompts import PromptRequest

    b = bundles["custom_voice"]
    prompts = [
        build_prompt(b.talker, b.config, b.tokenizer, PromptRequest(text=t, speaker="ryan"))
        for t in ("Hello world.", "Good morning, how are you today?")
    ]
    with torch.no_grad():  # make EOS the most likely code: only the forcing keeps rows going
        saved = b.talker.codec_head.weight[2150].clone()
        b.talker.codec_head.weight[2150] = b.talker.codec_head.weight[:2048].mean(0) + 5.0
    try:
        reqs = [
            GenerationRequest(prompt=prompts[0], seed=5, forced_frames=5),
            GenerationRequest(prompt=prompts[1], seed=9, forced_frames=3),
        ]
        codes = generate_codes(b.talker, reqs, b.generation)
        assert [c.shape[0] for c in codes] == [5, 3]
        alone = generate_codes(b.talker, [reqs[1]], b.generation)
        assert torch.equal(alone[0], codes[1])
        other_seed = generate_codes(
            b.talker, [GenerationRequest(prompt=prompts[1], seed=10, forced_frames=3)], b.generation
        )
        assert not torch.equal(other_seed[0], codes[1])
        free = generate_codes(
            b.talker,
            [
                GenerationRequest(prompt=prompts[0], greedy=True, max_frames=8),
                GenerationRequest(prompt=prompts[0], seed=5, max_frames=8),
            ],
            b.generation,
        )
        assert free[0].shape[0] == 2  # EOS dominates: ends right after min_new_tokens
        assert 2 <= free[1].shape[0] < 8
    finally:
        with torch.no_grad():
            b.talker.codec_head.weight[2150] = saved


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_bounded_sampler_draws_what_the_full_vocabulary_sampler_draws(top_p: float) -> None:
    torch.manual_seed(3)
    n, vocab = 96, 2048
    logits = torch.randn(n, vocab) * 3
    top_k = torch.randint(1, 65, (n,)).tolist()
    p = SamplingParams.build([0.9] * n, top_k, [top_p] * n, [False] * n, "cpu")
    seeds, counters = torch.arange(n) * 7919, torch.arange(n) % 5
    for step in range(4):
        full = sample(logits, p, seeds, counters + step)
        bounded = sample(logits, p, seeds, counters + step, bounded=True)
        assert torch.equal(full, bounded)
    # and the rows really sample: some draw other than the argmax
    assert (full != logits.argmax(-1)).any()


def test_bounded_sampler_is_only_claimed_for_top_k_within_the_bound() -> None:
    assert top_k_within_bound(50) and top_k_within_bound(TOP_K_BOUND)
    assert not top_k_within_bound(0) and not top_k_within_bound(TOP_K_BOUND + 1)
    assert top_k_within_bound(0, greedy=True)
