"""Packed rows: where the aligner's windows and prompts lie (host arrays only)."""

from __future__ import annotations

import numpy as np
import pytest

from aligner.layout import (
    PAD,
    ROW_BUCKETS,
    DecoderLayout,
    EncoderLayout,
    PackedRows,
    decoder_width,
    row_bucket,
)


def pieces_of(packed: PackedRows, sizes: list[int]) -> list[list[int]]:
    """Every piece's flat positions, read back from the segment map."""
    flat = packed.segments.ravel()
    return [np.flatnonzero(flat == piece).tolist() for piece in range(len(sizes))]


@pytest.mark.parametrize("steady", [False, True])
def test_pieces_fill_rows_first_fit_without_overlap_or_crossing_a_row(steady):
    sizes = [30, 80, 31, 40, 104, 3, 1, 60, 44]
    packed = PackedRows.pack(sizes, 104, steady)
    for piece, (size, positions) in enumerate(zip(sizes, pieces_of(packed, sizes), strict=True)):
        start = int(packed.starts[piece])
        assert positions == list(range(start, start + size))
        assert start // 104 == (start + size - 1) // 104  # inside one row
        assert packed.offsets.ravel()[positions].tolist() == list(range(size))
    assert np.count_nonzero(packed.segments != PAD) == sum(sizes)
    # first fit: 30+31+40+3 fill the first row, 80+1 the second, 104 the third, 60+44 the fourth
    assert [int(s) // 104 for s in packed.starts] == [0, 1, 0, 0, 2, 0, 1, 3, 3]
    assert packed.rows == (row_bucket(4) if steady else 4)


def test_a_piece_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        PackedRows.pack([10, 105], 104)


def test_row_buckets_and_decoder_widths_cover_the_count():
    assert ROW_BUCKETS[:5] == [1, 2, 4, 8, 16] and ROW_BUCKETS[-1] == 128
    for count in range(1, 300):
        assert row_bucket(count) >= count
    assert row_bucket(129) == 256
    assert [decoder_width(n) for n in (1, 128, 129, 300, 513)] == [128, 128, 256, 512, 640]


def test_steady_encoder_rows_are_full_windows_and_hold_every_token_once():
    frames = [45, 260, 930, 20, 2400]
    exact = EncoderLayout.plan(frames, 100, 8, windowed=True)
    steady = EncoderLayout.plan(frames, 100, 8, windowed=True, steady_shapes=True)
    assert steady.windows.length == 104 and steady.windows.rows in ROW_BUCKETS
    assert exact.windows.length == int(np.bincount(exact.windows.segments[exact.windows.segments >= 0]).max())
    for layout in (exact, steady):
        assert len(set(layout.token_target.tolist())) == len(layout.token_target) == sum(layout.item_tokens)
        # a token's row segment is one window, and one item's windows are never shared with another
        segment = layout.windows.segments.ravel()[layout.token_target]
        items = np.repeat(np.arange(len(frames)), layout.item_tokens)
        for window in np.unique(segment):
            assert len(set(items[segment == window].tolist())) == 1
    assert steady.item_tokens == exact.item_tokens


def test_decoder_prompts_keep_their_order_and_count_positions_from_their_own_start():
    audio, slot = 7, 9
    prompts = [[1, 7, 7, 2, 5, 9, 9], [1, 7, 2, 9, 9], [1, *([7] * 20), 2, 5, 6, 9, 9, 4, 9, 9]]
    for steady in (False, True):
        layout = DecoderLayout.plan(prompts, audio, slot, steady)
        width = layout.ids.shape[1]
        assert width == (128 if steady else 29)
        flat_ids = layout.ids.ravel()
        for piece, prompt in enumerate(prompts):
            start = int(layout.rows.starts[piece])
            assert flat_ids[start : start + len(prompt)].tolist() == prompt
            assert layout.rows.offsets.ravel()[start : start + len(prompt)].tolist() == list(
                range(len(prompt))
            )
        assert flat_ids[layout.audio_at].tolist() == [audio] * 23
        assert flat_ids[layout.slots_at].tolist() == [slot] * 8
        assert layout.slots == [2, 2, 4]
        owners = layout.rows.segments.ravel()[layout.slots_at].tolist()
        assert owners == sorted(owners)  # slots in item order, as the classes are read back
