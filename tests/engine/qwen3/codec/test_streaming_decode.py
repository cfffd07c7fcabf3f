"""Streamed Code2Wav output equals the offline decode of the same codes, for any chunk schedule,
for sequences longer than the 72-frame attention window, and for many slots in one batch."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from engine.qwen3.models import window_attention
from engine.qwen3.models.codec import RING_FRAMES
from tests.engine.qwen3.codec.conftest import SAMPLES_PER_FRAME, random_codes

FRAMES = 200
TOL = 2e-5


def chunks(schedule: list[int], total: int) -> list[int]:
    """Chunk sizes following `schedule` (its last entry repeats) until `total` frames."""
    out, i = [], 0
    while sum(out) < total:
        out.append(min(schedule[min(i, len(schedule) - 1)], total - sum(out)))
        i += 1
    return out


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return random_codes(4, FRAMES, seed=7)


@pytest.fixture(scope="module")
def offline(codec: Any, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return codec.decode(codes)


def stream(codec: Any, slot: int, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    slots = torch.tensor([slot])
    codec.reset(slots)
    pieces, at = [], 0
    with torch.no_grad():
        for n in sizes:
            pieces.append(codec.decode_step(slots, codes[None, at : at + n])[0])
            at += n
    return torch.cat(pieces)


@pytest.mark.parametrize(
    ("schedule", "frames"),
    [
        ([1], 100),
        ([2], FRAMES),
        ([4], FRAMES),
        ([8], FRAMES),
        ([25], FRAMES),
        ([1, 2, 4, 8, 25], FRAMES),
        ([3, 1, 7, 2, 30, 5, 11], FRAMES),
        ([100], FRAMES),
    ],
    ids=["1", "2", "4", "8", "25", "growing", "irregular", "longer-than-window"],
)
def test_streamed_equals_offline(
    codec: Any, codes: torch.Tensor, offline: torch.Tensor, schedule: list[int], frames: int
) -> None:
    codec.init_streams(3)
    wav = stream(codec, 1, codes[0, :frames], chunks(schedule, frames))
    assert wav.shape == (frames * SAMPLES_PER_FRAME,)
    expected = offline[0, : frames * SAMPLES_PER_FRAME]
    assert expected.abs().max() > 0.1  # not silence
    torch.testing.assert_close(wav, expected, atol=TOL, rtol=0)


def test_many_slots_interleaved_with_different_schedules(
    codec: Any, codes: torch.Tensor, offline: torch.Tensor
) -> None:
    """Each round, rows that want the same chunk size are decoded together in one batch."""
    schedules = {5: [1, 2, 4, 8, 25], 0: [25], 3: [2, 3, 5], 6: [8, 1, 16]}  # slot -> schedule
    rows = dict(zip(schedules, range(4), strict=True))  # slot -> row of `codes`
    codec.init_streams(8)
    codec.reset(torch.tensor(list(schedules)))
    plan = {s: chunks(sched, FRAMES) for s, sched in schedules.items()}
    done = dict.fromkeys(schedules, 0)
    out: dict[int, list[torch.Tensor]] = defaultdict(list)
    rounds = 0
    with torch.no_grad():
        while any(plan.values()):
            groups: dict[int, list[int]] = defaultdict(list)
            for slot, sizes in plan.items():
                if sizes:
                    groups[sizes.pop(0)].append(slot)
            for n, slots in groups.items():
                batch = torch.stack([codes[rows[s], done[s] : done[s] + n] for s in slots])
                wav = codec.decode_step(torch.tensor(slots), batch)
                for i, s in enumerate(slots):
                    out[s].append(wav[i])
                    done[s] += n
            rounds += 1
    assert rounds > 1
    for slot, row in rows.items():
        torch.testing.assert_close(torch.cat(out[slot]), offline[row], atol=TOL, rtol=0)


def test_reset_starts_a_slot_afresh(codec: Any, codes: torch.Tensor, offline: torch.Tensor) -> None:
    codec.init_streams(2)
    stream(codec, 0, codes[1, :90], [30, 30, 30])  # leaves history and a full window behind
    wav = stream(codec, 0, codes[0, :80], [8] * 10)  # stream() resets first
    torch.testing.assert_close(wav, offline[0, : 80 * SAMPLES_PER_FRAME], atol=TOL, rtol=0)


def test_a_slots_state_copied_into_others_continues_like_the_original(
    codec: Any, codes: torch.Tensor, offline: torch.Tensor
) -> None:
    codec.init_streams(4)
    stream(codec, 0, codes[2, :90], [25, 25, 40])  # past the attention window
    state = codec.slot_state(0)
    codec.reset(torch.tensor([2, 3]))
    codec.load_slot_state(torch.tensor([2, 3]), state)
    with torch.no_grad():
        wav = codec.decode_step(torch.tensor([0, 2, 3]), codes[2, 90:110].expand(3, -1, -1))
        stream(codec, 1, codes[1, :10], [10])  # another slot's work leaves the copies alone
        later = codec.decode_step(torch.tensor([3]), codes[2, 110:130][None])[0]
    expected = offline[2, 90 * SAMPLES_PER_FRAME : 110 * SAMPLES_PER_FRAME]
    for row in wav:
        torch.testing.assert_close(row, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(
        later, offline[2, 110 * SAMPLES_PER_FRAME : 130 * SAMPLES_PER_FRAME], atol=TOL, rtol=0
    )


def test_grouped_query_attention_streams_as_offline() -> None:
    """A decoder whose attention has fewer key/value heads than query heads streams, through the
    ring, what it decodes offline."""
    from engine.qwen3.models.codec import Code2Wav
    from tests.engine.qwen3.codec.conftest import liven_decoder, tiny_tokenizer_config_dict

    cfg = dict(tiny_tokenizer_config_dict()["decoder_config"], num_attention_heads=4, num_key_value_heads=2)
    codec = Code2Wav(cfg).eval()
    liven_decoder(codec)
    codes = random_codes(1, 30, seed=3)
    codec.init_streams(2)
    with torch.no_grad():
        offline = codec.decode(codes)[0]
    streamed = stream(codec, 1, codes[0], chunks([1, 4, 25], 30))
    assert offline.abs().max() > 1e-3
    torch.testing.assert_close(streamed, offline, atol=TOL, rtol=0)


def test_state_is_bounded_and_per_slot(codec: Any) -> None:
    codec.init_streams(5)
    assert codec.max_slots == 5
    per_slot = codec.state_bytes_per_slot()
    cfg = codec.cfg
    # each attention layer's ring holds the window and the longest chunk the kernel takes
    ring = window_attention.ring_size(cfg.sliding_window, RING_FRAMES)
    assert ring >= cfg.sliding_window - 1 + RING_FRAMES
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * ring * cfg.attn_head_dim * 4
    assert kv < per_slot < kv + 200_000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager(codec: Any, codes: torch.Tensor, offline: torch.Tensor) -> None:
    import copy

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # fp32 convs, so graph output can match the CPU decode
    try:
        _graph_check(copy.deepcopy(codec).cuda(), codes, offline)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _graph_check(model: Any, codes: torch.Tensor, offline: torch.Tensor) -> None:
    model.init_streams(4)
    slots = torch.tensor([0, 2], device="cuda")
    static_codes = torch.zeros(2, 4, 16, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model.decode_step(slots, static_codes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_wav = model.decode_step(slots, static_codes)
    model.reset(slots)
    pieces = []
    for at in range(0, 100, 4):
        static_codes.copy_(codes[:2, at : at + 4].cuda())
        graph.replay()
        pieces.append(static_wav.clone())
    wav = torch.cat(pieces, dim=1).cpu()
    torch.testing.assert_close(wav, offline[:2, : 100 * SAMPLES_PER_FRAME], atol=1e-4, rtol=0)


def test_bf16_streaming_tracks_fp32(codec: Any, codes: torch.Tensor, offline: torch.Tensor) -> None:
    """bf16 weights, state and activations: streamed output stays within bf16 noise of fp32."""
    import copy

    model = copy.deepcopy(codec).to(torch.bfloat16)
    model.init_streams(2)
    wav = stream(model, 1, codes[0, :100], [1, 2, 4, 8, 25, 25, 25, 10]).float()
    assert model.positions is not None and int(model.positions[1]) == 100
    expected = offline[0, : 100 * SAMPLES_PER_FRAME]
    assert torch.corrcoef(torch.stack([wav, expected]))[0, 1] > 0.998
    assert (wav - expected).abs().max() < 0.2


def test_config_reads_checkpoint_dicts() -> None:
    from engine.qwen3.models.codec import Code2WavConfig

    raw = {
        "codebook_dim": 512,
        "hidden_size": 512,
        "head_dim": 64,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "model_type": "",
        "_attn_implementation_autoset": True,
    }
    cfg = Code2WavConfig.from_dict(raw)
    assert (cfg.samples_per_frame, cfg.attn_head_dim, cfg.sliding_window) == (1920, 64, 72)
    with pytest.raises(ValueError, match="codebook_dim"):
        Code2WavConfig.from_dict({"hidden_size": 512})


def test_steps_never_build_autograd_history(codec: Any, codes: torch.Tensor) -> None:
    codec.init_streams(2)
    slots = torch.tensor([0])
    codec.reset(slots)
    wav = codec.decode_step(slots, codes[:1, :2])  # called without no_grad on purpose
    assert not wav.requires_grad and not codec.pre_transformer.kv[0][0].requires_grad
    assert not codec.decode(codes[:1, :2]).requires_grad


def test_snake_parameters_are_derived_once_and_again_after_the_weights_change() -> None:
    from engine.qwen3.models.codec import SnakeBeta

    torch.manual_seed(0)
    act = SnakeBeta(8)
    with torch.no_grad():
        act.alpha.normal_()
        act.beta.normal_()
    x = torch.randn(2, 5, 8)  # [batch, time, channels]

    def eager(x: torch.Tensor) -> torch.Tensor:
        alpha, inv_beta = act.alpha.exp(), 1 / (act.beta.exp() + 1e-9)
        return x + inv_beta * torch.sin(x * alpha) ** 2

    with torch.no_grad():
        first = act(x)
        kept = act._params()[0]
        assert act._params()[0] is kept  # no new tensors while the weights stay
        act.alpha.add_(0.5)  # an in-place change (as load_state_dict makes)
        changed = act(x)
        torch.testing.assert_close(changed, eager(x))
    assert not torch.allclose(first, changed)
    act(x).sum().backward()  # with autograd on, the derived values keep their graph
    assert act.alpha.grad is not None and act.beta.grad is not None


def test_conv_weights_are_channels_last_and_stay_so_after_a_load_that_replaces_them() -> None:
    """The layout cuDNN takes without converting: [out, in, kernel] with `in` innermost in memory."""
    from engine.qwen3.models.codec import CausalConv, Code2Wav
    from tests.engine.qwen3.codec.conftest import tiny_tokenizer_config_dict

    codec = Code2Wav(tiny_tokenizer_config_dict()["decoder_config"])
    convs = [m.conv for m in codec.modules() if isinstance(m, CausalConv) and m.conv.kernel_size[0] > 1]
    assert convs and all(c.weight.permute(0, 2, 1).is_contiguous() for c in convs if c.in_channels > 1)
    state = {k: v.contiguous().clone() for k, v in codec.state_dict().items()}
    codec.load_state_dict(state, assign=True)  # plain contiguous tensors in place of the laid-out ones
    assert not all(c.weight.permute(0, 2, 1).is_contiguous() for c in convs if c.in_channels > 1)
    codec.init_streams(2)
    assert all(c.weight.permute(0, 2, 1).is_contiguous() for c in convs if c.in_channels > 1)
