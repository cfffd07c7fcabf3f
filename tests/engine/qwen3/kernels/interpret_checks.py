"""The project's Triton kernels run on the CPU by Triton's interpreter (TRITON_INTERPRET=1) and
compared with the eager computation each one stands in for, so that CI without a GPU runs them.

A script, not a test module: the interpreter is chosen when triton is first imported, and a pytest
process has imported triton long before, so tests/engine/qwen3/kernels/test_interpret.py runs this file once per
session in a child process (one pytest test per check). By hand:

    .venv/bin/python tests/engine/qwen3/kernels/interpret_checks.py [NAME ...]

prints one JSON line per check, {"name", "ok", "detail", "seconds", "xfail"}, and exits 1 when a
check that is not an expected failure failed.

Adding a check for a new kernel: write one function here decorated with `@check`. It takes no
arguments, runs the kernel on small CPU tensors (through its public wrapper when that accepts CPU
tensors, else the @triton.jit kernel itself), compares with the eager reference the module or its
tests/engine/qwen3/gpu test uses, raises (assert) on a mismatch and returns a short detail (sizes, largest
difference). test_interpret.py reads the names from this file (it does not import it), so the
function is a test from then on. Keep shapes small: the interpreter runs every program instance in
numpy, and the whole script should take seconds. A kernel that cannot run under the interpreter is
declared `@check(xfail="why")`: a strict xfail, so the test fails once the kernel does run.

The interpreter and low-precision floats (triton 3.5): it stores bfloat16 and float8 as their raw
uint16 / uint8 bit patterns, so arithmetic, comparisons and tl.dot on bf16 operate on the bit
patterns, and its fp32 -> bf16 / fp8 casts truncate (or round half up) where the GPU rounds to
nearest even (upstream: triton-lang/triton#11584 and #10945, "we just don't support it yet").
`Shim` below makes those few builder operations (casts, binary ops, fma, dot) compute on
the values: in fp32, rounded back through torch's round-to-nearest-even conversions, as the GPU
does. The `interpreter_shim` check tests the shim itself against torch and reports whether the stock
interpreter would have agreed (if it ever does, the shim can go). Not shimmed: reductions and scans
over bf16 / fp8 tensors (tl.sum, tl.cumsum; the kernels here reduce in fp32); a new kernel that needs
them will most likely fail its check (the references are torch's), not pass it.
The shim also makes a loaded scalar usable as a loop bound (`range(0, length, ...)`): the stock
interpreter converts its one-element array with int(), which numpy 2 refuses.
libdevice functions are not interpreted at all (each returns None): the sampling checks stand in
tl.math.div_rn and tl.log for libdevice.div_rn and libdevice.log.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, here or by an engine module

import contextlib  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kernel_references import decode_attention_reference  # noqa: E402

# -- the registry ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], str]
    xfail: str | None = None


CHECKS: dict[str, Check] = {}


def check(fn: Callable[[], str] | None = None, *, xfail: str | None = None) -> Any:
    """Register a check: `@check`, or `@check(xfail="why it cannot run under the interpreter")`."""

    def register(f: Callable[[], str]) -> Callable[[], str]:
        if f.__name__ in CHECKS:
            raise ValueError(f"two checks named {f.__name__}")
        CHECKS[f.__name__] = Check(f.__name__, f, xfail)
        return f

    return register(fn) if fn is not None else register


def close(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, case: str) -> float:
    """assert_close in float64, naming the case; returns the largest absolute difference."""
    got, expected = got.double(), expected.double()
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{case}: {m}")
    return float((got - expected).abs().max()) if got.numel() else 0.0


# -- bf16 / fp8 in the interpreter ---------------------------------------------------------------------

_LOW: dict[Any, torch.dtype] = {
    tl.bfloat16: torch.bfloat16,
    tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e5: torch.float8_e5m2,
}


def _values(data: Any, tt: Any) -> torch.Tensor:
    """The interpreter's storage of a tensor of triton type `tt` as a torch tensor of that dtype."""
    array = np.array(data, copy=True)  # contiguous, keeps 0-d
    if array.dtype == np.bool_:  # a comparison's result (the stock builder labels it with its operands' type)
        return torch.from_numpy(array)
    if tt == tl.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if tt in _LOW:
        return torch.from_numpy(array.view(np.uint8)).view(_LOW[tt])
    return torch.from_numpy(array)


def _storage(t: torch.Tensor, tt: Any) -> np.ndarray:
    """A torch tensor as the interpreter's storage for triton type `tt` (rounding to nearest even)."""
    if tt == tl.bfloat16:
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if tt in _LOW:
        return t.to(_LOW[tt]).view(torch.uint8).numpy()
    return np.asarray(t.double().numpy() if t.dtype in _LOW.values() else t.numpy()).astype(
        interpreter._get_np_dtype(tt)
    )


class Shim:
    """Patches interpreter.InterpreterBuilder so that bf16 / fp8 values are computed on, not their bits."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    def install(self) -> None:
        if self.saved:  # installed already
            return
        builder = interpreter.InterpreterBuilder
        handle = interpreter.TensorHandle
        rtz = interpreter._ir.ROUNDING_MODE.RTZ
        saved = {
            name: builder.__dict__[name]
            for name in ("cast_impl", "create_fp_to_fp", "binary_op", "create_fma", "create_dot")
        }

        def convert(src: Any, dst_type: Any) -> Any:
            src_t, dst_t = src.dtype.scalar, dst_type.scalar
            return handle(_storage(_values(src.data, src_t), dst_t), dst_t)

        def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
            if src.dtype.scalar in _LOW or dst_type.scalar in _LOW:
                return convert(src, dst_type)
            return saved["cast_impl"](self, src, dst_type)

        def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
            if rounding_mode != rtz and (src.dtype.scalar in _LOW or dst_type.scalar in _LOW):
                return convert(src, dst_type)
            return saved["create_fp_to_fp"](self, src, dst_type, rounding_mode)

        def in_fp32(h: Any) -> np.ndarray:
            return _values(h.data, h.dtype.scalar).float().numpy() if h.dtype.scalar in _LOW else h.data

        def rounded(result: Any, tt: Any) -> Any:
            result = np.asarray(result)
            if result.dtype == np.bool_:  # comparisons
                return handle(result, tl.int1)
            return handle(_storage(torch.from_numpy(np.array(result, dtype=np.float32)), tt), tt)

        def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
            if lhs.dtype.scalar in _LOW:
                return rounded(op(in_fp32(lhs), in_fp32(rhs)), lhs.dtype.scalar)
            return saved["binary_op"](self, lhs, rhs, op)

        def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
            if z.dtype.scalar in _LOW:
                return rounded(in_fp32(x) * in_fp32(y) + in_fp32(z), z.dtype.scalar)
            return saved["create_fma"](self, x, y, z)

        def create_dot(
            self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
        ) -> Any:
            if a.dtype.scalar in _LOW or b.dtype.scalar in _LOW:  # exact products, fp32 sums
                product = np.matmul(in_fp32(a), in_fp32(b), dtype=d.data.dtype)
                return handle(product + d.data, d.dtype.scalar)
            return saved["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)

        for name, fn in (
            ("cast_impl", cast_impl),
            ("create_fp_to_fp", create_fp_to_fp),
            ("binary_op", binary_op),
            ("create_fma", create_fma),
            ("create_dot", create_dot),
        ):
            setattr(builder, name, fn)
        saved["_patch_lang_tensor"] = patch_tensor = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor: Any) -> None:
            # a loaded scalar (a row's length) is a one-element array; numpy 2 converts only 0-d
            # arrays with int(), so `range(0, length, ...)` failed under the stock interpreter
            patch_tensor(tensor)
            tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

        interpreter._patch_lang_tensor = patch_lang_tensor
        self.saved = saved

    def uninstall(self) -> None:
        for name, fn in self.saved.items():
            if name == "_patch_lang_tensor":
                interpreter._patch_lang_tensor = fn
            else:
                setattr(interpreter.InterpreterBuilder, name, fn)
        self.saved = {}

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.uninstall()
        try:
            yield
        finally:
            self.install()


SHIM = Shim()


@triton.jit  # type: ignore[untyped-decorator]
def _shim_probe_kernel(
    a_ptr,
    b_ptr,
    f_ptr,
    sum_ptr,
    prod_ptr,
    less_ptr,
    max_ptr,
    fma_ptr,
    bf16_ptr,  # type: ignore[no-untyped-def]
    fp8_ptr,
    dot_ptr,
    N: tl.constexpr,
):
    i = tl.arange(0, N)
    tile = i[:, None] * N + i[None, :]
    a = tl.load(a_ptr + tile)  # bf16 [N, N]
    b = tl.load(b_ptr + tile)
    tl.store(sum_ptr + tile, a + b)
    tl.store(prod_ptr + tile, a * b)
    tl.store(less_ptr + tile, (a < b).to(tl.int8))
    tl.store(max_ptr + tile, tl.maximum(a, b))
    tl.store(fma_ptr + tile, tl.fma(a, b, a))
    f = tl.load(f_ptr + tile)  # fp32
    tl.store(bf16_ptr + tile, f.to(tl.bfloat16))
    tl.store(fp8_ptr + tile, tl.minimum(tl.maximum(f, -448.0), 448.0).to(tl.float8e4nv))
    tl.store(dot_ptr + tile, tl.dot(a, b))


def _probe() -> dict[str, bool]:
    """Each shimmed operation in a kernel against torch on the CPU: {operation: agrees}."""
    n = 16
    gen = torch.Generator().manual_seed(11)
    a = (torch.randn(n, n, generator=gen) * 4).bfloat16()
    b = (torch.randn(n, n, generator=gen) * 4).bfloat16()
    b[0, :4] = -a[0, :4]  # sums of exactly zero, and a tie for `<`
    b[1, :4] = a[1, :4]
    f = torch.randn(n, n, generator=gen) * 100
    # halfway between two bf16 values: nearest even rounds down, then up (truncation: down both times)
    f[0, :2] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8])
    out = {
        name: torch.empty(n, n, dtype=dtype)
        for name, dtype in (
            ("sum", torch.bfloat16),
            ("prod", torch.bfloat16),
            ("less", torch.int8),
            ("max", torch.bfloat16),
            ("fma", torch.bfloat16),
            ("bf16", torch.bfloat16),
            ("fp8", torch.float8_e4m3fn),
            ("dot", torch.float32),
        )
    }
    _shim_probe_kernel[(1,)](a, b, f, *out.values(), N=n)
    expected = {
        "sum": a + b,
        "prod": a * b,
        "less": (a < b).to(torch.int8),
        "max": torch.maximum(a, b),
        "fma": torch.addcmul(a.float(), a.float(), b.float()).bfloat16(),  # exact product, fp32 sum
        "bf16": f.bfloat16(),
        "fp8": f.clamp(-448, 448).to(torch.float8_e4m3fn),
    }
    agrees = {
        name: torch.equal(out[name].view(torch.uint8), want.view(torch.uint8))
        for name, want in expected.items()
    }
    agrees["dot"] = torch.allclose(out["dot"], a.float() @ b.float(), rtol=1e-5, atol=1e-4)
    return agrees


@check
def interpreter_shim() -> str:
    """The shim's bf16 / fp8 operations equal torch's bit for bit (tl.dot: to fp32 rounding)."""
    agrees = _probe()
    wrong = [name for name, ok in agrees.items() if not ok]
    assert not wrong, f"the shimmed interpreter differs from torch in: {', '.join(wrong)}"
    with SHIM.off():
        stock = _probe()
    stock_wrong = [name for name, ok in stock.items() if not ok]
    return (
        f"shimmed: {len(agrees)} operations agree; stock interpreter wrong in: {', '.join(stock_wrong)}"
        if stock_wrong
        else "shimmed agrees; the stock interpreter agrees too now: the shim can go"
    )


# -- RMSNorm (engine.qwen3.models.fused_norm) ---------------------------------------------------------------


@check
def rms_norm() -> str:
    """bf16 as served, within one bf16 rounding of the eager norm and almost all bit-identical (as
    tests/engine/qwen3/gpu/test_fused_norm.py); fp32 too (the same kernel without the bf16 shim's help)."""
    from engine.qwen3.models import fused_norm

    gen = torch.Generator().manual_seed(3)
    worst, same, total = 0.0, 0, 0
    # a power-of-two width; 96 and 40: BLOCK 128 / 64 with a masked tail; a single row
    for shape in ((5, 128), (2, 3, 96), (1, 40)):
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
            x = (torch.randn(shape, generator=gen) * 4).to(dtype)
            w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
            got, expected = fused_norm.rms_norm(x, w, 1e-6), fused_norm.eager_rms_norm(x, w, 1e-6)
            case = f"{tuple(shape)} {dtype}"
            assert got.dtype == dtype and got.shape == x.shape, case
            diff = close(got, expected, tol, tol, case)
            if dtype == torch.bfloat16:
                worst = max(worst, diff)
                same += int((got == expected).sum())
                total += got.numel()
    assert same / total > 0.99, f"only {same} of {total} bf16 elements bit-identical to the eager norm"
    return f"bf16: max |diff| {worst:.3g}, {same}/{total} bit-identical; fp32 within 1e-5"


# -- rotary embedding (engine.qwen3.models.fused_rope) ------------------------------------------------------


@check
def rope() -> str:
    """bf16 bit for bit equal to the eager rotation (as tests/engine/qwen3/gpu/test_fused_rope.py); fp32 close."""
    from engine.qwen3.models import fused_rope
    from engine.qwen3.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

    gen = torch.Generator().manual_seed(5)
    vectors = 0
    for b, t, heads, dim in ((2, 3, 4, 64), (1, 1, 2, 32), (3, 2, 1, 128)):
        positions = torch.randint(0, 512, (b, t), generator=gen)
        x = torch.randn(b, t, heads, dim, generator=gen)
        for dtype in (torch.bfloat16, torch.float32):
            cos, sin = rope_cos_sin(rope_inv_freq(dim, 1e6), positions, dtype)
            xd = x.to(dtype)
            got = fused_rope.rope(xd, cos, sin)
            expected = apply_rope(xd.transpose(1, 2), cos, sin).transpose(1, 2)
            case = f"[{b}, {t}, {heads}, {dim}] {dtype}"
            if dtype == torch.bfloat16:
                differ = int((got != expected).sum())
                assert differ == 0, (
                    f"{case}: {differ} of {got.numel()} elements differ from the eager rotation"
                )
            else:
                close(got, expected, 1e-6, 1e-6, case)
        vectors += b * t * heads
    return f"{vectors} vectors (head dims 32/64/128): bf16 bit-identical, fp32 within 1e-6"


# -- decode attention (engine.qwen3.models.decode_attention) ------------------------------------------------


def _decode_attention_cases(dtype: torch.dtype, tol: float) -> str:
    from engine.qwen3.models import decode_attention

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 63, 64, 65, 130])  # one position; BLOCK_N 64 -1 / exactly / +1; three blocks
    slots = torch.tensor([4, 0, 5, 2, 1])
    worst = 0.0
    # GQA groups of 2, 3 (BLOCK_G 16 masks 13 of its rows) and 1
    for heads, kv_heads, dim in ((4, 2, 32), (6, 2, 16), (2, 2, 64)):
        # the cache is a view with room past max_len: strides that are not the contiguous ones
        k_cache = torch.randn(6, kv_heads, 137, dim, generator=gen).to(dtype)[:, :, :130]
        v_cache = torch.randn(6, kv_heads, 137, dim, generator=gen).to(dtype)[:, :, :130]
        q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
        got = decode_attention.decode_attention(q, k_cache, v_cache, slots, lengths, dim**-0.5)
        assert got.dtype == dtype and got.shape == q.shape
        expected = decode_attention_reference(q, k_cache, v_cache, slots, lengths)
        worst = max(worst, close(got, expected, tol, tol, f"heads {heads}/{kv_heads}, dim {dim}, {dtype}"))
        # one length for every row (the code predictor's loop passes a Python int)
        got = decode_attention.decode_attention(q, k_cache, v_cache, slots, 17, dim**-0.5)
        expected = decode_attention_reference(q, k_cache, v_cache, slots, torch.full_like(lengths, 17))
        worst = max(
            worst, close(got, expected, tol, tol, f"one length 17, heads {heads}/{kv_heads}, {dtype}")
        )
    return (
        f"GQA 4/2, 6/2, 2/2 heads, lengths {lengths.tolist()} and one int length 17: "
        f"max |diff| {worst:.3g} (tol {tol})"
    )


@check
def decode_attention_fp32() -> str:
    return _decode_attention_cases(torch.float32, 1e-5)


@check
def decode_attention_bf16() -> str:
    return _decode_attention_cases(torch.bfloat16, 2e-2)


@check
def decode_attention_ignores_stale_positions() -> str:
    """Keys and values past a row's length (huge, NaN) leave its output unchanged."""
    from engine.qwen3.models import decode_attention

    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(2, 2, 96, 32, generator=gen).bfloat16()
    v_cache = torch.randn(2, 2, 96, 32, generator=gen).bfloat16()
    q = torch.randn(1, 4, 32, generator=gen).bfloat16()
    slots, lengths = torch.tensor([1]), torch.tensor([70])
    before = decode_attention.decode_attention(q, k_cache, v_cache, slots, lengths, 32**-0.5)
    k_cache[1, :, 70:] = 1e4
    v_cache[1, :, 70:] = float("nan")
    after = decode_attention.decode_attention(q, k_cache, v_cache, slots, lengths, 32**-0.5)
    assert not after.isnan().any(), "NaN past the length reached the output"
    assert torch.equal(before, after), "positions past the length changed the output"
    close(
        after, decode_attention_reference(q, k_cache, v_cache, slots, lengths), 2e-2, 2e-2, "length 70 of 96"
    )
    return "length 70 of 96: output unchanged by 1e4 keys / NaN values past it"


# -- SnakeBeta and the residual add (engine.qwen3.models.fused_snake) ---------------------------------------

_SNAKE_SHAPES = ((3, 41, 96), (5, 1, 7), (1, 3, 130))  # [batch, time, channels]: 12 blocks with a tail; one


def _snake_module(channels: int, gen: torch.Generator) -> Any:
    from engine.qwen3.models.codec import SnakeBeta

    act = SnakeBeta(channels)
    with torch.no_grad():
        act.alpha.normal_(0, 0.5, generator=gen)
        act.beta.normal_(0, 0.5, generator=gen)
    return act


@check
def snake() -> str:
    """The activation, with and without the folded conv bias, against the eager ops in fp64 (the
    tolerances of tests/engine/qwen3/gpu/test_fused_snake.py: fp32 1e-5, bf16 3e-2)."""
    from engine.qwen3.models import fused_snake

    gen = torch.Generator().manual_seed(0)
    worst: dict[torch.dtype, float] = {}
    for shape in _SNAKE_SHAPES:
        act = _snake_module(shape[-1], gen)
        x, bias = torch.randn(*shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            with torch.no_grad():
                _, _, alpha32, inv_beta32 = copy.deepcopy(act).to(dtype)._params()
                for b in (None, bias.to(dtype)):
                    xd = x.to(dtype)
                    got = fused_snake.snake(xd, alpha32, inv_beta32, b)
                    assert got.dtype == dtype and got.shape == x.shape
                    # the kernel rounds x + bias to the tensor's dtype, as the eager add would
                    expected = act((xd if b is None else xd + b).double())
                    case = f"{shape} {dtype} {'with' if b is not None else 'without'} bias"
                    diff = close(got, expected, tol * 3, tol, case)
                    worst[dtype] = max(worst.get(dtype, 0.0), diff)
    fp32, bf16 = worst[torch.float32], worst[torch.bfloat16]
    return f"shapes {list(_SNAKE_SHAPES)}: max |diff| fp32 {fp32:.3g}, bf16 {bf16:.3g}"


@check
def snake_residual() -> str:
    """x + (y + bias) in one pass, for a contiguous and a sliced (non-contiguous) x."""
    from engine.qwen3.models import fused_snake

    gen = torch.Generator().manual_seed(1)
    worst: dict[torch.dtype, float] = {}
    for shape in _SNAKE_SHAPES:
        channels = shape[-1]
        x, y = torch.randn(*shape, generator=gen) * 3, torch.randn(*shape, generator=gen)
        bias = torch.randn(channels, generator=gen)
        wide = torch.randn(*shape[:-1], channels + 30, generator=gen)[..., 20 : 20 + channels]
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 3e-2)):
            for first in (x, wide):
                got = fused_snake.residual(first.to(dtype), y.to(dtype), bias.to(dtype))
                assert got.dtype == dtype and got.shape == first.shape
                case = f"{shape} {dtype} {'contiguous' if first.is_contiguous() else 'sliced'}"
                diff = close(got, first + (y + bias), tol * 3, tol, case)
                worst[dtype] = max(worst.get(dtype, 0.0), diff)
    fp32, bf16 = worst[torch.float32], worst[torch.bfloat16]
    return f"shapes {list(_SNAKE_SHAPES)}: max |diff| fp32 {fp32:.3g}, bf16 {bf16:.3g}"


# -- Code2Wav's convolutions (engine.qwen3.models.fused_conv) --------------------------------------------

# [batch, input rows, C_in, C_out, taps, dilation]: dilated with tails in every tile dimension, a
# one-channel output, a 1x1 conv, inputs narrower than a K tile
_CONV_SHAPES = ((2, 70, 48, 40, 7, 9), (3, 20, 32, 1, 7, 1), (2, 9, 64, 130, 1, 1), (1, 12, 4, 8, 3, 2))


@check
def fused_conv() -> str:
    """The conv with its bias, then SnakeBeta, then a residual add, against torch's conv1d and the
    eager activation (fp32 exact to rounding, bf16 within its rounding of the inputs)."""
    from engine.qwen3.models import fused_conv as fc

    gen = torch.Generator().manual_seed(2)
    worst: dict[torch.dtype, float] = {}
    for b, t_in, c_in, c_out, taps, dilation in _CONV_SHAPES:
        x = torch.randn(b, t_in, c_in, generator=gen)
        w = torch.randn(c_out, c_in, taps, generator=gen) / (c_in * taps) ** 0.5
        bias = torch.randn(c_out, generator=gen)
        act = _snake_module(c_out, gen)
        t_out = t_in - (taps - 1) * dilation
        res = torch.randn(b, t_out, c_out, generator=gen)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            xd, wd, bd, rd = (t.to(dtype) for t in (x, w, bias, res))
            conv = torch.nn.functional.conv1d(
                xd.double().transpose(1, 2), wd.double(), bd.double(), dilation=dilation
            )
            conv = conv.transpose(1, 2)
            with torch.no_grad():
                _, _, alpha32, inv_beta32 = copy.deepcopy(act).to(dtype)._params()
                expected = act.double()(conv) + rd.double()
            got = fc.conv(xd, fc.pack(wd), taps, dilation, bd, snake=(alpha32, inv_beta32), residual=rd)
            assert got.dtype == dtype and got.shape == (b, t_out, c_out)
            diff = close(got, expected, tol * 3, tol, f"{(b, t_in, c_in, c_out, taps, dilation)} {dtype}")
            plain = fc.conv(xd, fc.pack(wd), taps, dilation)
            diff = max(diff, close(plain, conv - bd.double(), tol * 3, tol, f"plain {dtype}"))
            worst[dtype] = max(worst.get(dtype, 0.0), diff)
    return f"shapes {list(_CONV_SHAPES)}: max |diff| fp32 {worst[torch.float32]:.3g}, bf16 {worst[torch.bfloat16]:.3g}"


@check
def fused_conv_context() -> str:
    """The conv reading its left context in place, from a slot's history pool (or silence), against
    torch's conv1d over the joined input."""
    from engine.qwen3.models import fused_conv as fc

    gen = torch.Generator().manual_seed(4)
    worst = 0.0
    # [batch, new rows, C_in, C_out, taps, dilation]: new rows fewer than the context, and more;
    # the last spans several tiles per batch row: tiles wholly past the context, tiles over it and
    # a tile across two batch rows
    for b, t, c_in, c_out, taps, dilation in (
        (2, 5, 24, 40, 7, 3),
        (3, 30, 16, 16, 3, 2),
        (2, 4, 32, 8, 2, 1),
        (2, 300, 32, 48, 7, 3),
    ):
        context = (taps - 1) * dilation
        pool = torch.randn(5, context, c_in, generator=gen)
        slots = torch.tensor([3, 0, 4][:b])
        x = torch.randn(b, t, c_in, generator=gen)
        w = torch.randn(c_out, c_in, taps, generator=gen) / (c_in * taps) ** 0.5
        bias = torch.randn(c_out, generator=gen)
        res = torch.randn(b, t, c_out, generator=gen)
        for past, front in ((pool, pool[slots]), (None, torch.zeros(b, context, c_in))):
            joined = torch.cat([front, x], dim=1).double().transpose(1, 2)
            conv = torch.nn.functional.conv1d(joined, w.double(), bias.double(), dilation=dilation)
            expected = conv.transpose(1, 2) + res.double()
            got = fc.conv(
                x,
                fc.pack(w),
                taps,
                dilation,
                bias,
                residual=res,
                context=context,
                past=None if past is None else (past, slots),
            )
            case = f"{(b, t, c_in, c_out, taps, dilation)} past={past is not None}"
            worst = max(worst, close(got, expected, 1e-4, 1e-4, case))
    return f"max |diff| {worst:.3g}"


@check
def fused_transposed_conv() -> str:
    """A transposed conv of kernel m x stride as the conv kernel over m taps (pack_transposed),
    against torch's conv_transpose1d trimmed as the decoder trims it."""
    from engine.qwen3.models import fused_conv as fc

    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for b, frames, c_in, c_out, stride, m in (
        (2, 7, 32, 24, 4, 2),
        (1, 5, 16, 16, 2, 1),
        (3, 4, 48, 8, 3, 2),
    ):
        x = torch.randn(b, frames, c_in, generator=gen)
        w = torch.randn(c_in, c_out, m * stride, generator=gen) / c_in**0.5
        bias = torch.randn(c_out, generator=gen)
        full = torch.nn.functional.conv_transpose1d(x.transpose(1, 2), w, bias, stride=stride).transpose(1, 2)
        expected = full[:, (m - 1) * stride : frames * stride]  # outputs of frames 1.. (frame 0 is history)
        packed, bias_r = fc.pack_transposed(w, stride), bias.repeat(stride)
        got = fc.conv(x, packed, m, 1, bias_r).reshape(b, -1, c_out)
        worst = max(worst, close(got, expected, 1e-5, 1e-5, f"{(b, frames, c_in, c_out, stride, m)}"))
    return f"max |diff| {worst:.3g}"


@check
def fused_conv_guard() -> str:
    """The module's own start-up comparison (what switches the kernel off on a device where it
    differs), run here on the CPU: a dilated conv, a narrow output, a 1x1 conv, the context read in
    place, a transposed conv."""
    from engine.qwen3.models import fused_conv as fc

    fc._compare(torch.device("cpu"))
    return "within 3e-2 of torch's convolutions"


@check
def fused_conv_codec() -> str:
    """A tiny Code2Wav streamed chunk by chunk through the fused convolutions (packing, histories,
    the fused residual units) equals its offline decode through torch's convolutions."""
    from engine.qwen3.models import codec as codec_module
    from engine.qwen3.models import fused_conv as fc
    from tests.engine.qwen3.codec.conftest import tiny_tokenizer_config_dict

    torch.manual_seed(0)
    model = codec_module.Code2Wav(tiny_tokenizer_config_dict()["decoder_config"]).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embedding_sum"):  # codebooks that give audio, not silence
                p.normal_()
    model.quantizer.refresh()
    codes = torch.randint(0, 2048, (2, 5, 16))
    offline = model.decode(codes)
    model.init_streams(2)
    slots = torch.arange(2)
    real = fc.available
    fc.available = lambda x: True  # type: ignore[assignment]
    try:
        pieces, at = [], 0
        for n in (1, 3, 1):
            pieces.append(model.decode_step(slots, codes[:, at : at + n]))
            at += n
    finally:
        fc.available = real  # type: ignore[assignment]
    streamed = torch.cat(pieces, dim=1)
    inside = (offline.abs() < 0.99).float().mean().item()
    assert offline.abs().max() > 1e-3 and inside > 0.9, "silence or clipping would prove nothing"
    diff = close(streamed, offline, 1e-4, 1e-4, "streamed (fused) vs offline (torch)")
    return f"2 rows x 5 frames in chunks 1, 3, 1: max |diff| {diff:.3g}"


# -- Code2Wav's streaming attention (engine.qwen3.models.window_attention) -------------------------------


@check
def window_attention() -> str:
    """The ring kernel against its torch path (SDPA over the cached window read in order): the
    output, and the rings after the chunk's keys went in; chunks of 1 frame to the longest the
    kernel takes, from slots that are fresh (positions before 0 are empty) and well under way."""
    from engine.qwen3.models import window_attention as wa

    gen = torch.Generator().manual_seed(8)
    window, heads, dim = 9, 2, 64
    ring = wa.ring_size(window, 6)
    worst = 0.0
    for frames, starts in ((1, (0, 40)), (4, (3, 17)), (wa.kernel_frames(ring, window), (0, 95))):
        rings = [torch.randn(4, heads, ring, dim, generator=gen).to(torch.bfloat16) for _ in range(2)]
        slots, first = torch.tensor([3, 1]), torch.tensor(starts)
        q, k, v = (torch.randn(2, frames, heads, dim, generator=gen).to(torch.bfloat16) for _ in range(3))
        ref_rings = tuple(r.clone() for r in rings)
        expected = wa.attend_reference(q, k, v, ref_rings, slots, first, window)
        got = wa.attend(q, k, v, (rings[0], rings[1]), slots, first, window)
        case = f"F={frames} starts={starts}"
        worst = max(worst, close(got, expected, 2e-2, 2e-2, case))
        for mine, theirs in zip(rings, ref_rings, strict=True):
            close(mine, theirs, 0, 0, case + " rings")
    return f"ring {ring}, window {window}: max |diff| {worst:.3g}"


# -- the bounded sampler's draw (engine.qwen3.models.sampling_kernel) ----------------------------------------------


@triton.jit
def _div_rn(x, y):  # type: ignore[no-untyped-def]
    x, y = tl.broadcast(x, y)
    return tl.math.div_rn(x, y)


@triton.jit
def _log(x):  # type: ignore[no-untyped-def]
    return tl.log(x)


@contextlib.contextmanager
def _libdevice_stand_in() -> Iterator[Any]:
    """libdevice.div_rn / log as tl.math.div_rn / tl.log in engine.qwen3.models.sampling_kernel: the interpreter
    runs libdevice's Python stubs, which return None."""
    from engine.qwen3.models import sampling_kernel

    original = sampling_kernel.__dict__["libdevice"]
    setattr(sampling_kernel, "libdevice", types.SimpleNamespace(div_rn=_div_rn, log=_log))  # noqa: B010
    try:
        yield sampling_kernel
    finally:
        setattr(sampling_kernel, "libdevice", original)  # noqa: B010


def _draws(logits: torch.Tensor, params: Any, seed: torch.Tensor, counter: torch.Tensor) -> tuple[Any, Any]:
    """(kernel, torch path) draws of engine.qwen3.models.sampler.sample(bounded=True)."""
    from engine.qwen3.models.sampler import TOP_K_BOUND, sample

    with _libdevice_stand_in() as sampling_kernel:
        assert not logits.is_cuda  # so sample() below takes the torch path
        expected = sample(logits, params, seed, counter, bounded=True)
        values, index = logits.float().topk(TOP_K_BOUND, dim=-1)  # as sample() hands the kernel
        got = sampling_kernel.draw(
            values, index, params.temperature, params.top_k, params.top_p, seed, counter
        )
    return got, expected


@check
def sampling_draw() -> str:
    """The kernel draws what the torch path draws (tests/engine/qwen3/gpu/test_sampling_kernel.py): every row
    without top-p; with top-p all but at most one row (its cumulative sum may round differently
    at the boundary)."""
    from engine.qwen3.models.sampler import SamplingParams

    rows, vocab = 32, 300
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    top_k = torch.randint(1, 65, (rows,), generator=gen)
    top_k[:3] = torch.tensor([1, 64, 2])  # the bounds
    seed, counter = torch.arange(rows) * 7919, torch.arange(rows) % 11
    report = []
    for top_p, allowed in ((1.0, 0), (0.8, 1)):
        params = SamplingParams.build([0.9] * rows, top_k.tolist(), [top_p] * rows, [False] * rows, "cpu")
        got, expected = _draws(logits, params, seed, counter)
        differ = int((got != expected).sum())
        assert differ <= allowed, f"top_p {top_p}: {differ} of {rows} draws differ from the torch path"
        assert (got != logits.argmax(-1)).any(), f"top_p {top_p}: every draw is the argmax (no sampling)"
        report.append(f"top_p {top_p}: {rows - differ}/{rows} agree")
    return "; ".join(report) + " (libdevice stood in by tl.math.div_rn / tl.log)"


@check
def sampling_draw_masked_rows() -> str:
    """Rows of -inf logits but one or two ids draw only those ids."""
    from engine.qwen3.models.sampler import SamplingParams

    logits = torch.full((3, 3072), float("-inf"))
    logits[:, 2150] = 0.0
    logits[1, 7] = 5.0
    params = SamplingParams.build([0.9] * 3, [50, 64, 1], [1.0, 0.5, 1.0], [False] * 3, "cpu")
    got, expected = _draws(logits, params, torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert got.tolist() == expected.tolist(), f"kernel {got.tolist()}, torch path {expected.tolist()}"
    assert got[0] == 2150 and got[2] == 2150, got.tolist()
    return f"draws {got.tolist()}"


# -- FP8 activation quantisation (engine.qwen3.models.fp8) --------------------------------------------------


@check
def fp8_quantize_rows() -> str:
    """The one-kernel row quantisation equals the torch ops (fp8.quantize_rows) bit for bit."""
    from engine.qwen3.models import fp8

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 100, generator=gen) * 3  # K 100: BLOCK 128 with a masked tail
    x[2] = 0.0  # the MIN_AMAX floor
    x[4] *= 1e-3
    x[5, 7] = 1e4  # one outlier: the rest of its row underflows towards fp8's subnormals
    sliced = (torch.randn(4, 130, generator=gen) * 2)[:, 10:74]  # K 64, row stride 130
    cases = {"fp32 [6, 100]": x, "bf16 [6, 100]": x.bfloat16(), "fp32 sliced [4, 64]": sliced}
    for case, t in cases.items():
        q, scale = fp8.triton_quantize_rows(t)
        want_q, want_scale = fp8.quantize_rows(t)
        differ = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
        assert differ == 0, f"{case}: {differ} of {q.numel()} fp8 values differ from the torch ops"
        assert torch.equal(scale, want_scale), f"{case}: scales differ"
    return f"{', '.join(cases)}: values and scales bit-identical"


# -- running ------------------------------------------------------------------------------------------


# -- fused decoder layers (engine.qwen3.models.fused_layer) ---------------------------------------------------


@check
def fused_layer_kernels() -> str:
    """The module's own device comparison (add + RMSNorm, head norms + rotation + cache writes,
    SiLU gate product against the eager ops), run here on the CPU."""
    from engine.qwen3.models import fused_layer

    fused_layer._compare(torch.device("cpu"))
    return "add_rms_norm 37 x 2048, qkv_post 6 tokens x (4 + 2) heads, silu_mul 9 x 3000: within 1e-2"


@contextlib.contextmanager
def _decode_kernel_on_cpu() -> Iterator[None]:
    from engine.qwen3.models import decode_attention

    available = decode_attention.available
    decode_attention.available = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        decode_attention.available = available  # type: ignore[assignment]


@check
def fused_decoder_stack() -> str:
    """A whole decoder stack (two layers, GQA) through the fused path against its eager layers, bf16:
    talker decode (slots, per-row lengths), a talker prompt chunk (slots, three tokens) and the code
    predictor's loop (own rows: two tokens, then one); outputs and every cache cell written."""
    from engine.qwen3.models.config import DecoderShape
    from engine.qwen3.models.layers import DecoderStack, FusedStep, KVCache
    from engine.qwen3.models.rope import rope_cos_sin

    shape = DecoderShape(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=64,
        attention_bias=False,
        hidden_act="silu",
    )
    gen = torch.Generator().manual_seed(7)
    stack = DecoderStack(shape)
    with torch.no_grad():
        for prm in stack.parameters():
            prm.copy_(
                torch.randn(prm.shape, generator=gen) * (0.3 if prm.dim() > 1 else 0.2) + (prm.dim() == 1)
            )
    stack = stack.to(torch.bfloat16)
    weights_before = {k: v.clone() for k, v in stack.state_dict().items()}
    fused = copy.deepcopy(stack)
    fused.fuse_layers()
    assert fused.layers[0].self_attn.qkv_weight is not None and fused.layers[0].mlp.gate_up_weight is not None
    for name, value in fused.state_dict().items():  # same names and values; the projections are views
        assert torch.equal(value, weights_before[name]), f"fusing changed {name}"
    q = fused.layers[1].self_attn
    assert q.k_proj.weight.data_ptr() == q.qkv_weight.data_ptr() + q.q_proj.weight.numel() * 2
    worst = 0.0
    cases = (
        ("talker decode", 5, 1, torch.tensor([3, 0, 6, 2, 5]), torch.tensor([[4], [9], [1], [7], [12]]), 13),
        ("talker prompt chunk", 2, 3, torch.tensor([1, 4]), torch.tensor([[0, 1, 2], [5, 6, 7]]), 8),
        # one row: its slot expanded over the tokens flattens to a stride-0 view (read past its end)
        ("one-row prompt chunk", 1, 3, torch.tensor([2]), torch.tensor([[3, 4, 5]]), 8),
        ("predictor first step", 3, 2, None, torch.arange(2).expand(3, 2), 2),
        ("predictor later step", 3, 1, None, torch.full((3, 1), 2), 3),
    )
    with _decode_kernel_on_cpu(), torch.no_grad():
        predictor: tuple[KVCache, KVCache] | None = None  # its two steps share one cache per path
        for case, b, t, slots, positions, kv_len in cases:
            x = (torch.randn(b, t, 64, generator=gen) * 2).to(torch.bfloat16)
            if slots is not None or predictor is None:
                eager_cache = KVCache.allocate(shape, 8, 16, "cpu", torch.bfloat16)
                eager_cache.k.normal_(generator=gen)  # stale entries must stay unseen
                eager_cache.v.normal_(generator=gen)
                fused_cache = KVCache(eager_cache.k.clone(), eager_cache.v.clone())
                if slots is None:
                    predictor = (eager_cache, fused_cache)
            else:
                eager_cache, fused_cache = predictor
            lengths = (positions[:, 0] + 1).to(torch.int32) if t == 1 and slots is not None else None
            expected = stack.run_layers(x, positions, eager_cache, slots, kv_len, lengths)
            cos, sin = rope_cos_sin(fused.inv_freq, positions, torch.bfloat16)
            assert torch.equal(fused.rope_cos[positions], cos) and torch.equal(
                fused.rope_sin[positions], sin
            ), f"{case}: the rotation table differs from rope_cos_sin"
            step = FusedStep.of(x, cos, sin, positions, slots, kv_len, lengths)
            assert (step.decode_rows is not None) == (t == 1), f"{case}: decode kernel use"
            got = fused._run_fused(x, step, fused_cache)
            worst = max(worst, close(got, expected, 0.08, 0.05, case))
            close(fused_cache.k, eager_cache.k, 0.05, 0.02, f"{case}: keys in the cache")
            # the first layer's values come from the same input (exact); later layers' from outputs
            # that differ by bf16 rounding
            assert torch.equal(fused_cache.v[0], eager_cache.v[0]), (
                f"{case}: first layer's values in the cache"
            )
            close(fused_cache.v, eager_cache.v, 0.05, 0.02, f"{case}: values in the cache")
    return f"5 cases, output largest difference {worst:.3g} (bf16)"


def run(name: str) -> dict[str, Any]:
    entry = CHECKS[name]
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        detail, ok = entry.run(), True
    except Exception as exc:  # every failure is a result, reported as such
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
        detail, ok = f"{type(exc).__name__}: {exc} [{where}]", False
    if entry.xfail:
        detail = f"expected to fail under the interpreter ({entry.xfail}); {detail}"
    return {
        "name": name,
        "ok": ok,
        "detail": detail,
        "seconds": round(time.perf_counter() - start, 2),
        "xfail": entry.xfail,
    }


def main(argv: list[str]) -> int:
    unknown = [name for name in argv if name not in CHECKS]
    if unknown:
        print(f"unknown checks: {', '.join(unknown)}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    SHIM.install()
    failed = False
    try:
        for name in argv or list(CHECKS):
            result = run(name)
            failed |= not result["ok"] and not result["xfail"]
            print(json.dumps(result), flush=True)
    finally:
        SHIM.uninstall()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
