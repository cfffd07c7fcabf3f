"""FP8 (e4m3) weights for linear layers: per-output-channel weight scales, per-token activation scales.

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n] + bias[n]

xq = x / sx in float8_e4m3fn with sx = amax(|x[m, :]|) / 448, computed on the device at every call;
wq = w / sw with sw = amax(|w[n, :]|) / 448, once, at quantisation. On CUDA devices with FP8 tensor
cores (compute capability >= 8.9) the product is `torch._scaled_mm` with row-wise scales and the
activations are quantised by one Triton kernel (torch ops when Triton is absent); elsewhere an
emulation computes the same thing in fp32 (fp8 x fp8 products are exact in fp32). Nothing reads
tensors back to the host and shapes follow the input, so quantised layers live in CUDA graphs.

Sibling layers that read the same tensor (q/k/v, gate/up) quantise it once: each group of siblings
shares the last quantised input, keyed by the tensor's identity and version counter.

The quantised weight and its scale are buffers, not parameters, so `module.parameters()` keeps
reporting the model's compute dtype, and `.to(dtype)` moves them between devices without casting.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_AMAX = 1e-12  # all-zero rows get a tiny scale (their quantised values are 0 either way)

# Targets, as fnmatch patterns over module names relative to a Talker (engine.qwen3.models.talker).
TARGETS: dict[str, tuple[str, ...]] = {
    "talker": ("model.layers.*",),  # q/k/v/o and gate/up/down of every talker decoder layer
    "code_predictor": ("code_predictor.model.layers.*",),  # the same in the code predictor
    "heads": ("codec_head", "code_predictor.lm_head.*"),
}
DEFAULT_TARGETS = ("talker",)


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """t [..., K] -> (fp8 values [..., K], fp32 scales [..., 1]) with t ~= values * scales,
    one scale per row (amax / 448). Round to nearest even; |t / scale| <= 448 by construction."""
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    # divided by a tensor, not a Python number: CUDA turns division by a host scalar into
    # multiplication by its reciprocal, a last bit away from the IEEE quotient the Triton kernel makes
    scale = amax.clamp_min(MIN_AMAX) / torch.full_like(amax, FP8_MAX)
    return (t / scale).to(FP8_DTYPE), scale


def dequantize_rows(values: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (values.float() * scale).to(dtype)


def emulated_scaled_mm(xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor) -> Tensor:
    """What torch._scaled_mm(xq, wq.t(), x_scale [M, 1], w_scale [1, N]) computes, in fp32: the
    exact fp8 products summed in fp32, then scaled per row and per column."""
    return (xq.float() @ wq.float().t()) * x_scale * w_scale[None, :]


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """None when `device` runs FP8 matmuls natively, else why not (for a clear error)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (
            f"FP8 weights need a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); device is {dev}"
        )
    if not torch.cuda.is_available():
        return "FP8 weights need CUDA, which is not available"
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    index = _cuda_index(dev)
    if _cuda_capability(index) < (8, 9):
        major, minor = _cuda_capability(index)
        name = torch.cuda.get_device_name(index)
        return f"FP8 weights need compute capability >= 8.9 (Ada, Hopper or newer); {name} is {major}.{minor}"
    return None


def native_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and _cuda_capability(_cuda_index(device)) >= (8, 9)


class SharedInput:
    """The last input quantised by any of a group of sibling layers, with its quantisation."""

    __slots__ = ("source", "version", "quantized")

    def __init__(self) -> None:
        self.source: weakref.ref[Tensor] | None = None  # weak: a finished input is not kept alive
        self.version = -1
        self.quantized: tuple[Tensor, Tensor] | None = None

    def quantize(
        self, x: Tensor, quantizer: Callable[[Tensor], tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor]:
        """quantizer(x), reused while x is the same, unmodified tensor (the same object: views
        made by the callers are new objects, so callers pass the tensor they were given)."""
        if x.is_inference():  # no version counter: share nothing
            return quantizer(x)
        if self.source is not None and self.source() is x and self.version == x._version:
            assert self.quantized is not None
            return self.quantized
        self.quantized = quantizer(x)
        self.source, self.version = weakref.ref(x), x._version
        return self.quantized

    def clear(self) -> None:
        self.source, self.quantized = None, None

    def __deepcopy__(self, memo: dict[int, object]) -> SharedInput:
        return SharedInput()  # copies of sibling layers share one new, empty cache (via memo)


class Fp8Linear(nn.Module):
    """A drop-in for nn.Linear(in_features, out_features) holding FP8 weights.

    emulate: always use the fp32 emulation (tests; checks on devices without FP8 tensor cores).
    shared: the quantised-input cache of this layer's siblings (a private one when None)."""

    weight: Tensor  # float8_e4m3fn [N, K]
    weight_scale: Tensor  # float32 [N]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        emulate: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        shared: SharedInput | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.emulate = emulate
        self.source_dtype = dtype  # the dtype of the weights this layer replaced (and of its bias)
        self.shared = shared or SharedInput()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, emulate: bool = False, shared: SharedInput | None = None
    ) -> Fp8Linear:
        w = linear.weight.detach()
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            emulate=emulate,
            device="meta",
            dtype=w.dtype,
            shared=shared,
        )
        values, scale = quantize_rows(w)
        layer.weight, layer.weight_scale = values, scale.squeeze(1)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        lead, k = x.shape[:-1], self.in_features
        native = not self.emulate and native_fp8(x.device)
        quantizer = _device_quantizer(x.device) if native else quantize_rows
        xq, sx = self.shared.quantize(x, lambda t: quantizer(t.reshape(-1, k)))
        if native:
            y = torch._scaled_mm(
                xq, self.weight.t(), scale_a=sx, scale_b=self.weight_scale[None, :], out_dtype=torch.bfloat16
            )
        else:
            y = emulated_scaled_mm(xq, sx, self.weight, self.weight_scale)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # device moves apply to the quantised tensors; dtype casts (module.to(torch.bfloat16)) do not
        weight, scale = self._buffers.pop("weight"), self._buffers.pop("weight_scale")
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            assert weight is not None and scale is not None
            device = fn(torch.empty(0, device=weight.device)).device
            self._buffers["weight"] = weight.to(device)
            self._buffers["weight_scale"] = scale.to(device)
            self.shared.clear()
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, float8_e4m3fn per-channel, emulate={self.emulate}"
        )


# -- one-kernel activation quantisation (CUDA, Triton) --------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch ops serve
    triton = None


if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, x_row_stride, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """One program per row: amax, scale = max(amax, 1e-12) / 448, q = x / scale (IEEE division
        and round-to-nearest-even, as the torch ops do)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        q = tl.math.div_rn(x, tl.broadcast_to(scale, (BLOCK,)))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def triton_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows for a CUDA x [M, K] in one kernel launch."""
    assert triton is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=block, num_warps=warps)
    return q, scale


# the activation kernel serves until it fails to compile or launch here (then the torch ops do)
_triton_state = {"enabled": triton is not None}


def guarded_triton_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """The Triton kernel; if it cannot compile or launch here, a warning and the torch ops from then on.
    (The first call of every layer runs eagerly, before any CUDA-graph capture.)"""
    if _triton_state["enabled"]:
        try:
            return triton_quantize_rows(x)
        except Exception as e:  # noqa: BLE001 - any compile or launch failure
            _triton_state["enabled"] = False
            warnings.warn(
                f"FP8 activation kernel unavailable ({type(e).__name__}: {e}); using torch ops",
                RuntimeWarning,
                stacklevel=2,
            )
    return quantize_rows(x)


def _device_quantizer(device: torch.device) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """The Triton kernel on CUDA when Triton is installed, else the torch ops."""
    if device.type == "cuda" and _triton_state["enabled"]:
        return guarded_triton_quantize_rows
    return quantize_rows


def target_patterns(targets: Iterable[str]) -> tuple[str, ...]:
    """Named targets ("talker", "code_predictor", "heads") -> module-name patterns."""
    patterns: list[str] = []
    for name in targets:
        if name not in TARGETS:
            raise ValueError(f"unknown FP8 target {name!r}; choose from {', '.join(TARGETS)}")
        patterns += TARGETS[name]
    return tuple(patterns)


def quantize_linears(
    module: nn.Module,
    *,
    include: Iterable[str] = TARGETS["talker"],
    exclude: Iterable[str] = (),
    emulate: bool = False,
) -> list[str]:
    """Replace, in place, every nn.Linear whose qualified name matches an `include` pattern (fnmatch;
    `*` also spans dots) and no `exclude` pattern by an Fp8Linear. Returns the replaced names in order.

    Embeddings, norms and anything that is not an nn.Linear are never touched. Layers with the same
    parent (q/k/v/o, gate/up/down) share one quantised-input cache."""
    include, exclude = tuple(include), tuple(exclude)
    chosen = [
        name
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear)
        and any(fnmatchcase(name, p) for p in include)
        and not any(fnmatchcase(name, p) for p in exclude)
    ]
    groups: dict[str, SharedInput] = {}
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        shared = groups.setdefault(parent_name, SharedInput())
        with torch.no_grad():
            setattr(
                parent, attr, Fp8Linear.from_linear(getattr(parent, attr), emulate=emulate, shared=shared)
            )
    return chosen


def quantize_talker(
    talker: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS, *, emulate: bool = False
) -> list[str]:
    """Quantise a Talker's named targets ("talker", "code_predictor", "heads") in place."""
    return quantize_linears(talker, include=target_patterns(targets), emulate=emulate)


@dataclass(frozen=True)
class Fp8Memory:
    layers: int
    weight_bytes_before: int  # the replaced weights in their original dtype
    weight_bytes_after: int  # fp8 weights + fp32 scales

    @property
    def saved_bytes(self) -> int:
        return self.weight_bytes_before - self.weight_bytes_after


def fp8_memory(module: nn.Module) -> Fp8Memory:
    """Weight bytes of the module's Fp8Linear layers before and after quantisation."""
    layers = [m for m in module.modules() if isinstance(m, Fp8Linear)]
    before = sum(m.weight.numel() * m.source_dtype.itemsize for m in layers)
    after = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4 for m in layers)
    return Fp8Memory(len(layers), before, after)
