"""Talker prompts for many segments at once (the layouts are in engine.qwen3.prompts).

Building one prompt alone costs about 40 small kernel launches and several host-to-device copies;
at hundreds of streams new segments come by the hundred a second. Here every segment's text ids
cross to the device in one copy and go through the text projection in one call, and what never
changes (the tts bos/eos/pad embeddings, the codec tags of a language and speaker with the text
track beside them) is computed once and kept. The arithmetic per position is upstream's: the text
projection works row by row, so a row's embedding does not depend on the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.qwen3.models.config import Qwen3TTSConfig
from engine.qwen3.models.talker import Talker
from engine.qwen3.prompts import PromptEmbeds, PromptRequest, PromptTokens, tokenize_request
from engine.qwen3.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PromptItem:
    tokens: PromptTokens
    speaker_embedding: Tensor | None = None  # Base: x-vector [H]
    ref_codes: Tensor | None = None  # Base ICL clone: reference frames [F, G]
    non_streaming: bool = False


class PromptBuilder:
    """Builds talker prompts in batches; keeps the embeddings that depend on no text."""

    def __init__(self, talker: Talker, cfg: Qwen3TTSConfig) -> None:
        self.talker, self.cfg = talker, cfg
        self.device = talker.codec_head.weight.device
        self.dtype = talker.codec_head.weight.dtype
        self._trio: tuple[Tensor, Tensor, Tensor] | None = None  # tts bos, eos, pad: [1, 1, H] each
        self._codec: dict[tuple[int, ...], Tensor] = {}  # codec ids -> their embeddings [1, n, H]
        self._tags: dict[tuple[int | None, int | None], tuple[Tensor, Tensor]] = {}

    @torch.no_grad()
    def build(self, items: list[PromptItem]) -> list[PromptEmbeds]:
        for item in items:
            if len(item.tokens.text_ids) < 9:
                raise ValueError("text ids must hold the assistant ChatML frame around at least one token")
            if item.ref_codes is not None and item.tokens.ref_ids is None:
                raise ValueError("reference codes given without reference text ids")
        texts = self._embed_texts(items)
        return [self._build_one(item, text) for item, text in zip(items, texts, strict=True)]

    # -- what every prompt shares --------------------------------------------------------------
    def _ids(self, values: list[int]) -> Tensor:
        # copied without waiting for the GPU: prompts are built while a step still runs
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def trio(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._trio is None:
            cfg = self.cfg
            rows = self.talker.embed_text(self._ids([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id])[None])
            self._trio = (rows[:, 0:1], rows[:, 1:2], rows[:, 2:3])
        return self._trio

    def codec_rows(self, ids: tuple[int, ...]) -> Tensor:
        rows = self._codec.get(ids)
        if rows is None:
            rows = self._codec[ids] = self.talker.embed_codec(self._ids(list(ids))[None])
        return rows

    def _codec_track(self, tokens: PromptTokens, speaker_embedding: Tensor | None) -> tuple[Tensor, Tensor]:
        """(text track + codec track over the tag positions but the last [1, C-1, H], the last
        codec tag [1, 1, H]); kept per language and preset speaker."""
        key = (tokens.language_id, tokens.speaker_id)
        if speaker_embedding is None and key in self._tags:
            return self._tags[key]
        tc = self.cfg.talker
        if tokens.language_id is None:
            tags: tuple[int, ...] = (tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id)
        else:
            tags = (tc.codec_think_id, tc.codec_think_bos_id, tokens.language_id, tc.codec_think_eos_id)
        parts = [self.codec_rows(tags)]
        if speaker_embedding is not None:
            parts.append(
                speaker_embedding.to(device=self.device, dtype=self.dtype, non_blocking=True).view(1, 1, -1)
            )
        elif tokens.speaker_id is not None:
            parts.append(self.codec_rows((tokens.speaker_id,)))
        parts.append(self.codec_rows((tc.codec_pad_id, tc.codec_bos_id)))
        codec = torch.cat(parts, dim=1)
        tts_bos, _, tts_pad = self.trio()
        text_track = torch.cat((tts_pad.expand(-1, codec.shape[1] - 2, -1), tts_bos), dim=1)
        track = (text_track + codec[:, :-1], codec[:, -1:])
        if speaker_embedding is None:
            self._tags[key] = track
        return track

    # -- per prompt ----------------------------------------------------------------------------
    def _embed_texts(self, items: list[PromptItem]) -> list[dict[str, Tensor]]:
        """Every item's text, reference text and instruction ids through one text projection."""
        names: list[tuple[int, str, int]] = []
        flat: list[int] = []
        for i, item in enumerate(items):
            t = item.tokens
            for name, ids in (("text", t.text_ids), ("ref", t.ref_ids), ("instruct", t.instruct_ids)):
                if ids is not None and (name != "ref" or item.ref_codes is not None):
                    names.append((i, name, len(ids)))
                    flat += ids
        out: list[dict[str, Tensor]] = [{} for _ in items]
        if not flat:
            return out
        embedded = self.talker.embed_text(self._ids(flat)[None])  # [1, sum, H]
        for (i, name, _), part in zip(names, embedded.split([n for _, _, n in names], dim=1), strict=True):
            out[i][name] = part
        return out

    def _build_one(self, item: PromptItem, text: dict[str, Tensor]) -> PromptEmbeds:
        tokens, tc = item.tokens, self.cfg.talker
        _, tts_eos, tts_pad = self.trio()
        mid, codec_last = self._codec_track(tokens, item.speaker_embedding)
        embedded = text["text"]
        prompt = torch.cat((embedded[:, :3], mid), dim=1)
        if item.ref_codes is not None:
            icl, trailing = self._icl(
                embedded[:, 3:-5], text["ref"][:, 3:-2], item.ref_codes, item.non_streaming
            )
            prompt = torch.cat((prompt, icl), dim=1)
        elif item.non_streaming:
            text_block = torch.cat((embedded[:, 3:-5], tts_eos), dim=1) + self.codec_rows((tc.codec_pad_id,))
            start = tts_pad + self.codec_rows((tc.codec_bos_id,))
            prompt = torch.cat((prompt, text_block, start), dim=1)
            trailing = tts_pad
        else:
            prompt = torch.cat((prompt, embedded[:, 3:4] + codec_last), dim=1)
            trailing = torch.cat((embedded[:, 4:-5], tts_eos), dim=1)
        if "instruct" in text:
            prompt = torch.cat((text["instruct"], prompt), dim=1)
        return PromptEmbeds(prefill=prompt[0], trailing=trailing[0], tts_pad=tts_pad[0, 0])

    def _icl(
        self, text_embeds: Tensor, ref_embeds: Tensor, ref_codes: Tensor, non_streaming: bool
    ) -> tuple[Tensor, Tensor]:
        """Reference text + text against codec bos + the reference frames (voice clone)."""
        talker, tc = self.talker, self.cfg.talker
        _, tts_eos, tts_pad = self.trio()
        codes = ref_codes.to(self.device, non_blocking=True)
        text = torch.cat((ref_embeds, text_embeds, tts_eos), dim=1)
        frames = torch.cat(
            [talker.embed_codec(codes[:, :1])]
            + [
                talker.code_predictor.embed_group(g, codes[:, g : g + 1])
                for g in range(1, tc.num_code_groups)
            ],
            dim=1,
        ).sum(1)[None]
        codec = torch.cat((self.codec_rows((tc.codec_bos_id,)), frames), dim=1)
        text_len, codec_len = text.shape[1], codec.shape[1]
        if non_streaming:
            return torch.cat((text + self.codec_rows((tc.codec_pad_id,)), codec + tts_pad), dim=1), tts_pad
        if text_len > codec_len:
            return text[:, :codec_len] + codec, text[:, codec_len:]
        padded = torch.cat([text] + [tts_pad] * (codec_len - text_len), dim=1)
        return padded + codec, tts_pad


def build_prompt_embeds(
    talker: Talker,
    cfg: Qwen3TTSConfig,
    tokens: PromptTokens,
    *,
    speaker_embedding: Tensor | None = None,
    ref_codes: Tensor | None = None,
    non_streaming: bool = False,
) -> PromptEmbeds:
    """One request's talker prompt (same arithmetic, in the same order, as upstream)."""
    item = PromptItem(
        tokens, speaker_embedding=speaker_embedding, ref_codes=ref_codes, non_streaming=non_streaming
    )
    return PromptBuilder(talker, cfg).build([item])[0]


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
