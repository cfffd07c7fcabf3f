"""CUDA graphs for the aligner's two transformer stacks.

An aligner call is a chain of about a thousand small kernels. Launched one by one from Python they
take more host time than GPU time, and beside a TTS engine's step thread each launch also waits for
the interpreter. So the encoder's attention stack and the decoder are captured once per packed
shape (aligner.layout: the row-count buckets, encoder rows one full window long, decoder rows of
128, 256 or 512 tokens) and replayed; the few kernels around them (log-mel, the convolutions, the
gathers, the head) stay eager. A shape past the largest captured runs eagerly on the same packed
rows, so a call's result does not depend on whether a graph replayed it. The decoder's graph holds
the head too: it runs over every position, so no call meets a GEMM of a new shape.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from aligner.layout import DECODER_WIDTHS, ROW_BUCKETS
from engine.qwen3.cuda_graphs import GraphBank

ENCODER_ROWS = 128  # windows in one call; 128 full windows hold about 17 minutes of audio
DECODER_TOKENS = 64 * 256  # rows x length; 64 prompts of 256 tokens


class AlignerGraphs:
    """The audio encoder's `attend` and the model's `position_classes` (the decoder and its head,
    aligner.qwen3), replayed from graphs over static buffers."""

    def __init__(self, tower: nn.Module, model: nn.Module, enabled: bool = True) -> None:
        weight = model.lm_head.weight
        device, dtype = weight.device, weight.dtype
        audio, text = tower.cfg, model.cfg.text
        self._tower = tower
        self._classify = model.position_classes
        self.window = tower.full_window
        self._attend_bank = GraphBank(device, enabled)
        self._decode_bank = GraphBank(device, enabled)
        tokens = ENCODER_ROWS * self.window
        self._audio_in = torch.zeros(tokens, audio.d_model, device=device, dtype=dtype)
        self._audio_segments = torch.zeros(tokens, device=device, dtype=torch.long)
        self._audio_out = torch.zeros(tokens, audio.output_dim, device=device, dtype=dtype)
        self._embeds = torch.zeros(DECODER_TOKENS, text.hidden, device=device, dtype=dtype)
        self._positions = torch.zeros(DECODER_TOKENS, device=device, dtype=torch.long)
        self._segments = torch.zeros(DECODER_TOKENS, device=device, dtype=torch.long)
        self._classes = torch.zeros(DECODER_TOKENS, device=device, dtype=torch.long)
        self.replays = 0

    @property
    def attend_shapes(self) -> list[int]:
        return [rows for rows in ROW_BUCKETS if rows <= ENCODER_ROWS]

    @property
    def decode_shapes(self) -> list[tuple[int, int]]:
        return [
            (rows, width)
            for width in DECODER_WIDTHS
            for rows in ROW_BUCKETS
            if rows * width <= DECODER_TOKENS
        ]

    def __len__(self) -> int:
        return len(self._attend_bank) + len(self._decode_bank)

    def capture(self) -> None:
        """Capture every shape, the largest first (each bank's graphs share one memory pool)."""
        for rows in sorted(self.attend_shapes, reverse=True):
            self._attend_bank.capture(rows, functools.partial(self._attend_static, rows))
        for rows, width in sorted(self.decode_shapes, key=lambda shape: shape[0] * shape[1], reverse=True):
            self._decode_bank.capture((rows, width), functools.partial(self._decode_static, rows, width))

    def attend(self, x: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        rows, length = segments.shape
        graph = self._attend_bank.graphs.get(rows) if length == self.window else None
        if graph is None:
            return self._tower.attend(x, segments)
        tokens = rows * length
        self._audio_in[:tokens].copy_(x.reshape(tokens, -1))
        self._audio_segments[:tokens].copy_(segments.reshape(-1))
        graph.replay()
        self.replays += 1
        return self._audio_out[:tokens]

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        rows, width = segments.shape
        graph = self._decode_bank.graphs.get((rows, width))
        if graph is None:
            return self._classify(embeds, positions, segments)
        tokens = rows * width
        self._embeds[:tokens].copy_(embeds.reshape(tokens, -1))
        self._positions[:tokens].copy_(positions.reshape(-1))
        self._segments[:tokens].copy_(segments.reshape(-1))
        graph.replay()
        self.replays += 1
        return self._classes[:tokens].view(rows, width)

    def _attend_static(self, rows: int) -> None:
        tokens = rows * self.window
        shape = (rows, self.window)
        out = self._tower.attend(
            self._audio_in[:tokens].view(*shape, -1), self._audio_segments[:tokens].view(shape)
        )
        self._audio_out[:tokens].copy_(out)

    def _decode_static(self, rows: int, width: int) -> None:
        tokens = rows * width
        shape = (rows, width)
        out = self._classify(
            self._embeds[:tokens].view(*shape, -1),
            self._positions[:tokens].view(shape),
            self._segments[:tokens].view(shape),
        )
        self._classes[:tokens].copy_(out.reshape(tokens))
