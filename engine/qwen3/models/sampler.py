"""On-device token sampling with per-row parameters and per-row seeds.

Everything is tensor ops on fixed shapes (no host reads), so it can live inside a CUDA graph.

Randomness is counter based: the uniform noise for (row, vocab index) is a hash of the row's seed,
the row's own counter (frame step x code group) and the index. A row's draws therefore depend only
on its seed and its own progress, never on which other rows share the batch, and replaying a
captured graph draws fresh noise as the counters advance. Sampling is a Gumbel-max over the
processed logits, which draws from the same distribution as softmax + multinomial.

Logits processing follows upstream (HF generate) order: repetition penalty, min-new-tokens EOS mask,
suppressed ids, then for sampling rows temperature, top-k, top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.qwen3.models import sampling_kernel
from engine.qwen3.models.kernel_guard import KernelGuard

_MASK32 = 0xFFFFFFFF
_NEG_INF = float("-inf")
SEED_MASK = (1 << 63) - 1  # seeds are taken modulo 2**63 on the host


def _mulmod32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    hi = ((x >> 16) * c) & 0xFFFF
    return ((hi << 16) + (x & 0xFFFF) * c) & _MASK32


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise_at(seed: Tensor, counter: Tensor, index: Tensor) -> Tensor:
    """seed [B] int64 (>= 0), counter [B] int64, vocabulary indices [B, K] or [K]
    -> uniform float32 in (0, 1) for those (row, index) cells, [B, K]."""
    h = mix32(seed & _MASK32)
    h = mix32(h ^ ((seed >> 32) & _MASK32))
    h = mix32(h ^ (counter & _MASK32))
    cell = mix32(index + 0x632BE5AB)
    bits = mix32(h[:, None] ^ (cell if cell.dim() == 2 else cell[None, :])) >> 8  # 24 bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def uniform_noise(seed: Tensor, counter: Tensor, size: int) -> Tensor:
    """The noise of every vocabulary index, [B, size]."""
    return uniform_noise_at(seed, counter, torch.arange(size, device=seed.device, dtype=torch.int64))


def gumbel_noise(seed: Tensor, counter: Tensor, size: int) -> Tensor:
    return -torch.log(-torch.log(uniform_noise(seed, counter, size)))


def gumbel_noise_at(seed: Tensor, counter: Tensor, index: Tensor) -> Tensor:
    return -torch.log(-torch.log(uniform_noise_at(seed, counter, index)))


@dataclass
class SamplingParams:
    """Per-row sampling settings as device tensors, [B] each."""

    temperature: Tensor  # float32, > 0
    top_k: Tensor  # int64, 0 = off
    top_p: Tensor  # float32, 1.0 = off
    greedy: Tensor  # bool

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        greedy: list[bool],
        device: torch.device | str,
    ) -> SamplingParams:
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        )


def filter_top_k_top_p(scores: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """scores [B, V] (already temperature-scaled) -> scores with filtered entries at -inf."""
    vocab = scores.shape[-1]
    ascending, order = scores.sort(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = ascending.gather(1, (vocab - k)[:, None])  # k-th largest value per row
    ascending = ascending.masked_fill(ascending < kth, _NEG_INF)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1.0 - top_p)[:, None]
    drop_sorted[:, -1] = False  # always keep the most likely token
    drop_sorted = drop_sorted | (ascending == _NEG_INF)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, _NEG_INF)


TOP_K_BOUND = 64  # the candidate-set size of the bounded sampler (upstream's default top_k is 50)


def top_k_within_bound(top_k: int, greedy: bool = False) -> bool:
    """Whether a row can use the bounded sampler (greedy rows ignore top_k)."""
    return greedy or 1 <= top_k <= TOP_K_BOUND


def sample(
    logits: Tensor, params: SamplingParams, seed: Tensor, counter: Tensor, bounded: bool = False
) -> Tensor:
    """logits [B, V] (already penalised/masked) -> ids [B]. Greedy rows take the argmax.

    bounded: every sampling row has 1 <= top_k <= TOP_K_BOUND (the caller checks on the host), so
    only the TOP_K_BOUND best candidates can be drawn: filtering and noise run on those alone, with
    the same noise per (row, index) and so the same draws as the full-vocabulary path."""
    scores = logits.float()
    greedy_ids = scores.argmax(dim=-1)
    k = min(TOP_K_BOUND, scores.shape[-1])
    if bounded and k == TOP_K_BOUND and scores.is_cuda and draw_kernel.ready(scores.device):
        values, index = scores.topk(k, dim=-1)  # the kernel applies the temperature itself
        sampled_ids = sampling_kernel.draw(
            values, index, params.temperature, params.top_k, params.top_p, seed, counter
        )
        return torch.where(params.greedy, greedy_ids, sampled_ids)
    if bounded:
        sampled_ids = _bounded_draw(scores, params, seed, counter, k)
    else:
        scaled = scores / params.temperature[:, None]
        filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
        sampled_ids = (filtered + gumbel_noise(seed, counter, scores.shape[-1])).argmax(dim=-1)
    return torch.where(params.greedy, greedy_ids, sampled_ids)


def _bounded_draw(scores: Tensor, params: SamplingParams, seed: Tensor, counter: Tensor, k: int) -> Tensor:
    """The bounded draw in torch ops: filtering and noise over each row's k best candidates."""
    values, index = (scores / params.temperature[:, None]).topk(k, dim=-1)
    filtered = filter_top_k_top_p(values, params.top_k, params.top_p)
    best = (filtered + gumbel_noise_at(seed, counter, index)).argmax(dim=-1, keepdim=True)
    return index.gather(1, best)[:, 0]


def _compare_draw_kernel(device: torch.device, rows: int = 256) -> None:
    """Raise unless the Triton draw agrees with the torch draw on nearly every row (top-p's
    cumulative sum may round differently at its boundary)."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    scores = (torch.randn(rows, 2048, generator=gen) * 3).to(device)
    top_k = torch.randint(1, TOP_K_BOUND + 1, (rows,), generator=gen).tolist()
    params = SamplingParams.build([0.9] * rows, top_k, [1.0] * rows, [False] * rows, device)
    seed = torch.arange(rows, device=device) * 7919
    counter = torch.arange(rows, device=device) % 11
    expected = _bounded_draw(scores, params, seed, counter, TOP_K_BOUND)
    values, index = scores.topk(TOP_K_BOUND, dim=-1)
    got = sampling_kernel.draw(values, index, params.temperature, params.top_k, params.top_p, seed, counter)
    agree = float((got == expected).float().mean())
    if agree < 0.99:
        raise ValueError(f"it agrees with the torch draw on {100 * agree:.1f} % of rows")


# the bounded draw's Triton kernel, checked on each device before first use (the runner checks it
# at start-up, before any graph is captured)
draw_kernel = KernelGuard("sampling kernel", _compare_draw_kernel, built=sampling_kernel.BUILT)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """HF semantics: seen ids' logits are divided by the penalty when positive, multiplied when negative."""
    p = penalty[:, None].to(logits.dtype)
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def suppression_mask(vocab_size: int, control_start: int, eos_id: int, device: torch.device | str) -> Tensor:
    """Upstream suppresses every id in [vocab - 1024, vocab) except EOS."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[control_start:] = True
    mask[eos_id] = False
    return mask


def mask_talker_logits(
    logits: Tensor,
    *,
    step: Tensor,
    seen: Tensor,
    repetition_penalty: Tensor,
    suppress: Tensor,
    eos_id: int,
    min_new_tokens: Tensor,
    end_at: Tensor,
) -> Tensor:
    """Codebook-0 logits processing for one step.

    step [B]: frames already produced by the row (the index of the frame being sampled).
    min_new_tokens [B]: EOS is masked while step < min_new_tokens (forced length: set it to N).
    end_at [B]: from this step on only EOS is allowed (max frames / forced length; a huge value = off).
    """
    scores = apply_repetition_penalty(logits.float(), seen, repetition_penalty)
    scores = scores.masked_fill(suppress[None, :], _NEG_INF)
    eos_blocked = (step < min_new_tokens)[:, None]
    vocab_ids = torch.arange(scores.shape[-1], device=scores.device)
    is_eos = (vocab_ids == eos_id)[None, :]
    scores = scores.masked_fill(is_eos & eos_blocked, _NEG_INF)
    forced_end = (step >= end_at)[:, None]
    return scores.masked_fill(forced_end & ~is_eos, _NEG_INF).masked_fill(forced_end & is_eos, 0.0)


def mark_seen(seen: Tensor, ids: Tensor) -> Tensor:
    """seen [B, V] bool; ids [B] -> seen with ids set (in place; returned for chaining)."""
    return seen.scatter_(1, ids[:, None], True)
