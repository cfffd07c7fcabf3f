"""The multi-token predictor (MTP): a small Qwen3 decoder that, per frame, turns the talker's last
hidden state and the codebook-0 code into the 15 remaining codebook codes, one after another.

`generate` runs the whole 15-step loop for a batch on fixed shapes over its own small static cache,
with on-device sampling, so a runner can capture it as one CUDA graph per batch size.
State-dict keys equal the checkpoint's `talker.code_predictor.*` keys with that prefix stripped.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.qwen3.models.config import CodePredictorConfig
from engine.qwen3.models.layers import DecoderStack, KVCache
from engine.qwen3.models.sampler import SamplingParams, sample


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg: CodePredictorConfig, embedding_dim: int) -> None:
        super().__init__(cfg.shape)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, embedding_dim) for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_groups = cfg.num_code_groups
        self.model = CodePredictorModel(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.shape.hidden_size, cfg.vocab_size, bias=False)
            for _ in range(cfg.num_code_groups - 1)
        )
        self.small_to_mtp_projection: nn.Module
        if cfg.shape.hidden_size != talker_hidden:
            self.small_to_mtp_projection = nn.Linear(talker_hidden, cfg.shape.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()

    @property
    def cache_len(self) -> int:
        """Positions one frame uses: the talker hidden, codebook 0, then codebooks 1..14."""
        return self.num_groups

    def allocate_cache(self, batch: int, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        return KVCache.allocate(self.cfg.shape, batch, self.cache_len, device, dtype)

    def embed_group(self, group: int, ids: Tensor) -> Tensor:
        """Embedding of codebook `group` (1..15) codes, in the talker's hidden size."""
        return self.model.codec_embedding[group - 1](ids)

    def generate(
        self,
        talker_hidden: Tensor,
        first_embed: Tensor,
        params: SamplingParams,
        seed: Tensor,
        counter: Tensor,
        cache: KVCache | None = None,
        bounded: bool = False,
    ) -> Tensor:
        """talker_hidden [B, H] (last talker hidden state), first_embed [B, H] (talker codec embedding
        of the codebook-0 code) -> codes [B, G-1] for codebooks 1..G-1.

        counter [B]: the row's noise counter for this frame; codebook j draws with counter + j.
        cache: a cache from `allocate_cache` with at least B slots (allocated when None).
        bounded: every sampling row's top_k is within the bounded sampler's set (engine.qwen3.models.sampler)."""
        b = talker_hidden.shape[0]
        if cache is None:
            cache = self.allocate_cache(b, talker_hidden.device, talker_hidden.dtype)
        # row i uses cache row i and all rows share positions: the cache is read and written as slices
        x = self.small_to_mtp_projection(torch.stack((talker_hidden, first_embed), dim=1))
        positions = torch.arange(2, device=x.device).expand(b, 2)
        hidden = self.model.run_layers(x, positions, cache, None, 2)
        codes = []
        ids = sample(self.lm_head[0](hidden[:, -1]), params, seed, counter + 1, bounded)
        codes.append(ids)
        for group in range(1, self.num_groups - 1):
            x = self.small_to_mtp_projection(self.embed_group(group, ids)[:, None])
            positions = torch.full((b, 1), group + 1, device=x.device, dtype=torch.int64)
            hidden = self.model.run_layers(x, positions, cache, None, group + 2)
            ids = sample(self.lm_head[group](hidden[:, 0]), params, seed, counter + group + 1, bounded)
            codes.append(ids)
        return torch.stack(codes, dim=1)
