"""Import the reference packages (`qwen_tts`, `qwen_asr`) for parity tests on the CPU.

The reference packages import modules that only their unreleased 25 Hz tokenizer uses
(`torchaudio.compliance.kaldi`, `sox`, `onnxruntime`); PyPI's torchaudio is a CUDA build that
cannot load beside the CPU torch. Those imports are satisfied by empty modules here; the 12 Hz
code paths the tests exercise never call them. This is a test-only shim at a boundary this
machine cannot reach; our own code never imports these packages.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__version__ = "0.0.0+stub"  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def _unused(*args: object, **kwargs: object) -> None:
    raise RuntimeError("stubbed: only the 25 Hz tokenizer uses this")


def _ensure_stubs() -> None:
    try:
        import torchaudio  # noqa: F401
    except Exception:
        for key in [k for k in sys.modules if k == "torchaudio" or k.startswith("torchaudio.")]:
            del sys.modules[key]
        ta, comp, kaldi = (
            _stub("torchaudio"),
            _stub("torchaudio.compliance"),
            _stub("torchaudio.compliance.kaldi"),
        )
        kaldi.fbank = _unused  # type: ignore[attr-defined]
        ta.compliance, comp.kaldi = comp, kaldi  # type: ignore[attr-defined]
    for name in ("sox", "onnxruntime"):
        if importlib.util.find_spec(name) is None and name not in sys.modules:
            mod = _stub(name)
            mod.InferenceSession = _unused  # type: ignore[attr-defined]
            mod.SessionOptions = _unused  # type: ignore[attr-defined]
            mod.GraphOptimizationLevel = types.SimpleNamespace(ORT_ENABLE_ALL=99)  # type: ignore[attr-defined]
            mod.Transformer = _unused  # type: ignore[attr-defined]


def import_qwen_tts() -> types.ModuleType:
    """Return the `qwen_tts` module, or skip the calling test when it is not installed."""
    _ensure_stubs()
    return pytest.importorskip("qwen_tts")


def import_qwen_asr() -> types.ModuleType:
    _ensure_stubs()
    return pytest.importorskip("qwen_asr")
