"""Code2Wav's convolutions as one Triton implicit-GEMM kernel on CUDA, with the ops after each conv
(its bias, a SnakeBeta, the residual add) done in the kernel's epilogue.

cuDNN picks fast kernels for these channels-last, height-1 convolutions only when it autotunes each
input shape, and every graph bucket is a new shape: tuning them all makes start-up minutes long,
while its untuned picks are many times slower at the large buckets. This kernel's tiles follow the
layer's shape from a table measured once (`tiling`), so start-up tunes nothing, and its epilogue
saves a pass over the activations per fused op.

The convolution is causal over x [B, T, C_in] (channels last, contiguous) behind `context` rows of
left context: a stream slot's history read from its pool (`past`, [slots, context, C_in]) or,
offline, silence. Over the joined input u = [context | x], output row t of batch b is
sum_j u[b, t + j * dilation] @ W_j, t < T_out = context + T - (taps - 1) * dilation, accumulated
in fp32. Reading the context in place spares a copy of every layer's input; the caller refreshes
the pool afterwards. A transposed convolution whose kernel is a whole number m of strides r is the
same kernel over m taps with r * C_out output channels: output column p * C_out + n of input s is
sample s * r + p of channel n (`pack_transposed`).

`guard` switches the kernel off on a device where it differs from torch's convolution; the codec
then runs cuDNN, autotuned (runner).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.qwen3.models.kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


if triton is not None:
    # rows, lengths, taps and dilation change with every bucket and layer: not specialised on, so
    # each layer shape compiles once whatever the batch
    @triton.jit(do_not_specialize=["rows", "t_out", "t_x", "taps", "dilation", "context"])
    def _conv_kernel(
        x_ptr,
        past_ptr,
        slots_ptr,
        w_ptr,
        bias_ptr,
        alpha_ptr,
        inv_beta_ptr,
        res_ptr,
        out_ptr,
        rows,
        t_out,
        t_x,
        c_in,
        c_out,
        taps,
        dilation,
        context,
        chunks,
        HAS_PAST: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SNAKE: tl.constexpr,
        RESIDUAL: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < rows
        n_ok = rn < c_out
        batch = rm // t_out
        t = rm % t_out  # the output row's first tap reads joined row t
        # that row's place in x (before the batch's first row of x: the context)
        x_first = batch.to(tl.int64) * t_x + t - context
        if HAS_PAST:
            past_first = tl.load(slots_ptr + batch, mask=m_ok, other=0).to(tl.int64) * context + t
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # one loop over every (tap, channel chunk): a layer of few channels still has enough
        # iterations for the loads to be pipelined
        for i in range(0, taps * chunks):
            j = i // chunks
            ck = (i - j * chunks) * BLOCK_K + rk
            k_ok = ck < c_in
            in_x = t + j * dilation >= context
            x_rows = x_ptr + (x_first + j * dilation)[:, None] * c_in + ck[None, :]
            if HAS_PAST:  # the rows before x come from the slot's history: one load either way, so
                # it still feeds the dot directly and stays in the pipelined loop
                past_rows = past_ptr + (past_first + j * dilation)[:, None] * c_in + ck[None, :]
                a = tl.load(
                    tl.where(in_x[:, None], x_rows, past_rows),
                    mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
            else:  # offline, silence before x
                a = tl.load(x_rows, mask=(m_ok & in_x)[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(
                w_ptr + (j * c_in + ck[:, None]).to(tl.int64) * c_out + rn[None, :],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SNAKE:  # x + sin^2(x * e^alpha) / e^beta, alpha and 1 / e^beta given per channel in fp32
            alpha = tl.load(alpha_ptr + rn, mask=n_ok, other=0.0)
            inv_beta = tl.load(inv_beta_ptr + rn, mask=n_ok, other=0.0)
            s = tl.sin(acc * alpha[None, :])
            acc = acc + inv_beta[None, :] * s * s
        offs = rm.to(tl.int64)[:, None] * c_out + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if RESIDUAL:
            acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


MAX_ROWS = 2**31 - 1  # 32-bit row indices in the kernel


def available(x: Tensor) -> bool:
    return (
        triton is not None
        and x.is_cuda
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.shape[0] * x.shape[1] <= MAX_ROWS
        and guard.ready(x.device)
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class Tiles(NamedTuple):
    block_m: int  # output rows per program
    block_n: int  # output channels per program
    block_k: int  # input channels per step of the loop
    warps: int
    stages: int  # software-pipelining depth of the loop's loads


# Code2Wav's layers at the real checkpoint's shapes, (C_in, C_out, taps) -> the tiles that time
# fastest for them at the engine's steady buckets of 32-64 rows x 4 frames on an H200
# (bench/gpu_conv_tiles.py): the narrow layers take output tiles that divide their channels, the
# wide ones fewer rows per program
_MEASURED = {
    (96, 96, 7): Tiles(128, 32, 32, 4, 3),
    (192, 192, 7): Tiles(128, 64, 64, 8, 3),
    (384, 384, 7): Tiles(64, 128, 64, 4, 3),
    (768, 768, 7): Tiles(64, 128, 64, 4, 3),
    (96, 96, 1): Tiles(128, 128, 32, 4, 3),
    (192, 192, 1): Tiles(64, 128, 64, 4, 3),
    (384, 384, 1): Tiles(64, 128, 64, 4, 3),
    (768, 768, 1): Tiles(64, 128, 64, 4, 3),
    (768, 1920, 2): Tiles(128, 128, 64, 4, 3),
}
# a layer whose grid has fewer programs than this leaves most of the GPU's SMs idle: it takes the
# small tiles instead, which spread it over more of them
_FEW_PROGRAMS = 64


def _block_k(c_in: int) -> int:
    return 64 if c_in % 64 == 0 else 32 if c_in % 32 == 0 else 16


def tiling(rows: int, c_in: int, c_out: int, taps: int) -> Tiles:
    """A layer's tiles for `rows` output rows: the measured ones for Code2Wav's shapes, otherwise
    128-row tiles with output channels 128 at a time (fewer, down to tl.dot's 16, for narrow layers);
    small tiles when either would give too few programs (a layer of 32 outputs or fewer keeps its
    own, which are no wider)."""
    block_n = 128 if c_out >= 128 else max(16, _next_pow2(c_out))
    tiles = _MEASURED.get(
        (c_in, c_out, taps), Tiles(128, block_n, _block_k(c_in), 8 if block_n == 128 else 4, 3)
    )
    programs = -(-rows // tiles.block_m) * -(-c_out // tiles.block_n)
    if programs < _FEW_PROGRAMS and c_out > 32:
        return Tiles(64, 32, _block_k(c_in), 4, 3)
    return tiles


def conv(
    x: Tensor,
    weight: Tensor,
    taps: int,
    dilation: int = 1,
    bias: Tensor | None = None,
    snake: tuple[Tensor, Tensor] | None = None,
    residual: Tensor | None = None,
    context: int = 0,
    past: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """x [B, T, C_in] -> [B, T_out, C_out]; weight [taps * C_in, C_out] (`pack`); bias [C_out];
    snake: (alpha, 1 / beta) [C_out] in fp32, applied after the bias; residual [B, T_out, C_out],
    added last. context: rows of left context before x, from past = (pool [slots, context, C_in],
    slots [B]) or silence without it."""
    x = x.contiguous()
    b, t_x, c_in = x.shape
    c_out = weight.shape[1]
    assert weight.shape[0] == taps * c_in, "weight not packed for these taps and channels"
    t_out = context + t_x - (taps - 1) * dilation
    out = torch.empty(b, t_out, c_out, device=x.device, dtype=x.dtype)
    rows = b * t_out
    if rows == 0:
        return out
    if past is not None:
        pool, slots = past
        assert pool.shape[1:] == (context, c_in) and pool.is_contiguous(), "history pool mismatch"
        assert slots.shape == (b,), "one slot per batch row"
    tiles = tiling(rows, c_in, c_out, taps)
    alpha, inv_beta = snake if snake is not None else (x, x)
    if residual is not None:
        residual = residual.contiguous()
        assert residual.shape == out.shape, "residual must match the output"
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(c_out, tiles.block_n))
    _conv_kernel[grid](
        x,
        past[0] if past is not None else x,
        past[1] if past is not None else x,
        weight,
        bias if bias is not None else x,
        alpha,
        inv_beta,
        residual if residual is not None else x,
        out,
        rows,
        t_out,
        t_x,
        c_in,
        c_out,
        taps,
        dilation,
        context,
        triton.cdiv(c_in, tiles.block_k),
        HAS_PAST=past is not None and context > 0,
        HAS_BIAS=bias is not None,
        SNAKE=snake is not None,
        RESIDUAL=residual is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out


def pack(weight: Tensor) -> Tensor:
    """A Conv1d weight [C_out, C_in, taps] -> [taps * C_in, C_out] (row j * C_in + c: tap j, channel c)."""
    c_out, c_in, taps = weight.shape
    return weight.permute(2, 1, 0).reshape(taps * c_in, c_out).contiguous()


def pack_transposed(weight: Tensor, stride: int) -> Tensor:
    """A ConvTranspose1d weight [C_in, C_out, m * stride] -> [m * C_in, stride * C_out]: tap j reads
    input s - (m - 1) + j, whose kernel positions p + (m - 1 - j) * stride feed sample s * stride + p."""
    c_in, c_out, kernel = weight.shape
    m = kernel // stride
    assert m * stride == kernel, "the kernel must be a whole number of strides"
    by_position = weight.permute(0, 2, 1)  # [C_in, kernel, C_out]
    parts = [
        by_position[:, (m - 1 - j) * stride : (m - j) * stride].reshape(c_in, stride * c_out)
        for j in range(m)
    ]
    return torch.cat(parts).contiguous()


class Packed:
    """A layer's packed weight and bias, built again only when the weights change (a loaded
    checkpoint replaces them), so a decode step launches no kernels for them."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._value: tuple[Tensor, Tensor | None] | None = None

    def get(
        self, weight: Tensor, bias: Tensor | None, stride: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, stride)
        key += (None,) if bias is None else (bias.data_ptr(), bias._version)
        if self._value is None or self._key != key:
            with torch.no_grad():
                if stride is None:
                    w, b = pack(weight), bias
                else:
                    w = pack_transposed(weight, stride)
                    b = None if bias is None else bias.repeat(stride)
                self._value = (w, None if b is None else b.contiguous())
                self._key = key
        return self._value


def _compare(device: torch.device) -> None:
    gen = torch.Generator(device="cpu").manual_seed(5)
    # [batch, input rows, C_in, C_out, taps, dilation]: a dilated conv, a narrow output, a 1x1 conv
    for b, t_in, c_in, c_out, taps, dilation in (
        (3, 70, 96, 96, 7, 9),
        (2, 33, 96, 1, 7, 1),
        (4, 9, 192, 192, 1, 1),
    ):
        x = torch.randn(b, t_in, c_in, generator=gen)
        w = torch.randn(c_out, c_in, taps, generator=gen) / (c_in * taps) ** 0.5
        bias = torch.randn(c_out, generator=gen)
        expected = F.conv1d(x.transpose(1, 2), w, bias, dilation=dilation).transpose(1, 2)
        xd, wd, bd = (t.to(device, torch.bfloat16) for t in (x, w, bias))
        got = conv(xd, pack(wd), taps, dilation, bd).float().cpu()
        if not torch.allclose(got, expected, rtol=3e-2, atol=3e-2):
            raise ValueError(f"differs from torch's conv1d by {(got - expected).abs().max().item():.3g}")
    # the context read in place from a history pool
    pool, x = torch.randn(3, 12, 32, generator=gen), torch.randn(2, 5, 32, generator=gen)
    w, slots = torch.randn(16, 32, 7, generator=gen) / 15, torch.tensor([2, 0])
    expected = F.conv1d(torch.cat([pool[slots], x], dim=1).transpose(1, 2), w, dilation=2).transpose(1, 2)
    pd, xd, wd = (t.to(device, torch.bfloat16) for t in (pool, x, w))
    got = conv(xd, pack(wd), 7, 2, context=12, past=(pd, slots.to(device))).float().cpu()
    if not torch.allclose(got, expected, rtol=3e-2, atol=3e-2):
        raise ValueError(
            f"the in-place context differs from torch's conv1d by {(got - expected).abs().max().item():.3g}"
        )
    x = torch.randn(2, 11, 64, generator=gen)
    w = torch.randn(64, 32, 8, generator=gen) / 16
    expected = F.conv_transpose1d(x.transpose(1, 2), w, stride=4).transpose(1, 2)[:, 4 : 4 + 40]
    got = conv(x.to(device, torch.bfloat16), pack_transposed(w.to(device, torch.bfloat16), 4), 2)
    got = got.float().cpu().reshape(2, 40, 32)
    if not torch.allclose(got, expected, rtol=3e-2, atol=3e-2):
        raise ValueError(
            f"differs from torch's conv_transpose1d by {(got - expected).abs().max().item():.3g}"
        )


guard = KernelGuard("fused Code2Wav convolution", _compare, built=triton is not None)
check = guard.check
