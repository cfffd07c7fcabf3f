"""The Qwen3-TTS talker: a Qwen3 decoder over a dual-track input (text projection + codec
embedding), whose `codec_head` predicts codebook 0 of each 80 ms frame; the code predictor fills in
the other codebooks.

State-dict keys equal the checkpoint's `talker.*` keys with the `talker.` prefix stripped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.qwen3.models.code_predictor import CodePredictor
from engine.qwen3.models.config import TalkerConfig
from engine.qwen3.models.layers import DecoderStack, KVCache
from engine.qwen3.models.sampler import SamplingParams


class TalkerModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.shape)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """text_hidden -> text_hidden -> talker hidden, SiLU, with bias."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.hidden_size)

    def reset_rope(self, device: torch.device | str) -> None:
        self.model.reset_rope(device)
        self.code_predictor.model.reset_rope(device)

    def allocate_cache(
        self, slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        return KVCache.allocate(self.cfg.shape, slots, max_len, device, dtype)

    def embed_text(self, ids: Tensor) -> Tensor:
        """Text track: text ids [..., T] -> [..., T, H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: Tensor) -> Tensor:
        """Codec track: talker codec ids (codebook 0 and control ids) -> [..., H]."""
        return self.model.codec_embedding(ids)

    def frame_embedding(self, codes: Tensor) -> Tensor:
        """codes [B, G] (all codebooks of one frame) -> the sum of their embeddings [B, H]."""
        parts = [self.embed_codec(codes[:, 0])]
        parts += [self.code_predictor.embed_group(g, codes[:, g]) for g in range(1, codes.shape[1])]
        return torch.stack(parts, dim=1).sum(dim=1)

    def forward(
        self,
        embeds: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: Tensor,
        kv_len: int,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """embeds [B, T, H], positions [B, T] (padded entries at the cache's last, scratch position), slots [B]
        -> final hidden states [B, T, H]. Writes the rows' keys/values into their cache slots.
        lengths [B]: for one-token decode on CUDA, the positions each row attends (decode kernel)."""
        return self.model.run_layers(embeds, positions, cache, slots, kv_len, lengths)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.codec_head(hidden)

    def predict_codes(
        self,
        hidden: Tensor,
        first_codes: Tensor,
        params: SamplingParams,
        seed: Tensor,
        counter: Tensor,
        cache: KVCache | None = None,
        bounded: bool = False,
    ) -> Tensor:
        """hidden [B, H] (the talker state that produced codebook 0), first_codes [B]
        -> all codebooks of the frame [B, G]."""
        first_embed = self.embed_codec(first_codes)
        rest = self.code_predictor.generate(hidden, first_embed, params, seed, counter, cache, bounded)
        return torch.cat((first_codes[:, None], rest), dim=1)
