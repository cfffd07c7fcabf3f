"""The 12 Hz speech tokenizer: Code2Wav decoder (ours) plus the reference-audio encoder.

Loads a checkpoint's `speech_tokenizer/` directory (config.json, model.safetensors,
preprocessor_config.json). The encoder turns a reference clip into codes for ICL voice clones; it
is a cold path (once per new voice), so it reuses transformers' `MimiModel` with the checkpoint's
`encoder.*` weights and keeps the first `encoder_valid_num_quantizers` (16) codebooks.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from engine.qwen3.models.codec import Code2Wav

REQUIRED_FILES = ("config.json", "model.safetensors", "preprocessor_config.json")


class SpeechTokenizerEncoder:
    """Reference audio (24 kHz mono) -> codes [frames, quantizers]."""

    def __init__(self, mimi: Any, quantizers: int, samples_per_frame: int) -> None:
        self.mimi = mimi
        self.quantizers = quantizers
        self.samples_per_frame = samples_per_frame

    @torch.inference_mode()
    def __call__(self, audio_24k: npt.NDArray[np.float32]) -> Tensor:
        p = next(self.mimi.parameters())
        x = torch.as_tensor(np.asarray(audio_24k, dtype=np.float32)).to(p.device, p.dtype)
        frames = -(-x.shape[-1] // self.samples_per_frame)
        codes = self.mimi.encode(x.reshape(1, 1, -1), return_dict=True).audio_codes
        return codes[0, : self.quantizers, :frames].T.contiguous()


def build_mimi_encoder(encoder_config: dict[str, Any]) -> Any:
    """transformers' MimiModel without its decoder half (only `encoder.*` weights exist)."""
    from transformers import MimiConfig, MimiModel

    mimi: Any = MimiModel(MimiConfig(**encoder_config))  # type: ignore[no-untyped-call]
    mimi.upsample = None
    mimi.decoder_transformer = None
    mimi.decoder = None
    return mimi


@dataclass
class SpeechTokenizer:
    decoder: Code2Wav
    encoder: SpeechTokenizerEncoder | None
    sample_rate: int = 24000
    samples_per_frame: int = 1920

    def encode(self, audio_24k: npt.NDArray[np.float32]) -> Tensor:
        """Reference codes [frames, 16] (LongTensor) for a 24 kHz mono clip."""
        if self.encoder is None:
            raise RuntimeError(
                "this speech tokenizer has no reference encoder (loaded without it, or transformers "
                "is not installed); in-context voice clones need it"
            )
        return self.encoder(audio_24k)


def _split(weights: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def _load(module: nn.Module, weights: dict[str, Tensor], prefix: str, root: Path) -> None:
    """Every tensor the module needs must be there; extra ones (buffers a checkpoint may carry,
    parts of the model we do not build) are ignored, as upstream's loader does."""
    result = module.load_state_dict(_split(weights, prefix), strict=False)
    if result.missing_keys:
        shown = ", ".join(prefix + k for k in result.missing_keys[:8])
        more = len(result.missing_keys) - 8
        raise ValueError(
            f"{root / 'model.safetensors'} lacks {shown}" + (f" and {more} more" if more > 0 else "")
        )


def load_speech_tokenizer(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoder: bool = True,
) -> SpeechTokenizer:
    """Load `speech_tokenizer/`; the decoder runs in `dtype`, the encoder in fp32 (cold path, exact codes)."""
    root = Path(path)
    missing = [name for name in REQUIRED_FILES if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"speech tokenizer directory {root} is missing: {', '.join(missing)}")
    cfg = json.loads((root / "config.json").read_text())
    pre = json.loads((root / "preprocessor_config.json").read_text())
    sample_rate = int(cfg.get("output_sample_rate", 24000))
    if (
        int(cfg.get("input_sample_rate", sample_rate)) != sample_rate
        or int(pre.get("sampling_rate", sample_rate)) != sample_rate
    ):
        raise ValueError(f"{root}: input, output and preprocessor sample rates differ")

    weights = load_file(str(root / "model.safetensors"))
    decoder = Code2Wav(cfg["decoder_config"])
    if decoder.samples_per_frame != int(cfg.get("decode_upsample_rate", decoder.samples_per_frame)):
        raise ValueError(f"{root}: decoder rates do not multiply to decode_upsample_rate")
    _load(decoder, weights, "decoder.", root)
    decoder.to(device=device, dtype=dtype).eval()

    encoder = None
    if with_encoder and importlib.util.find_spec("transformers") is not None:
        mimi = build_mimi_encoder(cfg.get("encoder_config") or {})
        _load(mimi, weights, "encoder.", root)
        mimi.to(device=device, dtype=torch.float32).eval()
        frames = int(cfg.get("encode_downsample_rate", decoder.samples_per_frame))
        encoder = SpeechTokenizerEncoder(mimi, int(cfg.get("encoder_valid_num_quantizers", 16)), frames)
    return SpeechTokenizer(decoder, encoder, sample_rate, decoder.samples_per_frame)
