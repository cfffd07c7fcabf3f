"""Offline, batched generation of codec frames, equivalent to upstream's `generate` (same prompts,
same logits processing; greedy output identical), built from the modules the fast runner uses:

    prefill each request into its KV slot
    loop:  codebook 0 sampled from the talker logits (penalty, EOS and control-id masks)
           code predictor -> codebooks 1..15
           next input = sum of the 16 codebook embeddings + the frame's text-track embedding
           one batched talker step

A row ends when it samples EOS (masked for the first `min_new_tokens` frames; forced at
`max_frames` / `forced_frames`); its codes stop before the EOS frame. Finished rows keep running
(fixed shapes) until every row has ended.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.qwen3.models.config import GenerationDefaults
from engine.qwen3.models.sampler import (
    SEED_MASK,
    SamplingParams,
    mark_seen,
    mask_talker_logits,
    sample,
    suppression_mask,
)
from engine.qwen3.models.talker import Talker
from engine.qwen3.prompts import PromptEmbeds


@dataclass
class GenerationRequest:
    prompt: PromptEmbeds
    seed: int | None = None  # None: a random seed
    greedy: bool = False  # greedy talker and code predictor
    temperature: float | None = None  # None: generation defaults
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_frames: int | None = None  # None: defaults.max_new_tokens - 1 (as upstream)
    forced_frames: int | None = None  # exactly this many frames: EOS masked before, forced at it
    min_new_tokens: int | None = None


@dataclass
class RowSettings:
    """Per-row tensors for the talker and the code predictor, [B] each."""

    talker: SamplingParams
    predictor: SamplingParams
    repetition_penalty: Tensor
    seed: Tensor
    min_new_tokens: Tensor
    end_at: Tensor  # frames at which EOS is forced


def row_settings(
    requests: list[GenerationRequest], defaults: GenerationDefaults, device: torch.device | str
) -> RowSettings:
    def pick(value: object, default: object) -> object:
        return default if value is None else value

    seeds, ends, mins = [], [], []
    for r in requests:
        seeds.append((random.getrandbits(63) if r.seed is None else r.seed) & SEED_MASK)
        if r.forced_frames is not None:
            ends.append(r.forced_frames)
            mins.append(r.forced_frames)
        else:
            ends.append(r.max_frames if r.max_frames is not None else max(defaults.max_new_tokens - 1, 1))
            mins.append(pick(r.min_new_tokens, defaults.min_new_tokens))
    talker = SamplingParams.build(
        temperature=[float(pick(r.temperature, defaults.temperature)) for r in requests],  # type: ignore[arg-type]
        top_k=[int(pick(r.top_k, defaults.top_k)) for r in requests],  # type: ignore[call-overload]
        top_p=[float(pick(r.top_p, defaults.top_p)) for r in requests],  # type: ignore[arg-type]
        greedy=[r.greedy or not defaults.do_sample for r in requests],
        device=device,
    )
    predictor = SamplingParams.build(
        temperature=[defaults.subtalker_temperature] * len(requests),
        top_k=[defaults.subtalker_top_k] * len(requests),
        top_p=[defaults.subtalker_top_p] * len(requests),
        greedy=[r.greedy or not defaults.subtalker_do_sample for r in requests],
        device=device,
    )
    return RowSettings(
        talker=talker,
        predictor=predictor,
        repetition_penalty=torch.tensor(
            [float(pick(r.repetition_penalty, defaults.repetition_penalty)) for r in requests],  # type: ignore[arg-type]
            dtype=torch.float32,
            device=device,
        ),
        seed=torch.tensor(seeds, dtype=torch.int64, device=device),
        min_new_tokens=torch.tensor(mins, dtype=torch.int64, device=device),
        end_at=torch.tensor(ends, dtype=torch.int64, device=device),
    )


def text_track(prompts: list[PromptEmbeds], frames: int) -> Tensor:
    """[B, frames, H]: trailing text per frame, tts_pad after it runs out."""
    rows = []
    for p in prompts:
        row = p.tts_pad.expand(frames, -1).clone()
        n = min(frames, p.trailing.shape[0])
        row[:n] = p.trailing[:n]
        rows.append(row)
    return torch.stack(rows)


@torch.no_grad()
def generate_codes(
    talker: Talker, requests: list[GenerationRequest], defaults: GenerationDefaults
) -> list[Tensor]:
    """-> per request, LongTensor [frames, num_code_groups] (trimmed before EOS)."""
    cfg = talker.cfg
    device = talker.codec_head.weight.device
    dtype = talker.codec_head.weight.dtype
    b = len(requests)
    groups = cfg.num_code_groups
    rows = row_settings(requests, defaults, device)
    longest = int(rows.end_at.max())
    lengths = [r.prompt.prefill.shape[0] for r in requests]
    cache = talker.allocate_cache(b, max(lengths) + longest + 2, device, dtype)
    predictor_cache = talker.code_predictor.allocate_cache(b, device, dtype)
    suppress = suppression_mask(cfg.vocab_size, cfg.control_id_start, cfg.codec_eos_id, device)
    text = text_track([r.prompt for r in requests], longest + 1).to(dtype)

    hidden_rows = []
    for i, r in enumerate(requests):
        embeds = r.prompt.prefill.to(dtype)[None]
        positions = torch.arange(lengths[i], device=device)[None]
        slot = torch.tensor([i], device=device)
        hidden_rows.append(talker(embeds, positions, cache, slot, lengths[i])[0, -1])
    hidden = torch.stack(hidden_rows)
    slots = torch.arange(b, device=device)
    base_positions = torch.tensor(lengths, device=device, dtype=torch.int64)[:, None]

    seen = torch.zeros(b, cfg.vocab_size, dtype=torch.bool, device=device)
    step = torch.zeros(b, dtype=torch.int64, device=device)
    ended = torch.full((b,), -1, dtype=torch.int64, device=device)
    frames: list[Tensor] = []
    for t in range(longest + 1):
        logits = mask_talker_logits(
            talker.logits(hidden),
            step=step,
            seen=seen,
            repetition_penalty=rows.repetition_penalty,
            suppress=suppress,
            eos_id=cfg.codec_eos_id,
            min_new_tokens=rows.min_new_tokens,
            end_at=rows.end_at,
        )
        first = sample(logits, rows.talker, rows.seed, step * groups)
        mark_seen(seen, first)
        ended = torch.where((ended < 0) & (first == cfg.codec_eos_id), step, ended)
        if bool((ended >= 0).all()):
            break
        codes = talker.predict_codes(hidden, first, rows.predictor, rows.seed, step * groups, predictor_cache)
        frames.append(codes)
        embeds = (talker.frame_embedding(codes) + text[:, t])[:, None]
        kv_len = max(lengths) + t + 1
        hidden = talker(embeds, base_positions + t, cache, slots, kv_len)[:, 0]
        step = step + 1

    stacked = (
        torch.stack(frames, dim=1) if frames else torch.zeros(b, 0, groups, dtype=torch.long, device=device)
    )
    return [stacked[i, : int(ended[i])] for i in range(b)]
