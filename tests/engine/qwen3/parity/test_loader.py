"""Checkpoint loading: tensor names, config validation, clear errors for incomplete directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.qwen3.loader import CheckpointError, load_qwen3_tts
from engine.qwen3.models.config import ConfigError, parse_config, parse_generation_config


def test_state_dict_keys_equal_checkpoint(checkpoints: dict, bundles: dict) -> None:
    for kind, path in checkpoints.items():
        with safe_open(str(path / "model.safetensors"), framework="pt") as st:
            names = {k[len("talker.") :] for k in st.keys() if k.startswith("talker.")}
            some = next(iter(names))
            stored = st.get_tensor("talker." + some)
        talker = bundles[kind].talker
        assert set(talker.state_dict()) == names
        assert torch.equal(talker.state_dict()[some], stored)


def test_bundle_contents(bundles: dict) -> None:
    b = bundles["custom_voice"]
    assert b.config.tts_model_type == "custom_voice" and b.generation.top_k == 50
    assert b.generation.repetition_penalty == pytest.approx(1.05) and b.generation.min_new_tokens == 2
    assert b.config.talker.codec_eos_id == 2150 and b.config.talker.control_id_start == 2048
    assert "ryan" in b.config.speakers and "sichuan_dialect" not in b.config.languages
    assert bundles["voice_design"].speaker_encoder is None


def test_missing_files_are_all_named(checkpoints: dict, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoints["custom_voice"], broken)
    for name in ("vocab.json", "generation_config.json", "speech_tokenizer/model.safetensors"):
        (broken / name).unlink()
    with pytest.raises(CheckpointError) as err:
        load_qwen3_tts(broken)
    for name in ("vocab.json", "generation_config.json", "speech_tokenizer/model.safetensors"):
        assert name in str(err.value)
    assert "merges.txt" not in str(err.value)
    with pytest.raises(CheckpointError, match="not found"):
        load_qwen3_tts(tmp_path / "nowhere")


def test_wrong_tensors_rejected(checkpoints: dict, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoints["voice_design"], broken)
    raw = json.loads((broken / "config.json").read_text())
    raw["talker_config"]["num_hidden_layers"] = 3
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="missing"):
        load_qwen3_tts(broken)


def test_config_validation(bundles: dict) -> None:
    raw = bundles["custom_voice"].config.raw
    bad_heads = json.loads(json.dumps(raw))
    bad_heads["talker_config"]["num_key_value_heads"] = 3
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        parse_config(bad_heads)
    no_type = {k: v for k, v in raw.items() if k != "tts_model_type"}
    with pytest.raises(ConfigError, match="tts_model_type"):
        parse_config(no_type)
    with pytest.raises(ConfigError, match="temperature"):
        parse_generation_config({"temperature": 0})
    assert parse_generation_config({}).max_new_tokens == 2048
