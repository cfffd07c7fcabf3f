"""bench/random_aligner_checkpoint.py: the tiny folder it writes loads and aligns like a real one; the
full-size folder has the published Qwen3-ForcedAligner-0.6B shapes (checked without allocating)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aligner.api import Aligner
from aligner.model import AlignerConfig, AudioEncoderConfig, TextDecoderConfig
from aligner.qwen3 import Qwen3ForcedAligner, check_checkpoint, load_word_tokenizer
from bench.random_aligner_checkpoint import SPECIAL_IDS, build_model, model_config, write_tokenizer_config
from tests.aligner.conftest import noise

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "random_aligner_checkpoint.py"
FULL_PARAMETERS = 917_728_896  # the published model's count (its embedding: 152 064 x 1024)
FULL_TENSORS = 708
FILES = {
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "model.safetensors",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("random_aligner") / "tiny"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], check=True, capture_output=True
    )
    return out


def test_the_tiny_folder_holds_the_real_layout_and_aligns(tiny: Path) -> None:
    assert {p.name for p in tiny.iterdir()} == FILES
    check_checkpoint(tiny)
    aligner = Qwen3ForcedAligner.from_directory(tiny, device="cpu")
    assert isinstance(aligner, Aligner) and aligner.max_audio_s == 400.0
    text_en, text_zh = "Sure, I can help you with that.", "今天天气很好。"
    english, chinese = aligner.align(
        [(noise(2.0, 24000, 1), 24000, text_en, "English"), (noise(1.5, 16000, 2), 16000, text_zh, "Chinese")]
    )
    assert [w.text for w in english] == text_en.split()
    assert [w.text for w in chinese] == ["今", "天", "天", "气", "很", "好。"]
    for text, words in ((text_en, english), (text_zh, chinese)):
        assert all(text[w.char_start : w.char_end] == w.text for w in words)
        times = [t for w in words for t in (w.start_s, w.end_s)]
        assert times == sorted(times) and all(0 <= t <= aligner.max_audio_s for t in times)


def test_the_tiny_folders_tensors_are_the_upstream_names_and_the_token_ids_fit(tiny: Path) -> None:
    from safetensors import safe_open

    raw = json.loads((tiny / "config.json").read_text())
    cfg = AlignerConfig.from_json(raw)
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    model = build_model(raw, "meta", 0, tiny=True)
    assert names == {f"thinker.{name}" for name in model.state_dict()}
    words = load_word_tokenizer(tiny).get_vocab_size()
    specials = [cfg.audio_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id, cfg.timestamp_token_id]
    assert words <= min(specials) and max(specials) < cfg.text.vocab_size  # prompt ids index the embedding
    decoder = json.loads((tiny / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert decoder[str(cfg.timestamp_token_id)]["content"] == "<timestamp>"
    assert decoder[str(cfg.audio_token_id)]["content"] == "<|audio_pad|>"


def test_the_full_config_has_the_published_shapes_and_ids() -> None:
    raw = model_config("full", dict(SPECIAL_IDS), 8000)
    cfg = AlignerConfig.from_json(raw)
    assert cfg.audio == AudioEncoderConfig()  # 24 layers, d_model 1024, 16 heads, FFN 4096, conv 480
    assert cfg.text == TextDecoderConfig()  # 28 layers, hidden 1024, 16 / 8 heads, vocabulary 152 064
    assert (cfg.classes, cfg.slot_ms) == (5000, 80.0)
    assert (cfg.audio_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id, cfg.timestamp_token_id) == (
        151676,
        151669,
        151670,
        151705,
    )
    assert raw["thinker_config"]["text_config"]["rope_scaling"]["mrope_section"] == [24, 20, 20]
    model = build_model(raw, "meta", 0, tiny=False)
    assert sum(p.numel() for p in model.parameters()) == FULL_PARAMETERS
    state = model.state_dict()
    assert len(state) == FULL_TENSORS
    assert state["model.embed_tokens.weight"].shape == (152064, 1024)
    assert state["lm_head.weight"].shape == (5000, 1024)
    assert state["audio_tower.conv_out.weight"].shape == (1024, 480 * 16)


def test_the_full_tokenizer_config_names_the_real_ids(tmp_path: Path) -> None:
    write_tokenizer_config(tmp_path, dict(SPECIAL_IDS))
    decoder = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {int(i): entry["content"] for i, entry in decoder.items()} == {
        i: t for t, i in SPECIAL_IDS.items()
    }


@pytest.mark.reference
def test_the_reference_loads_the_tiny_folder_and_agrees(tiny: Path) -> None:
    from tests.qwen_reference import import_qwen_asr

    qwen_asr = import_qwen_asr()
    reference = qwen_asr.Qwen3ForcedAligner.from_pretrained(str(tiny), dtype=torch.float32, device_map="cpu")
    ours = Qwen3ForcedAligner.from_directory(tiny, device="cpu")
    audio, text = noise(2.5, 16000, 3), "the quick brown fox jumps over the lazy dog"
    (theirs,) = reference.align(audio=(audio, 16000), text=text, language="English")
    (mine,) = ours.align([(audio, 16000, text, "English")])
    assert [(i.text, i.start_time, i.end_time) for i in theirs] == [
        (w.text, w.start_s, w.end_s) for w in mine
    ]


@pytest.mark.reference
def test_the_full_tensor_names_and_shapes_are_the_references() -> None:
    from tests.qwen_reference import import_qwen_asr

    import_qwen_asr()
    from qwen_asr.core.transformers_backend import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    raw = model_config("full", dict(SPECIAL_IDS), 8000)
    fields = {k: v for k, v in raw.items() if k in ("thinker_config", "timestamp_token_id")}
    with torch.device("meta"):
        reference = Qwen3ASRForConditionalGeneration(Qwen3ASRConfig(**fields))
    theirs = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    ours = {
        f"thinker.{name}": tuple(t.shape)
        for name, t in build_model(raw, "meta", 0, False).state_dict().items()
    }
    assert ours == theirs


@pytest.mark.parametrize("forced", [False, True])
async def test_serve_options_load_the_folder_with_forced_times_on_request(tiny: Path, forced: bool) -> None:
    from cadence.cli import _serve_parser
    from cadence.engines import EngineOptions, build_engine
    from engine.alignment.forced_times import ForcedTimesAligner

    flags = ["--aligner", str(tiny)] + (["--aligner-forced-times"] if forced else [])
    args = _serve_parser().parse_args(flags)
    assert args.aligner_forced_times is forced
    options = EngineOptions(name="null", aligner=args.aligner, aligner_forced_times=forced, device="cpu")
    engine = build_engine(options)
    await engine.start()
    try:
        aligner = engine.worker.aligner  # type: ignore[attr-defined]
    finally:
        await engine.stop()
    assert isinstance(aligner, ForcedTimesAligner) is forced
    model = aligner.inner if forced else aligner
    assert isinstance(model, Qwen3ForcedAligner)
    (words,) = aligner.align([(noise(2.0, 24000, 1), 24000, "One two three.", "English")])
    if forced:  # 14 characters a second: the last unit ends at 1.0 s
        assert [(w.start_s, w.end_s) for w in words] == [(0.0, 0.214), (0.286, 0.5), (0.571, 1.0)]
