"""Qwen3-TTS-12Hz configuration, parsed and validated from a checkpoint's config.json and
generation_config.json (same field names as the released checkpoints)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json / generation_config.json that this engine cannot run."""


def _get(d: dict[str, Any], key: str, default: Any = None, *, required: bool = False, where: str = "") -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if required:
        raise ConfigError(f"{where or 'config'}: missing required field {key!r}")
    return default


@dataclass(frozen=True)
class DecoderShape:
    """The shape of one Qwen3 decoder stack (talker or code predictor)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    hidden_act: str

    def validate(self, where: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim must be even (RoPE)")
        if self.hidden_act != "silu":
            raise ConfigError(f"{where}: only hidden_act 'silu' is supported, got {self.hidden_act!r}")


def _decoder_shape(d: dict[str, Any], where: str, defaults: dict[str, Any]) -> DecoderShape:
    def g(key: str) -> Any:
        return _get(d, key, defaults.get(key), required=key not in defaults, where=where)

    hidden = int(g("hidden_size"))
    heads = int(g("num_attention_heads"))
    shape = DecoderShape(
        hidden_size=hidden,
        intermediate_size=int(g("intermediate_size")),
        num_hidden_layers=int(g("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(g("num_key_value_heads")),
        head_dim=int(_get(d, "head_dim", hidden // heads)),
        rms_norm_eps=float(g("rms_norm_eps")),
        rope_theta=float(g("rope_theta")),
        max_position_embeddings=int(g("max_position_embeddings")),
        attention_bias=bool(g("attention_bias")),
        hidden_act=str(g("hidden_act")),
    )
    shape.validate(where)
    return shape


_COMMON_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "hidden_act": "silu",
}


@dataclass(frozen=True)
class CodePredictorConfig:
    shape: DecoderShape
    vocab_size: int  # codebook size (2048)
    num_code_groups: int  # 16: the predictor emits groups 1..15


@dataclass(frozen=True)
class TalkerConfig:
    shape: DecoderShape
    vocab_size: int  # codec vocab: codebook-0 codes + control ids
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    language_ids: dict[str, int]
    speaker_ids: dict[str, int]
    speaker_dialects: dict[str, str | bool]
    code_predictor: CodePredictorConfig

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def control_id_start(self) -> int:
        """Ids in [vocab - 1024, vocab) are control/speaker/language ids, never sampled (except EOS)."""
        return self.vocab_size - 1024


@dataclass(frozen=True)
class Qwen3TTSConfig:
    talker: TalkerConfig
    speaker_encoder: dict[str, Any] | None  # Base models only; parsed by the speaker encoder
    tts_model_type: str  # "base" | "custom_voice" | "voice_design"
    tts_model_size: str  # "0b6" | "1b7"
    tokenizer_type: str
    im_start_id: int
    im_end_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def drops_instruct(self) -> bool:
        """The 0.6B CustomVoice model ignores instructions (upstream tests `size in "0b6"`)."""
        return self.tts_model_size in "0b6"

    @property
    def languages(self) -> tuple[str, ...]:
        return ("auto", *(k for k in self.talker.language_ids if "dialect" not in k))

    @property
    def speakers(self) -> tuple[str, ...]:
        return tuple(self.talker.speaker_ids)


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json; the values upstream uses when a request does not override them."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048
    min_new_tokens: int = 2


def parse_config(raw: dict[str, Any]) -> Qwen3TTSConfig:
    if raw.get("model_type", "qwen3_tts") != "qwen3_tts":
        raise ConfigError(f"config.json: model_type {raw.get('model_type')!r} is not 'qwen3_tts'")
    t = _get(raw, "talker_config", required=True, where="config.json")
    cp = _get(t, "code_predictor_config", required=True, where="talker_config")
    rope = t.get("rope_scaling") or {}
    talker_shape = _decoder_shape(t, "talker_config", _COMMON_DEFAULTS)
    if rope and "mrope_section" in rope and 2 * sum(rope["mrope_section"]) != talker_shape.head_dim:
        raise ConfigError("talker_config.rope_scaling.mrope_section must sum to head_dim / 2")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"talker_config.rope_scaling: unsupported rope_type {rope.get('rope_type')!r}")
    cp_shape = _decoder_shape(cp, "code_predictor_config", {**_COMMON_DEFAULTS, "head_dim": 128})
    if cp.get("rope_scaling"):
        raise ConfigError("code_predictor_config.rope_scaling is not supported")
    groups = int(_get(t, "num_code_groups", 32))
    cp_cfg = CodePredictorConfig(
        shape=cp_shape,
        vocab_size=int(_get(cp, "vocab_size", 2048)),
        num_code_groups=int(_get(cp, "num_code_groups", groups)),
    )
    if cp_cfg.num_code_groups != groups:
        raise ConfigError("talker and code predictor disagree on num_code_groups")
    talker = TalkerConfig(
        shape=talker_shape,
        vocab_size=int(_get(t, "vocab_size", 3072)),
        text_vocab_size=int(_get(t, "text_vocab_size", required=True, where="talker_config")),
        text_hidden_size=int(_get(t, "text_hidden_size", 2048)),
        num_code_groups=groups,
        codec_pad_id=int(_get(t, "codec_pad_id", 4196)),
        codec_bos_id=int(_get(t, "codec_bos_id", 4197)),
        codec_eos_id=int(_get(t, "codec_eos_token_id", 4198)),
        codec_think_id=int(_get(t, "codec_think_id", 4202)),
        codec_nothink_id=int(_get(t, "codec_nothink_id", 4203)),
        codec_think_bos_id=int(_get(t, "codec_think_bos_id", 4204)),
        codec_think_eos_id=int(_get(t, "codec_think_eos_id", 4205)),
        language_ids={k.lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()},
        speaker_ids={k.lower(): int(v) for k, v in (t.get("spk_id") or {}).items()},
        speaker_dialects={k.lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()},
        code_predictor=cp_cfg,
    )
    if not 0 <= talker.codec_eos_id < talker.vocab_size:
        raise ConfigError("talker_config.codec_eos_token_id outside the codec vocabulary")
    for name, dialect in talker.speaker_dialects.items():
        if dialect and dialect not in talker.language_ids:
            raise ConfigError(f"speaker {name!r}: dialect {dialect!r} has no codec_language_id")
    model_type = str(_get(raw, "tts_model_type", required=True, where="config.json"))
    if model_type not in ("base", "custom_voice", "voice_design"):
        raise ConfigError(f"config.json: unknown tts_model_type {model_type!r}")
    spk = raw.get("speaker_encoder_config") if model_type == "base" else None
    if model_type == "base" and not spk:
        raise ConfigError("config.json: a Base model needs speaker_encoder_config")
    return Qwen3TTSConfig(
        talker=talker,
        speaker_encoder=spk,
        tts_model_type=model_type,
        tts_model_size=str(_get(raw, "tts_model_size", "")),
        tokenizer_type=str(_get(raw, "tokenizer_type", "qwen3_tts_tokenizer_12hz")),
        im_start_id=int(_get(raw, "im_start_token_id", 151644)),
        im_end_id=int(_get(raw, "im_end_token_id", 151645)),
        tts_pad_id=int(_get(raw, "tts_pad_token_id", 151671)),
        tts_bos_id=int(_get(raw, "tts_bos_token_id", 151672)),
        tts_eos_id=int(_get(raw, "tts_eos_token_id", 151673)),
        raw=raw,
    )


def parse_generation_config(raw: dict[str, Any]) -> GenerationDefaults:
    d = GenerationDefaults()

    def pick(key: str, default: Any) -> Any:
        return raw[key] if raw.get(key) is not None else default

    out = GenerationDefaults(
        do_sample=bool(pick("do_sample", d.do_sample)),
        temperature=float(pick("temperature", d.temperature)),
        top_k=int(pick("top_k", d.top_k)),
        top_p=float(pick("top_p", d.top_p)),
        repetition_penalty=float(pick("repetition_penalty", d.repetition_penalty)),
        subtalker_do_sample=bool(pick("subtalker_dosample", d.subtalker_do_sample)),
        subtalker_temperature=float(pick("subtalker_temperature", d.subtalker_temperature)),
        subtalker_top_k=int(pick("subtalker_top_k", d.subtalker_top_k)),
        subtalker_top_p=float(pick("subtalker_top_p", d.subtalker_top_p)),
        max_new_tokens=int(pick("max_new_tokens", d.max_new_tokens)),
    )
    if out.temperature <= 0 or out.subtalker_temperature <= 0:
        raise ConfigError("generation_config.json: temperature must be > 0")
    if not (0 < out.top_p <= 1 and 0 < out.subtalker_top_p <= 1):
        raise ConfigError("generation_config.json: top_p must be in (0, 1]")
    if out.repetition_penalty <= 0:
        raise ConfigError("generation_config.json: repetition_penalty must be > 0")
    return out


def load_config(path: str | Path) -> Qwen3TTSConfig:
    with open(Path(path) / "config.json", encoding="utf-8") as f:
        return parse_config(json.load(f))


def load_generation_defaults(path: str | Path) -> GenerationDefaults:
    with open(Path(path) / "generation_config.json", encoding="utf-8") as f:
        return parse_generation_config(json.load(f))
