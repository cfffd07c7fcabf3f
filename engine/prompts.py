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

import torch
from torch import Tensor

from engine.models.config import Qwen3TTSConfig
from engine.models.talker import Talker
from engine.tokenizer import TextTokenizer


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
        ref_ids=tokenizer.encode(ref_text(req.ref_text)) if req.ref_codes is not None and req.ref_text else None,
        language_id=resolve_language(cfg, req.language, req.speaker),
        speaker_id=speaker_id,
    )


def _ids(values: list[int], device: torch.device) -> Tensor:
    # copied without waiting for the GPU: prompts are built while the previous step still runs
    return torch.tensor([values], dtype=torch.long).to(device, non_blocking=True)


@torch.no_grad()
def build_prompt_embeds(
    talker: Talker,
    cfg: Qwen3TTSConfig,
    tokens: PromptTokens,
    *,
    speaker_embedding: Tensor | None = None,
    ref_codes: Tensor | None = None,
    non_streaming: bool = False,
) -> PromptEmbeds:
    """The talker prompt for one request (same arithmetic, in the same order, as upstream)."""
    tc = cfg.talker
    device = talker.codec_head.weight.device
    dtype = talker.codec_head.weight.dtype
    ids = _ids(tokens.text_ids, device)
    if ids.shape[1] < 9:
        raise ValueError("text ids must hold the assistant ChatML frame around at least one token")

    tts_bos, tts_eos, tts_pad = talker.embed_text(_ids([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id], device)).chunk(
        3, dim=1
    )
    if tokens.language_id is None:
        tags = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        tags = [tc.codec_think_id, tc.codec_think_bos_id, tokens.language_id, tc.codec_think_eos_id]
    codec_parts = [talker.embed_codec(_ids(tags, device))]
    if speaker_embedding is not None:
        codec_parts.append(speaker_embedding.to(device=device, dtype=dtype, non_blocking=True).view(1, 1, -1))
    elif tokens.speaker_id is not None:
        codec_parts.append(talker.embed_codec(_ids([tokens.speaker_id], device)[0, 0]).view(1, 1, -1))
    codec_parts.append(talker.embed_codec(_ids([tc.codec_pad_id, tc.codec_bos_id], device)))
    codec = torch.cat(codec_parts, dim=1)

    role = talker.embed_text(ids[:, :3])
    text_track = torch.cat((tts_pad.expand(-1, codec.shape[1] - 2, -1), tts_bos), dim=1)
    prompt = torch.cat((role, text_track + codec[:, :-1]), dim=1)

    if ref_codes is not None:
        if tokens.ref_ids is None:
            raise ValueError("reference codes given without reference text ids")
        icl, trailing = _icl_prompt(
            talker, cfg, ids[:, 3:-5], _ids(tokens.ref_ids, device)[:, 3:-2], ref_codes.to(device, non_blocking=True),
            tts_pad, tts_eos, non_streaming,
        )
        prompt = torch.cat((prompt, icl), dim=1)
    elif non_streaming:
        body = ids[:, 3:-5]
        text_block = torch.cat((talker.embed_text(body), tts_eos), dim=1)
        text_block = text_block + talker.embed_codec(_ids([tc.codec_pad_id] * (body.shape[1] + 1), device))
        start = tts_pad + talker.embed_codec(_ids([tc.codec_bos_id], device))
        prompt = torch.cat((prompt, text_block, start), dim=1)
        trailing = tts_pad
    else:
        first = talker.embed_text(ids[:, 3:4]) + codec[:, -1:]
        prompt = torch.cat((prompt, first), dim=1)
        trailing = torch.cat((talker.embed_text(ids[:, 4:-5]), tts_eos), dim=1)

    if tokens.instruct_ids is not None:
        prompt = torch.cat((talker.embed_text(_ids(tokens.instruct_ids, device)), prompt), dim=1)
    return PromptEmbeds(prefill=prompt[0], trailing=trailing[0], tts_pad=tts_pad[0, 0])


def _icl_prompt(
    talker: Talker,
    cfg: Qwen3TTSConfig,
    text_ids: Tensor,
    ref_ids: Tensor,
    ref_codes: Tensor,
    tts_pad: Tensor,
    tts_eos: Tensor,
    non_streaming: bool,
) -> tuple[Tensor, Tensor]:
    tc = cfg.talker
    device = text_ids.device
    text = torch.cat((talker.embed_text(torch.cat((ref_ids, text_ids), dim=-1)), tts_eos), dim=1)
    frames = torch.cat(
        [talker.embed_codec(ref_codes[:, :1])]
        + [talker.code_predictor.embed_group(g, ref_codes[:, g : g + 1]) for g in range(1, tc.num_code_groups)],
        dim=1,
    ).sum(1)[None]
    codec = torch.cat((talker.embed_codec(_ids([tc.codec_bos_id], device)), frames), dim=1)
    text_len, codec_len = text.shape[1], codec.shape[1]
    if non_streaming:
        text_block = text + talker.embed_codec(_ids([tc.codec_pad_id] * text_len, device))
        return torch.cat((text_block, codec + tts_pad), dim=1), tts_pad
    if text_len > codec_len:
        return text[:, :codec_len] + codec, text[:, codec_len:]
    padded = torch.cat([text] + [tts_pad] * (codec_len - text_len), dim=1)
    return padded + codec, tts_pad


def build_prompt(
    talker: Talker, cfg: Qwen3TTSConfig, tokenizer: TextTokenizer, req: PromptRequest
) -> PromptEmbeds:
    tokens = tokenize_request(tokenizer, cfg, req)
    return build_prompt_embeds(
        talker,
        cfg,
        tokens,
        speaker_embedding=req.speaker_embedding,
        ref_codes=req.ref_codes,
        non_streaming=req.non_streaming,
    )
