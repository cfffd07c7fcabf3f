"""Write a Qwen3-ForcedAligner-0.6B checkpoint directory in the upstream layout with RANDOM weights.

No real weights can be downloaded where Cadence is benchmarked, so `cadence serve --aligner DIR`
is benchmarked on a random checkpoint at the real shapes: a 24-layer AuT audio encoder (d_model
1024), a 28-layer Qwen3 decoder (hidden 1024, 16 / 8 heads, vocabulary 152 064) and the 5000-class
timestamp head, 917.7 M parameters, bf16. Compute does not depend on the weights' values; the word
times they give are meaningless. The folder holds what the real one holds for the aligner: its
`config.json` (token ids, 80 ms slots), `vocab.json` + `merges.txt` (a byte-level BPE trained on the
benchmark corpus, so units take realistic token counts), `tokenizer_config.json` with the special
tokens at their real ids, `preprocessor_config.json` and one `model.safetensors` whose tensor names
are the upstream ones (`thinker.audio_tower.*`, `thinker.model.*`, `thinker.lm_head.weight`).

    python bench/random_aligner_checkpoint.py --out .cache/cadence-random-aligner
    python bench/random_aligner_checkpoint.py --tiny --out .cache/tiny-aligner   # for CPU tests
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aligner.model import AlignerConfig, ForcedAlignerModel  # noqa: E402
from aligner.qwen3 import QWEN2_SPLIT  # noqa: E402

SPECIAL_IDS = {  # Qwen2 / Qwen3-ASR special tokens the aligner's prompt uses (real ids)
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<|audio_pad|>": 151676,
    "<timestamp>": 151705,
}
LANGUAGES = [
    "Chinese",
    "English",
    "Cantonese",
    "French",
    "German",
    "Italian",
    "Japanese",
    "Korean",
    "Portuguese",
    "Russian",
    "Spanish",
]
AUDIO_SHAPES = {  # the AuT encoder (upstream audio_config names)
    "full": dict(
        encoder_layers=24,
        encoder_attention_heads=16,
        encoder_ffn_dim=4096,
        d_model=1024,
        output_dim=1024,
        downsample_hidden_size=480,
    ),
    "tiny": dict(
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        d_model=64,
        output_dim=64,
        downsample_hidden_size=32,
    ),
}
TEXT_SHAPES = {  # the Qwen3 decoder (upstream text_config names)
    "full": dict(
        vocab_size=152064,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def special_ids(size: str, vocab: int) -> dict[str, int]:
    """The real ids at full size; right after the trained vocabulary for the tiny model."""
    if size == "full":
        return dict(SPECIAL_IDS)
    return {token: vocab + i for i, token in enumerate(SPECIAL_IDS)}


def model_config(size: str, ids: dict[str, int], vocab: int) -> dict[str, Any]:
    text = dict(TEXT_SHAPES[size])
    text.setdefault("vocab_size", vocab + len(ids))
    head_dim = text["head_dim"]
    rope = head_dim // 2
    mrope = [rope - 2 * (rope * 5 // 16), rope * 5 // 16, rope * 5 // 16]  # [24, 20, 20] at head_dim 128
    return {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "dtype": "bfloat16" if size == "full" else "float32",
        "support_languages": LANGUAGES,
        "timestamp_token_id": ids["<timestamp>"],
        "timestamp_segment_time": 80,
        "thinker_config": {
            "model_type": "qwen3_forced_aligner",
            "classify_num": 5000,
            "audio_token_id": ids["<|audio_pad|>"],
            "audio_start_token_id": ids["<|audio_start|>"],
            "audio_end_token_id": ids["<|audio_end|>"],
            "initializer_range": 0.02,
            "audio_config": {
                "model_type": "qwen3_asr_audio_encoder",
                "num_mel_bins": 128,
                "n_window": 50,
                "n_window_infer": 800,
                "conv_chunksize": 500,
                "max_source_positions": 1500,
                "activation_function": "gelu",
                "scale_embedding": False,
                **AUDIO_SHAPES[size],
            },
            "text_config": {
                **text,
                "hidden_act": "silu",
                "max_position_embeddings": 65536,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1_000_000.0,
                "rope_scaling": {
                    "rope_type": "default",
                    "interleaved": True,
                    "mrope_interleaved": True,
                    "mrope_section": mrope,
                },
                "attention_bias": False,
                "tie_word_embeddings": False,
            },
        },
    }


def corpus_texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines() if line]


def write_tokenizer(out: Path, texts: list[str], vocab_size: int) -> int:
    """vocab.json + merges.txt trained with the aligner's own split; returns the vocabulary's size."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.model.save(str(out))
    return int(tokenizer.get_vocab_size())


def write_tokenizer_config(out: Path, ids: dict[str, int]) -> None:
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    audio = {
        "audio_token": "<|audio_pad|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": {str(i): {"content": t, **entry} for t, i in ids.items()},
                "additional_special_tokens": [
                    "<|audio_start|>",
                    "<|audio_end|>",
                    "<|audio_pad|>",
                    "<timestamp>",
                ],
                "extra_special_tokens": audio,
                **audio,
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "errors": "replace",
                "clean_up_tokenization_spaces": False,
                "split_special_tokens": False,
                "model_max_length": 131072,
                "processor_class": "Qwen3ASRProcessor",
                "tokenizer_class": "Qwen2Tokenizer",
            },
            indent=1,
        )
    )


def write_preprocessor_config(out: Path) -> None:
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "feature_extractor_type": "WhisperFeatureExtractor",
                "processor_class": "Qwen3ASRProcessor",
                "feature_size": 128,
                "sampling_rate": 16000,
                "hop_length": 160,
                "n_fft": 400,
                "chunk_length": 30,
                "n_samples": 480000,
                "nb_max_frames": 3000,
                "dither": 0.0,
                "padding_side": "right",
                "padding_value": 0.0,
                "return_attention_mask": False,
            },
            indent=1,
        )
    )


def build_model(
    config: dict[str, Any], device: str | torch.device, seed: int, tiny: bool
) -> ForcedAlignerModel:
    """The model at the config's shapes with random weights (on `device`; "meta" allocates nothing).

    Full size: PyTorch's default initialisation, embeddings N(0, 0.02). Tiny: larger weights, so
    hidden states depend on their context and the head's slot classes vary along the text."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = ForcedAlignerModel(AlignerConfig.from_json(config))
    if torch.device(device).type == "meta":
        return model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.02)
            elif tiny and param.dim() >= 2:
                param.normal_(0.0, 2.0 / param[0].numel() ** 0.5)
    return model


def checkpoint_state(model: ForcedAlignerModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The upstream tensor names: the thinker's, under `thinker.`."""
    return {f"thinker.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}


@torch.no_grad()
def write_checkpoint(
    out: Path,
    *,
    tiny: bool = False,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    corpus: Path = ROOT / "deploy" / "bench" / "corpus.jsonl",
    seed: int = 0,
) -> Path:
    from safetensors.torch import save_file

    size = "tiny" if tiny else "full"
    dtype = dtype or (torch.float32 if tiny else torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, corpus_texts(corpus), vocab_size=400 if tiny else 8000)
    ids = special_ids(size, vocab)
    config = model_config(size, ids, vocab)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=1))
    write_tokenizer_config(out, ids)
    write_preprocessor_config(out)
    model = build_model(config, device, seed, tiny)
    save_file(checkpoint_state(model, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of width 64 (CPU tests)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="saved dtype (bfloat16; tiny: float32)")
    ap.add_argument("--corpus", type=Path, default=ROOT / "deploy" / "bench" / "corpus.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    began = time.perf_counter()
    dtype = DTYPES[args.dtype] if args.dtype else None
    write_checkpoint(
        args.out, tiny=args.tiny, device=args.device, dtype=dtype, corpus=args.corpus, seed=args.seed
    )
    kind = "tiny" if args.tiny else "Qwen3-ForcedAligner-0.6B-shaped"
    print(f"wrote a {kind} random aligner checkpoint to {args.out} in {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
