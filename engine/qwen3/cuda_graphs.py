"""Bucketed CUDA graphs over static buffers: capture the largest bucket first into one memory
pool, pad a batch up to the next bucket, replay, slice. Eager fallback when a key has no graph."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable

import torch


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, 16 to 256, 32 beyond (padding waste stays small)."""
    out = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        out.append(b)
        b += 8 if b < 64 else 16 if b < 256 else 32
    out.append(max_batch)
    return sorted(set(out))


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class GraphBank:
    """CUDA graphs keyed by bucket; `run(key, fn)` replays the graph or calls fn eagerly.

    fn takes no arguments: it reads the caller's static input buffers and writes static outputs."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: object = None
        # each bank captures on its own stream: cuBLAS keeps a workspace per stream and a graph
        # bakes in the capturing stream's, so two banks replayed at the same time on two streams
        # must not have been captured on one (their split-K kernels would share scratch memory)
        self._capture_stream = torch.cuda.Stream(device) if self.enabled else None

    def capture(self, key: Hashable, fn: Callable[[], object], warmup: int = 1) -> None:
        if not self.enabled:
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
            fn()
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[key] = graph

    def run(self, key: Hashable, fn: Callable[[], object]) -> None:
        graph = self.graphs.get(key)
        if graph is None:
            fn()
        else:
            graph.replay()

    def __len__(self) -> int:
        return len(self.graphs)
