"""Loading the checkpoint layout, its error messages, and the aligner end to end without the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from aligner.api import AlignedWord, Aligner
from aligner.layout import encoder_output_length
from aligner.model import AlignerConfig, ForcedAlignerModel
from aligner.qwen3 import Qwen3ForcedAligner, check_checkpoint
from aligner.repair import repair_monotonic
from tests.aligner.conftest import noise

TINY_CONFIG = {
    "model_type": "qwen3_asr",
    "timestamp_token_id": 503,
    "timestamp_segment_time": 80,
    "thinker_config": {
        "model_type": "qwen3_forced_aligner",
        "classify_num": 5000,
        "audio_token_id": 502,
        "audio_start_token_id": 500,
        "audio_end_token_id": 501,
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": 32,
            "n_window": 50,
            "n_window_infer": 800,
            "downsample_hidden_size": 8,
        },
        "text_config": {
            "vocab_size": 504,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rope_theta": 1e6,
        },
    },
}


def write_checkpoint(root: Path, shards: int = 1) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world, the aligner times every word"] * 5, trainer)
    tokenizer.model.save(str(root))
    torch.manual_seed(0)
    model = ForcedAlignerModel(AlignerConfig.from_json(TINY_CONFIG))
    state = {f"thinker.{name}": tensor.contiguous() for name, tensor in model.state_dict().items()}
    if shards == 1:
        save_file(state, str(root / "model.safetensors"))
        return root
    names = sorted(state)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[shard::shards]}
        save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_missing_directory_and_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        check_checkpoint(tmp_path / "absent")
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(FileNotFoundError) as error:
        Qwen3ForcedAligner.from_directory(tmp_path, device="cpu")
    message = str(error.value)
    for name in ("vocab.json", "merges.txt", "model.safetensors"):
        assert name in message
    assert "config.json" not in message.split("missing:")[1]


def test_missing_shard_and_missing_tensor_are_named(tmp_path):
    root = write_checkpoint(tmp_path / "sharded", shards=2)
    (root / "model-00002-of-00002.safetensors").rename(root / "elsewhere.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        Qwen3ForcedAligner.from_directory(root, device="cpu")

    root = write_checkpoint(tmp_path / "single")
    from safetensors.torch import load_file

    state = load_file(str(root / "model.safetensors"))
    del state["thinker.lm_head.weight"]
    save_file(state, str(root / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        Qwen3ForcedAligner.from_directory(root, device="cpu")


def test_non_aligner_config_is_refused():
    raw = json.loads(json.dumps(TINY_CONFIG))
    raw["thinker_config"]["model_type"] = "qwen3_asr_thinker"
    with pytest.raises(ValueError, match="not a forced-aligner"):
        AlignerConfig.from_json(raw)


def test_sharded_checkpoint_aligns_a_batch(tmp_path):
    aligner = Qwen3ForcedAligner.from_directory(write_checkpoint(tmp_path / "ckpt", shards=3), device="cpu")
    assert isinstance(aligner, Aligner)
    assert aligner.max_audio_s == 400.0
    texts = ["Hello world, the aligner!", "你好，世界。", "— …"]
    batch = [
        (noise(1.2, 24000, 1), 24000, texts[0], "English"),
        (noise(9.5, 16000, 2), 16000, texts[1], "Chinese"),
        (noise(0.3, 8000, 3), 8000, texts[2], "English"),
    ]
    results = aligner.align(batch)
    assert [[w.text for w in words] for words in results] == [
        ["Hello", "world,", "the", "aligner!"],
        ["你", "好，", "世", "界。"],
        [],
    ]
    for (_, _, text, _), words in zip(batch, results, strict=True):
        assert all(isinstance(w, AlignedWord) and text[w.char_start : w.char_end] == w.text for w in words)
        times = [t for w in words for t in (w.start_s, w.end_s)]
        assert times == sorted(times) and all(0 <= t <= aligner.max_audio_s for t in times)
    assert aligner.align([]) == []
    with pytest.raises(ValueError, match="limit"):
        aligner.align([(np.zeros(16000 * 401, dtype=np.float32), 16000, "hi", "English")])


def test_encoder_output_length_counts_chunk_tokens():
    assert [encoder_output_length(n) for n in (1, 8, 50, 99, 100, 101, 250, 1200)] == [
        1,
        1,
        7,
        13,
        13,
        14,
        33,
        156,
    ]


def test_repair_monotonic_rules():
    assert repair_monotonic([]) == []
    assert repair_monotonic([80, 160, 240]) == [80, 160, 240]
    # one outlier snaps to its nearer trusted neighbour (left on a tie)
    assert repair_monotonic([80, 160, 900, 240, 320]) == [80, 160, 160, 240, 320]
    # two outliers: the first takes the left value, the second the right one
    assert repair_monotonic([80, 160, 0, 0, 400, 480]) == [80, 160, 160, 400, 400, 480]
    # longer runs are interpolated between trusted neighbours (then truncated)
    assert repair_monotonic([0, 900, 950, 990, 100, 200, 300, 400]) == [0, 25, 50, 75, 100, 200, 300, 400]
    # an outlier run at the start takes the first trusted value
    assert repair_monotonic([500, 80, 160, 240]) == [80, 80, 160, 240]


@pytest.mark.reference
def test_repair_monotonic_equals_the_reference_on_random_sequences():
    from tests.qwen_reference import import_qwen_asr

    qwen_asr = import_qwen_asr()
    processor = qwen_asr.inference.qwen3_forced_aligner.Qwen3ForceAlignProcessor()
    rng = np.random.default_rng(5)
    for trial in range(300):
        length = int(rng.integers(1, 40))
        base = np.sort(rng.integers(0, 200, size=length)) if trial % 2 else rng.integers(0, 200, size=length)
        noisy = np.where(rng.random(length) < 0.2, rng.integers(0, 200, size=length), base)
        values = (noisy * np.float32(80.0)).astype(np.float32)
        assert repair_monotonic(values.tolist()) == processor.fix_timestamp(values)
