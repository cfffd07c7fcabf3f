"""The aligner's slot times made non-decreasing, as the reference does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def repair_monotonic(values: Sequence[float]) -> list[int]:
    """Make slot times non-decreasing as the reference does.

    The longest non-decreasing subsequence (earliest-ending choice on ties) is trusted; runs of at
    most two other values snap to the nearer trusted neighbour (left on a tie), longer runs are
    interpolated linearly between their trusted neighbours. Results are truncated to integers.
    """
    return repair_monotonic_rows([values])[0]


def repair_monotonic_rows(rows: Sequence[Sequence[float]]) -> list[list[int]]:
    """``repair_monotonic`` of every row; the subsequence search runs over all rows at once."""
    count = max((len(row) for row in rows), default=0)
    data = np.zeros((len(rows), count), dtype=np.float64)
    for index, row in enumerate(rows):
        data[index, : len(row)] = row
    # best[r, i]: length of the longest non-decreasing run ending at i; parent: the element before.
    # Padding sits after each row's values, so it never feeds a real element.
    best = np.ones_like(data, dtype=np.int64)
    parent = np.full_like(best, -1)
    every = np.arange(len(rows))
    for i in range(1, count):
        candidates = np.where(data[:, :i] <= data[:, i : i + 1], best[:, :i], 0)
        j = candidates.argmax(axis=1)
        top = candidates[every, j]
        grows = top + 1 > 1
        best[grows, i] = top[grows] + 1
        parent[grows, i] = j[grows]
    repaired: list[list[int]] = []
    for index, row in enumerate(rows):
        size = len(row)
        if size == 0:
            repaired.append([])
            continue
        values = data[index, :size]
        if bool(np.all(values[1:] >= values[:-1])):
            repaired.append([int(value) for value in values.tolist()])
            continue
        trusted = np.zeros(size, dtype=bool)
        node = int(np.argmax(best[index, :size]))
        while node != -1:
            trusted[node] = True
            node = int(parent[index, node])
        repaired.append(_fill_untrusted(values.tolist(), trusted.tolist()))
    return repaired


def _fill_untrusted(result: list[Any], trusted: list[bool]) -> list[int]:
    count = len(result)
    i = 0
    while i < count:
        if trusted[i]:
            i += 1
            continue
        j = i
        while j < count and not trusted[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if trusted[k]), None)
        right = next((result[k] for k in range(j, count) if trusted[k]), None)
        for k in range(i, j):
            if j - i <= 2:
                if left is None or (right is not None and (k - (i - 1)) > (j - k)):
                    result[k] = right
                else:
                    result[k] = left
            elif left is not None and right is not None:
                result[k] = left + (right - left) / (j - i + 1) * (k - i + 1)
            else:
                result[k] = left if left is not None else right
        i = j
    return [int(value) for value in result]
