"""The bounded sampler's draw as one Triton kernel per call (CUDA).

In torch the draw over a row's 64 best candidates (temperature, top-k, top-p, the counter-based
Gumbel noise, the argmax) is some 160 small kernels; the code predictor's frame runs it 16 times, so
at small batches those launches, not the arithmetic, set the predictor's time. Here one program per
row does it all on the candidates `torch.topk` returned. The noise is the same hash as
engine.qwen3.models.sampler's (32-bit integer arithmetic, exact); logarithms and divisions use the correctly
rounded libdevice functions, so draws match the torch path except where top-p's cumulative sum
rounds differently at its boundary. This module imports nothing of the sampler: the sampler
compares the two on the device before first use (`engine.qwen3.models.sampler.draw_kernel`) and keeps
the torch path if the kernel fails to build or disagrees.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs
    triton = None

BUILT = triton is not None  # the kernel exists here (Triton imported)


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = x * tl.full([], 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full([], 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _draw_kernel(
        values_ptr,
        index_ptr,
        temperature_ptr,
        top_k_ptr,
        top_p_ptr,
        seed_ptr,
        counter_ptr,
        out_ptr,
        K: tl.constexpr,
    ):
        row = tl.program_id(0)
        rank = tl.arange(0, K)
        temperature = tl.load(temperature_ptr + row)
        v = libdevice.div_rn(tl.load(values_ptr + row * K + rank), temperature)  # descending
        index = tl.load(index_ptr + row * K + rank)
        # top-k: keep what is at least the k-th largest value
        k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), K)
        kth = tl.sum(tl.where(rank == k - 1, v, 0.0))
        keep = v >= kth
        # top-p over what top-k kept: drop the tail whose mass (from the least likely up) <= 1 - p
        best = tl.max(v)
        e = tl.where(keep, tl.exp(v - best), 0.0)
        p = e / tl.sum(e)
        tail = tl.cumsum(p, 0, reverse=True)  # mass of this rank and all less likely ones
        top_p = tl.load(top_p_ptr + row)
        keep = keep & ((tail > 1.0 - top_p) | (rank == 0))
        # Gumbel noise of (seed, counter, vocabulary index), as engine.qwen3.models.sampler.uniform_noise_at
        seed = tl.load(seed_ptr + row)
        counter = tl.load(counter_ptr + row)
        h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h ^ (counter & 0xFFFFFFFF).to(tl.uint32))
        cell = _mix32((index + 0x632BE5AB).to(tl.uint32))
        bits = _mix32(h ^ cell) >> 8
        u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        gumbel = -libdevice.log(-libdevice.log(u))
        score = tl.where(keep, v + gumbel, float("-inf"))
        choice = tl.argmax(score, 0)
        tl.store(out_ptr + row, tl.sum(tl.where(rank == choice, index, 0)))


def draw(
    values: Tensor,
    index: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seed: Tensor,
    counter: Tensor,
) -> Tensor:
    """values/index [B, K] (torch.topk of the raw scores, descending; K a power of two) -> ids [B]."""
    b, k = values.shape
    out = torch.empty(b, dtype=torch.long, device=values.device)
    _draw_kernel[(b,)](
        values.float().contiguous(),
        index.contiguous(),
        temperature.float().contiguous(),
        top_k.contiguous(),
        top_p.float().contiguous(),
        seed.contiguous(),
        counter.contiguous(),
        out,
        K=k,
    )
    return out
