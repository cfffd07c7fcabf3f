"""Talker KV of a voice's prompt prefix, computed once and copied into the slots of its later requests.

A prompt opens with positions that do not depend on the text to speak: the instruction, the role
tokens, the codec tags with the speaker (preset id or x-vector) and, for an in-context clone, the
reference transcript's positions (streaming: each summed with a reference frame, past them the
target text joins the frames; non-streaming: the transcript opens the text block). `prefix_length` counts them from the prompt tokens;
`prefix_key` hashes everything they are built from (model, mode, instruction, language, speaker,
embedding and reference codes bytes), so two voices never share an entry.

The cache keeps, per key, the keys and values of those positions for every layer, in an LRU bounded
by bytes. The scheduler asks `lookup` when a segment starts in a slot; on a hit the runner copies
the entry into the slot and the prefill starts after the prefix. On a miss the runner stores the
prefix once the request's own prefill has covered it. Used on the step thread only; `stats` may be
read from any thread.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.qwen3.models.layers import KVCache
from engine.qwen3.prompts import PromptTokens

ROLE_POSITIONS = 3  # "<|im_start|>assistant\n"
# codec positions after the tags (and speaker) that the prompt's fixed part holds: codec_pad
# (codec_bos goes with the first text position)
TRAILING_CODEC_TAGS = 1


def prefix_length(
    tokens: PromptTokens,
    *,
    has_speaker: bool,
    ref_frames: int | None,
    non_streaming: bool,
    prompt_len: int,
) -> int:
    """Leading prompt positions that do not depend on the segment's text (at most prompt_len - 1:
    the last position must be prefilled to sample the first frame)."""
    tags = 3 if tokens.language_id is None else 4  # think/nothink, think_bos, [language], think_eos
    n = len(tokens.instruct_ids or ()) + ROLE_POSITIONS + tags + int(has_speaker) + TRAILING_CODEC_TAGS
    if ref_frames is not None and tokens.ref_ids is not None:
        ref_text = max(0, len(tokens.ref_ids) - 5)  # the transcript without its ChatML frame
        # streaming: the transcript is summed with codec_bos + the frames; non-streaming: it opens
        # the text block (the frames come after the target text)
        n += ref_text if non_streaming else min(ref_text, 1 + ref_frames)
    return max(0, min(n, prompt_len - 1))


def _tensor_bytes(t: Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return f"{flat.dtype}|{tuple(t.shape)}|".encode() + flat.view(torch.uint8).numpy().tobytes()


def prefix_key(
    model: str,
    tokens: PromptTokens,
    *,
    speaker_embedding: Tensor | None,
    ref_codes: Tensor | None,
    non_streaming: bool,
    length: int,
) -> str:
    """Hash of everything a prompt's prefix is built from (never the segment's text)."""
    h = hashlib.blake2b(digest_size=20)
    fields = (
        model,
        "icl" if ref_codes is not None else "plain",
        non_streaming,
        length,
        tokens.text_ids[:ROLE_POSITIONS],
        tokens.instruct_ids,
        tokens.ref_ids,
        tokens.language_id,
        tokens.speaker_id,
    )
    h.update(repr(fields).encode())
    for t in (speaker_embedding, ref_codes):
        h.update(b"|none|" if t is None else _tensor_bytes(t))
    return h.hexdigest()


@dataclass(slots=True)
class PrefixEntry:
    k: Tensor  # [layers, kv_heads, length, head_dim]
    v: Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PrefixKVCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.positions_reused = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str, length: int) -> bool:
        """True when the prefix `key` of `length` positions is cached (counted as a hit, made recent)."""
        entry = self._entries.get(key)
        if entry is None or entry.length != length:
            self.misses += 1
            return False
        self._entries.move_to_end(key)
        self.hits += 1
        self.positions_reused += length
        return True

    def store(self, key: str, cache: KVCache, slot: int, length: int) -> bool:
        """Keep positions [0, length) of a slot under `key`; False when it does not fit the budget."""
        if key in self._entries or length <= 0:
            return key in self._entries
        entry = PrefixEntry(cache.k[:, slot, :, :length].clone(), cache.v[:, slot, :, :length].clone())
        if entry.nbytes > self.max_bytes:
            return False
        self._entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        return True

    def copy_into_slots(self, key: str, cache: KVCache, slots: Tensor) -> int:
        """Write the entry into the first positions of several slots (a long tensor on the
        cache's device) with one write per cache tensor; returns how many positions."""
        entry = self._entries[key]
        n = entry.length
        cache.k[:, slots, :, :n] = entry.k.unsqueeze(1)
        cache.v[:, slots, :, :n] = entry.v.unsqueeze(1)
        return n

    def stats(self) -> dict[str, float]:
        return {
            "prefix_cache_entries": float(len(self._entries)),
            "prefix_cache_bytes": float(self.bytes),
            "prefix_cache_budget_bytes": float(self.max_bytes),
            "prefix_cache_hits": float(self.hits),
            "prefix_cache_misses": float(self.misses),
            "prefix_cache_evictions": float(self.evictions),
            "prefix_positions_reused": float(self.positions_reused),
        }
