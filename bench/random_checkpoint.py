"""Write a Qwen3-TTS-12Hz checkpoint directory in the upstream layout with RANDOM weights.

No real weights can be downloaded where Cadence is benchmarked, so the benchmark serves a random
checkpoint at the real shapes (compute does not depend on weight values; audio is noise) and forces
each request's length. The text tokenizer is a byte-level BPE trained on the benchmark corpus with
the ChatML / tts special tokens at their real ids, so prompts have realistic token counts.

    python bench/random_checkpoint.py --size 1.7B --out checkpoints/qwen3-1.7b-random
    python bench/random_checkpoint.py --size tiny --out checkpoints/qwen3-tiny-random   # CPU tests
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.qwen3.models.codec import Code2Wav  # noqa: E402
from engine.qwen3.models.config import parse_config  # noqa: E402
from engine.qwen3.models.talker import Talker  # noqa: E402

SPECIAL_IDS = {  # Qwen2 / Qwen3-TTS special tokens (real ids)
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
}
SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
LANGUAGES = {"english": 2050, "chinese": 2055}

CODE_PREDICTOR = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=5,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)
CODE2WAV = dict(
    codebook_dim=512,
    latent_dim=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    decoder_dim=1536,
)
SHAPES = {  # talker, code predictor, Code2Wav decoder (public config values; the two sizes differ in the talker)
    "1.7B": (
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            text_vocab_size=151936,
            text_hidden_size=2048,
        ),
        CODE_PREDICTOR,
        CODE2WAV,
    ),
    "0.6B": (
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            text_vocab_size=151936,
            text_hidden_size=2048,
        ),
        CODE_PREDICTOR,
        CODE2WAV,
    ),
    "tiny": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            text_vocab_size=151936,
            text_hidden_size=32,
        ),
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        ),
        dict(
            codebook_dim=16,
            latent_dim=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            decoder_dim=32,
        ),
    ),
}
MIMI_ENCODER = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=2048,
    num_filters=64,
    num_quantizers=32,
    codebook_dim=256,
    upsampling_ratios=[8, 6, 5, 4],
    sliding_window=250,
    sampling_rate=24000,
    frame_rate=12.5,
)
MIMI_TINY = dict(
    hidden_size=32,
    num_filters=4,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    upsample_groups=32,
    codebook_size=2048,
    codebook_dim=16,
    vector_quantization_hidden_dimension=16,
    num_quantizers=16,
    upsampling_ratios=[8, 6, 5, 4],
)


def model_config(size: str) -> dict:
    talker, cp, _ = SHAPES[size]
    rope = talker["head_dim"] // 2
    mrope = [rope - 2 * (rope * 5 // 16), rope * 5 // 16, rope * 5 // 16]  # [24, 20, 20] at head_dim 128
    common = dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768)
    talker_cfg = dict(
        talker,
        **common,
        vocab_size=3072,
        num_code_groups=16,
        position_id_per_seconds=13,
        codec_pad_id=2148,
        codec_bos_id=2149,
        codec_eos_token_id=2150,
        codec_think_id=2154,
        codec_nothink_id=2155,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        codec_language_id=LANGUAGES,
        spk_id=SPEAKERS,
        spk_is_dialect={k: False for k in SPEAKERS},
        rope_scaling=dict(mrope_section=mrope, interleaved=True, rope_type="default"),
        code_predictor_config=dict(cp, **common, vocab_size=2048, num_code_groups=16),
    )
    return dict(
        model_type="qwen3_tts",
        architectures=["Qwen3TTSForConditionalGeneration"],
        tts_model_type="custom_voice",
        tts_model_size="1b7" if size == "1.7B" else "0b6",
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        im_start_token_id=151644,
        im_end_token_id=151645,
        tts_pad_token_id=151671,
        tts_bos_token_id=151672,
        tts_eos_token_id=151673,
        talker_config=talker_cfg,
    )


def speech_tokenizer_config(size: str) -> dict:
    decoder = dict(
        SHAPES[size][2],
        codebook_size=2048,
        num_quantizers=16,
        sliding_window=72,
        rope_theta=10000.0,
        layer_scale_initial_scale=0.01,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
    )
    return dict(
        model_type="qwen3_tts_tokenizer_12hz",
        input_sample_rate=24000,
        output_sample_rate=24000,
        encode_downsample_rate=1920,
        decode_upsample_rate=1920,
        encoder_valid_num_quantizers=16,
        decoder_config=decoder,
        encoder_config=MIMI_TINY if size == "tiny" else MIMI_ENCODER,
    )


def write_tokenizer(out: Path, corpus: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from engine.qwen3.tokenizer import QWEN2_PATTERN, build_bpe

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines() if line]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = build_bpe({}, [], QWEN2_PATTERN).pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.model.save(str(out))  # vocab.json + merges.txt
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": {str(i): {"content": t, **entry} for t, i in SPECIAL_IDS.items()},
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 32768,
                "tokenizer_class": "Qwen2Tokenizer",
            },
            indent=1,
        )
    )


def cpu_state(module: torch.nn.Module, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().to("cpu", dtype).contiguous() for k, v in module.state_dict().items()}


@torch.no_grad()
def write_checkpoint(out: Path, size: str, device: str, corpus: Path, seed: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "speech_tokenizer").mkdir(exist_ok=True)
    torch.manual_seed(seed)
    config = model_config(size)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps(
            dict(
                do_sample=True,
                temperature=0.9,
                top_k=50,
                top_p=1.0,
                repetition_penalty=1.05,
                subtalker_dosample=True,
                subtalker_temperature=0.9,
                subtalker_top_k=50,
                subtalker_top_p=1.0,
                max_new_tokens=8192,
            ),
            indent=1,
        )
    )
    write_tokenizer(out, corpus, vocab_size=400 if size == "tiny" else 8000)

    weight_dtype = torch.float32 if size == "tiny" else torch.bfloat16
    with torch.device(device):
        talker = Talker(parse_config(config).talker)
        for name, p in talker.named_parameters():
            if "embedding" in name:
                p.normal_(0.0, 0.02)
    save_file(cpu_state(talker, "talker.", weight_dtype), str(out / "model.safetensors"))
    del talker

    st_cfg = speech_tokenizer_config(size)
    (out / "speech_tokenizer" / "config.json").write_text(json.dumps(st_cfg, indent=1))
    (out / "speech_tokenizer" / "preprocessor_config.json").write_text(
        json.dumps(
            dict(
                feature_extractor_type="EncodecFeatureExtractor",
                feature_size=1,
                sampling_rate=24000,
                padding_side="right",
                padding_value=0.0,
                return_attention_mask=True,
            ),
            indent=1,
        )
    )
    with torch.device(device):
        decoder = Code2Wav(st_cfg["decoder_config"])
        for name, p in decoder.named_parameters():
            if name.endswith("embedding_sum"):
                p.normal_()  # zero codebooks decode to silence
    weights = cpu_state(decoder, "decoder.", torch.float32)
    from engine.qwen3.models.speech_tokenizer import build_mimi_encoder

    weights.update(cpu_state(build_mimi_encoder(st_cfg["encoder_config"]), "encoder.", torch.float32))
    save_file(weights, str(out / "speech_tokenizer" / "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SHAPES), default="1.7B")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--corpus", type=Path, default=ROOT / "deploy" / "bench" / "corpus.jsonl")
    args = ap.parse_args()
    t = time.perf_counter()
    write_checkpoint(args.out, args.size, args.device, args.corpus)
    print(f"wrote {args.size} random checkpoint to {args.out} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
