"""Slot bookkeeping for the static caches (no torch).

The talker KV cache is a static tensor [layers, slots, kv_heads, max_len, head_dim]; a stream owns
one slot (a row of max_len positions) while a segment is synthesised. The number of slots comes
from a memory budget. Code2Wav state rows use the same pool class without the byte accounting.
"""

from __future__ import annotations

from dataclasses import dataclass


def talker_kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one position occupies in the talker cache (keys and values, every layer)."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


class SlotPool:
    """Fixed set of rows handed out lowest index first (keeps live rows packed for small batches)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() yields the lowest
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def owner(self, slot: int) -> str | None:
        return self._owner.get(slot)

    def allocate(self, owner: str) -> int | None:
        """A free slot for `owner`, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._owner:
            raise ValueError(f"slot {slot} is not allocated")
        del self._owner[slot]
        self._free.append(slot)
        self._free.sort(reverse=True)


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_slots: int  # streams that can hold talker state at once
    max_len: int  # positions per slot (prompt + frames of one segment)
    bytes_per_token: int

    @property
    def bytes_per_stream(self) -> int:
        return self.max_len * self.bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_stream

    @classmethod
    def from_budget(
        cls, budget_bytes: int, bytes_per_token: int, max_len: int, max_slots: int | None = None
    ) -> KVCacheLayout:
        """As many max_len slots as the budget holds (capped at max_slots)."""
        if bytes_per_token <= 0 or max_len <= 0:
            raise ValueError("bytes_per_token and max_len must be positive")
        slots = budget_bytes // (bytes_per_token * max_len)
        if max_slots is not None:
            slots = min(slots, max_slots)
        if slots < 1:
            need = bytes_per_token * max_len
            raise ValueError(
                f"KV budget {budget_bytes} B is below one stream ({need} B at max_len {max_len})"
            )
        return cls(num_slots=int(slots), max_len=max_len, bytes_per_token=bytes_per_token)


class KVCacheManager:
    """Talker slots plus the number of positions each one holds."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.pool = SlotPool(layout.num_slots)
        self._lengths: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def allocate(self, owner: str) -> int | None:
        slot = self.pool.allocate(owner)
        if slot is not None:
            self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.pool.free(slot)
        del self._lengths[slot]

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.layout.max_len:
            raise ValueError(f"length {length} outside [0, {self.layout.max_len}]")
        self._lengths[slot] = length

    def room(self, slot: int) -> int:
        """Positions still free in the slot."""
        return self.layout.max_len - self._lengths[slot]

    @property
    def tokens_in_use(self) -> int:
        return sum(self._lengths.values())

    def stats(self) -> dict[str, float]:
        lay = self.layout
        used = self.pool.num_used
        return {
            "kv_slots": float(lay.num_slots),
            "kv_slots_used": float(used),
            "kv_bytes_per_stream": float(lay.bytes_per_stream),
            "kv_bytes_total": float(lay.total_bytes),
            "kv_bytes_per_token": float(lay.bytes_per_token),
            "kv_tokens_in_use": float(self.tokens_in_use),
            "kv_utilisation": self.tokens_in_use / max(1, lay.num_slots * lay.max_len),
        }
