"""Prompt layouts of the Qwen3-TTS talker, as upstream builds them.

Each talker position is the sum of a text track (projected text embedding) and a codec track
(codec embedding). A prompt is:

    [instruction (text only)]                     "<|im_start|>user\\n{instruct}<|im_end|>\\n"
    role (text only)                              "<|im_start|>assistant\\n"
    text  tts_pad ... tts_pad tts_bos             (one per codec tag below but the last)
    codec think|nothink think_bos [lang] think_eos [speaker] pad
    then, by mode:
      streaming text:      text[0] + codec_bos;   trailing text = text[1:] + tts_eos, one per frame
      non-streaming text:  (text + tts_eos) + codec_pad each;  tts_pad + codec_bos;  no trailing text
      voice clone (ICL):   (ref_text + text + tts_eos) against (codec_bos + ref frames), summed over
                           the shorter length (streaming) or laid out one after the other

After the prompt, frame t's input is the sum of its 16 codebook embeddings plus trailing[t]
(tts_pad once the trailing text is used up).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from engine.qwen3.models.config import Qwen3TTSConfig
from engine.qwen3.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PromptRequest:
    text: str
    language: str = "Auto"
    speaker: str | None = None  # CustomVoice preset speaker
    instruct: str | None = None  # CustomVoice (not 0.6B) / VoiceDesign instruction
    speaker_embedding: Tensor | None = None  # Base: x-vector [H]
    ref_codes: Tensor | None = None  # Base ICL clone: reference frames [F, G]
    ref_text: str | None = None  # Base ICL clone: transcript of the reference
    non_streaming: bool = False  # whole text in the prompt instead of one token per frame


@dataclass(frozen=True)
class PromptTokens:
    """The host-side (integer) part of a prompt."""

    text_ids: list[int]  # "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
    instruct_ids: list[int] | None
    ref_ids: list[int] | None  # "<|im_start|>assistant\n{ref_text}<|im_end|>\n"
    language_id: int | None  # None = Auto
    speaker_id: int | None  # codec id of a preset speaker


@dataclass
class PromptEmbeds:
    prefill: Tensor  # [T, H]
    trailing: Tensor  # [N, H]: added to frame t's input for t < N
    tts_pad: Tensor  # [H]: added once the trailing text is used up


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def resolve_language(cfg: Qwen3TTSConfig, language: str | None, speaker: str | None) -> int | None:
    """Codec language id (None = Auto); dialect speakers replace Chinese/Auto by their dialect."""
    lang = (language or "auto").lower()
    if lang not in cfg.languages:
        raise ValueError(f"unsupported language {language!r}; supported: {sorted(cfg.languages)}")
    language_id = None if lang == "auto" else cfg.talker.language_ids[lang]
    if speaker and lang in ("chinese", "auto"):
        dialect = cfg.talker.speaker_dialects.get(speaker.lower(), False)
        if dialect:
            language_id = cfg.talker.language_ids[str(dialect)]
    return language_id


def tokenize_request(tokenizer: TextTokenizer, cfg: Qwen3TTSConfig, req: PromptRequest) -> PromptTokens:
    speaker_id = None
    if req.speaker:
        key = req.speaker.lower()
        if key not in cfg.talker.speaker_ids:
            raise ValueError(f"unsupported speaker {req.speaker!r}; supported: {sorted(cfg.speakers)}")
        speaker_id = cfg.talker.speaker_ids[key]
    instruct = req.instruct or None
    if instruct and cfg.tts_model_type == "custom_voice" and cfg.drops_instruct:
        instruct = None
    if req.ref_codes is not None:
        if not req.ref_text:
            raise ValueError("a voice clone with reference codes needs ref_text")
        if req.speaker_embedding is None:
            raise ValueError("a voice clone with reference codes needs the speaker embedding")
    text_ids = tokenizer.encode(assistant_text(req.text))
    return PromptTokens(
        text_ids=text_ids,
        instruct_ids=tokenizer.encode(instruct_text(instruct)) if instruct else None,
        ref_ids=tokenizer.encode(ref_text(req.ref_text))
        if req.ref_codes is not None and req.ref_text
        else None,
        language_id=resolve_language(cfg, req.language, req.speaker),
        speaker_id=speaker_id,
    )
