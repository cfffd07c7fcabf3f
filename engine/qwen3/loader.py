"""Load a Qwen3-TTS-12Hz checkpoint directory (upstream layout) into our modules."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.qwen3.models.config import (
    GenerationDefaults,
    Qwen3TTSConfig,
    load_config,
    load_generation_defaults,
)
from engine.qwen3.models.talker import Talker
from engine.qwen3.tokenizer import REQUIRED_FILES as TOKENIZER_FILES
from engine.qwen3.tokenizer import TextTokenizer

Progress = Callable[[str], None]

SPEECH_TOKENIZER_FILES = ("speech_tokenizer/config.json",)


class CheckpointError(FileNotFoundError):
    """A checkpoint directory that is missing files or holds the wrong tensors."""


@dataclass
class Qwen3TTSBundle:
    path: Path
    config: Qwen3TTSConfig
    generation: GenerationDefaults
    tokenizer: TextTokenizer
    talker: Talker
    speaker_encoder: Any | None  # engine.qwen3.models.speaker.SpeakerEncoder (Base models)
    speech_tokenizer: Any | None  # engine.qwen3.models.speech_tokenizer object (.decoder, .encode)


def weight_files(path: Path, stem: str = "model") -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    single = path / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = path / f"{stem}.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    return []


def missing_files(path: Path) -> list[str]:
    """Every required file that is absent (relative names)."""
    missing = [
        n for n in ("config.json", "generation_config.json", *TOKENIZER_FILES) if not (path / n).is_file()
    ]
    missing += [n for n in SPEECH_TOKENIZER_FILES if not (path / n).is_file()]
    for stem, where in (("model", path), ("model", path / "speech_tokenizer")):
        files = weight_files(where, stem)
        prefix = "" if where == path else "speech_tokenizer/"
        if not files:
            missing.append(f"{prefix}model.safetensors")
        missing += [f"{prefix}{f.name}" for f in files if not f.is_file()]
    return missing


def read_tensors(
    files: list[Path], prefix: str, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Tensors whose names start with `prefix`, with the prefix stripped."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for key in st.keys():
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = st.get_tensor(key)
    return out


def load_talker(path: Path, cfg: Qwen3TTSConfig, device: torch.device | str, dtype: torch.dtype) -> Talker:
    with torch.device("meta"):
        talker = Talker(cfg.talker)
    state = read_tensors(weight_files(path), "talker.")
    expected = set(talker.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: talker weights do not match the config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    talker.load_state_dict(state, strict=True, assign=True)
    talker.reset_rope(device)
    return talker.eval()


def _optional_module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load_speaker_encoder(
    path: Path, cfg: Qwen3TTSConfig, device: torch.device | str, dtype: torch.dtype
) -> Any | None:
    if cfg.tts_model_type != "base":
        return None
    module = _optional_module("engine.qwen3.models.speaker")
    if module is None:
        return None
    encoder = module.SpeakerEncoder(cfg.speaker_encoder)
    state = read_tensors(weight_files(path), "speaker_encoder.")
    encoder.load_state_dict(state, strict=True)
    return encoder.to(device=device, dtype=dtype).eval()


def load_speech_tokenizer(path: Path, device: torch.device | str, dtype: torch.dtype) -> Any | None:
    module = _optional_module("engine.qwen3.models.speech_tokenizer")
    if module is None:
        return None
    return module.load_speech_tokenizer(path / "speech_tokenizer", device, dtype)


def load_qwen3_tts(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> Qwen3TTSBundle:
    """Load everything the engine needs from a checkpoint directory.

    Raises CheckpointError naming every missing file when the directory is incomplete."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    missing = missing_files(root)
    if missing:
        raise CheckpointError(f"checkpoint {root} is incomplete; missing: {', '.join(missing)}")

    def report(msg: str) -> None:
        if progress is not None:
            progress(msg)

    report("config")
    cfg = load_config(root)
    generation = load_generation_defaults(root)
    tokenizer = TextTokenizer.from_dir(root)
    report("talker")
    talker = load_talker(root, cfg, device, dtype)
    report("speaker encoder")
    speaker = load_speaker_encoder(root, cfg, device, dtype)
    report("speech tokenizer")
    speech = load_speech_tokenizer(root, device, dtype)
    report("ready")
    return Qwen3TTSBundle(
        path=root,
        config=cfg,
        generation=generation,
        tokenizer=tokenizer,
        talker=talker,
        speaker_encoder=speaker,
        speech_tokenizer=speech,
    )
