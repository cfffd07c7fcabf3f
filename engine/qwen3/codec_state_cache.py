"""Code2Wav state after a clone's reference clip, computed once per voice and copied into new slots.

An in-context clone's audio continues its reference clip (upstream decodes reference + generated
codes and cuts the reference off), so every request of such a voice first runs the clip's frames
through its Code2Wav slot. That state depends on the reference codes alone: the cache keeps it per
codes tensor (a voice holds its tensor for as long as it is registered; a dead tensor's entry can
never match a new one, because each entry holds a weak reference to the tensor it was made from),
in an LRU bounded by bytes. Used on the step thread only.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor


@dataclass(slots=True)
class _Entry:
    codes: weakref.ref[Tensor]
    state: list[Tensor]
    nbytes: int


class CodecStateCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, codes: Tensor) -> list[Tensor] | None:
        """The state after `codes` when cached (counted, made recent), else None."""
        entry = self._entries.get(id(codes))
        if entry is None or entry.codes() is not codes:
            self.misses += 1
            return None
        self._entries.move_to_end(id(codes))
        self.hits += 1
        return entry.state

    def store(self, codes: Tensor, state: list[Tensor]) -> bool:
        """Keep `state` as the state after `codes`; False when it does not fit the budget."""
        nbytes = sum(t.numel() * t.element_size() for t in state)
        if nbytes > self.max_bytes:
            return False
        old = self._entries.pop(id(codes), None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[id(codes)] = _Entry(weakref.ref(codes), state, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1
        return True

    def stats(self) -> dict[str, float]:
        return {
            "codec_state_cache_entries": float(len(self._entries)),
            "codec_state_cache_bytes": float(self.bytes),
            "codec_state_cache_hits": float(self.hits),
            "codec_state_cache_misses": float(self.misses),
        }
