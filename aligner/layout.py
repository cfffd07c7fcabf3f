"""Where a batch's pieces lie on the device, planned on the host.

Both of the aligner's transformer stacks run over packed rows: the encoder's attention windows and
the decoder's prompts sit side by side in rows of one length, each attending within itself only.
No piece is padded to the batch's longest, and one row holds several short pieces. With steady
shapes (on CUDA) the row count and the decoder's row length come from a few buckets, which the
aligner's CUDA graphs cover (aligner.graphs). Padding positions belong to no piece and are never
read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from engine.qwen3.cuda_graphs import batch_buckets, bucket_for

PAD = -1  # the segment of a padding position
ROW_BUCKETS = batch_buckets(128)
DECODER_WIDTHS = (128, 256, 512)
IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def encoder_output_length(frames: IntOrArray) -> IntOrArray:
    """Audio embeddings for ``frames`` mel frames: 13 per full 100-frame chunk plus the tail's."""
    tail = frames % 100
    after_conv = (tail - 1) // 2 + 1
    tokens: IntOrArray = ((after_conv - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13
    return tokens


def conv_length(frames: int) -> int:
    return (frames - 1) // 2 + 1


def chunk_bucket(count: int) -> int:
    """Chunk counts the steady-shape encoder runs at: powers of two up to 256, then multiples of 256."""
    return 1 << max(0, count - 1).bit_length() if count <= 256 else -(-count // 256) * 256


def row_bucket(count: int) -> int:
    """Row counts with steady shapes: `batch_buckets` up to 128 rows, multiples of 128 beyond."""
    return bucket_for(count, ROW_BUCKETS) or -(-count // 128) * 128


def decoder_width(longest: int) -> int:
    """The decoder's row length with steady shapes: 128, 256 or 512 tokens, multiples of 128 beyond."""
    return bucket_for(longest, list(DECODER_WIDTHS)) or -(-longest // 128) * 128


def upload(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Host integer arrays onto ``device`` as int64 in one copy (pinned and asynchronous on CUDA)."""
    packed = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    return list(torch.split(packed, [np.size(a) for a in arrays]))


@dataclass(frozen=True)
class PackedRows:
    """Pieces placed first-fit, in order, into rows of ``length`` positions."""

    length: int
    starts: np.ndarray  # flat (row, position) index of every piece's first position
    placed: np.ndarray  # flat index of every piece's every position, piece after piece
    segments: np.ndarray  # (rows, length): the piece at every position, PAD where none
    offsets: np.ndarray  # (rows, length): every position's place within its piece, 0 where none

    @classmethod
    def pack(cls, sizes: Sequence[int], length: int, steady: bool = False) -> PackedRows:
        if any(size > length for size in sizes):
            raise ValueError(f"a piece of {max(sizes)} positions does not fit rows of {length}")
        room: list[int] = []
        starts = np.empty(len(sizes), np.int64)
        for piece, size in enumerate(sizes):
            row = next((r for r, left in enumerate(room) if left >= size), len(room))
            if row == len(room):
                room.append(length)
            starts[piece] = row * length + length - room[row]
            room[row] -= size
        rows = max(1, len(room))
        rows = row_bucket(rows) if steady else rows
        counts = np.asarray(sizes, np.int64)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = np.repeat(starts, counts) + within
        segments = np.full(rows * length, PAD, np.int64)
        segments[flat] = np.repeat(np.arange(len(sizes)), counts)
        offsets = np.zeros(rows * length, np.int64)
        offsets[flat] = within
        return cls(length, starts, flat, segments.reshape(rows, length), offsets.reshape(rows, length))

    @property
    def rows(self) -> int:
        return self.segments.shape[0]


@dataclass(frozen=True)
class EncoderLayout:
    """Where a batch's mel chunks, their tokens and the attention windows lie (host arrays).

    Items are cut into chunks of ``chunk_frames``; each chunk gives ``encoder_output_length`` tokens;
    an item's tokens, back to back, are cut into windows of ``ratio`` times its widest chunk's
    tokens (or one window per item), and the windows are packed into rows.
    """

    width: int  # frames of the longest chunk: chunks are padded to it
    chunk_item: np.ndarray
    chunk_start: np.ndarray
    chunk_length: np.ndarray
    chunk_solo: np.ndarray  # the chunk is its item's only one
    token_source: np.ndarray  # flat (chunk, token) index of every kept token, in item order
    token_target: np.ndarray  # flat (row, position) index of the same token
    windows: PackedRows
    item_tokens: list[int]

    @classmethod
    def plan(
        cls,
        frame_counts: Sequence[int],
        chunk_frames: int,
        ratio: int,
        windowed: bool,
        steady_shapes: bool = False,
    ) -> EncoderLayout:
        per_item = [-(-frames // chunk_frames) for frames in frame_counts]
        chunk_item = np.repeat(np.arange(len(frame_counts)), per_item)
        first_chunk = np.cumsum([0, *per_item[:-1]])
        chunk_index = np.arange(len(chunk_item)) - first_chunk[chunk_item]
        chunk_start = chunk_index * chunk_frames
        chunk_length = np.minimum(chunk_frames, np.asarray(frame_counts)[chunk_item] - chunk_start)
        chunk_solo = (np.asarray(per_item) == 1)[chunk_item]
        width = chunk_frames if steady_shapes else int(chunk_length.max())
        slots = conv_length(conv_length(conv_length(width)))
        chunk_tokens = encoder_output_length(chunk_length)
        first_token = np.cumsum(chunk_tokens) - chunk_tokens
        token_chunk = np.repeat(np.arange(len(chunk_item)), chunk_tokens)
        token_source = token_chunk * slots + np.arange(len(token_chunk)) - first_token[token_chunk]

        item_tokens = np.bincount(chunk_item, weights=chunk_tokens, minlength=len(frame_counts)).astype(
            np.int64
        )
        widest = np.zeros(len(frame_counts), np.int64)
        np.maximum.at(widest, chunk_item, chunk_tokens)
        span = widest * ratio if windowed else item_tokens
        item_windows = -(-item_tokens // span)
        first_window = np.cumsum(item_windows) - item_windows
        token_item = chunk_item[token_chunk]
        position = np.arange(len(token_chunk)) - np.repeat(np.cumsum(item_tokens) - item_tokens, item_tokens)
        token_window = first_window[token_item] + position // span[token_item]
        window_sizes = np.bincount(token_window, minlength=int(item_windows.sum()))
        # Steady rows are a full window long, whatever the batch, so their shapes are few.
        full_window = encoder_output_length(chunk_frames) * ratio
        length = full_window if steady_shapes and windowed else int(window_sizes.max())
        windows = PackedRows.pack(window_sizes.tolist(), length, steady_shapes)
        if steady_shapes:  # empty chunks after the real ones, masked like a lone short chunk
            extra = chunk_bucket(len(chunk_item)) - len(chunk_item)
            chunk_item, chunk_start, chunk_length = (
                np.pad(a, (0, extra)) for a in (chunk_item, chunk_start, chunk_length)
            )
            chunk_solo = np.pad(chunk_solo, (0, extra), constant_values=True)
        return cls(
            width,
            chunk_item,
            chunk_start,
            chunk_length,
            chunk_solo,
            token_source,
            windows.placed,  # tokens in item order are the windows' positions, window after window
            windows,
            item_tokens.tolist(),
        )


@dataclass(frozen=True)
class DecoderLayout:
    """Every item's prompt packed into the decoder's rows, and where its audio and slots lie."""

    ids: np.ndarray  # (rows, length)
    rows: PackedRows  # positions restart at 0 in every prompt
    audio_at: np.ndarray  # flat positions of the audio tokens, in item order
    slots_at: np.ndarray  # flat positions of the timestamp slots, in item order
    slots: list[int]  # slots per item

    @classmethod
    def plan(
        cls, prompts: Sequence[Sequence[int]], audio_token: int, slot_token: int, steady_shapes: bool
    ) -> DecoderLayout:
        longest = max(len(prompt) for prompt in prompts)
        rows = PackedRows.pack(
            [len(prompt) for prompt in prompts],
            decoder_width(longest) if steady_shapes else longest,
            steady_shapes,
        )
        tokens = np.concatenate([np.asarray(prompt, np.int64) for prompt in prompts])
        ids = np.zeros(rows.segments.size, np.int64)
        ids[rows.placed] = tokens
        is_slot = tokens == slot_token
        owner = np.repeat(np.arange(len(prompts)), [len(prompt) for prompt in prompts])
        return cls(
            ids.reshape(rows.segments.shape),
            rows,
            rows.placed[tokens == audio_token],
            rows.placed[is_slot],
            np.bincount(owner[is_slot], minlength=len(prompts)).tolist(),
        )
