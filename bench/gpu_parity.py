"""Parity of our Qwen3-TTS talker / code predictor (and codec, when present) with the reference
package at the real 1.7B shapes (random weights), plus single-stream TTFA / RTF of the offline loop.

    python bench/gpu_parity.py                 # real 1.7B shapes on the GPU
    python bench/gpu_parity.py --tiny          # toy shapes (CPU smoke test)

Needs the reference `qwen_tts` 0.1.1 importable with transformers 4.57.x (the GPU image has
transformers 5.x: put qwen-tts 0.1.1 (--no-deps), transformers 4.57.3, tokenizers 0.22.2 and
huggingface_hub 0.36.2 in a target directory first on PYTHONPATH, plus librosa/soundfile/soxr/
audioread/pooch/decorator/platformdirs/cffi/pycparser/sox wheels; see research/baseline.md, option B).

Checks (one table at the end):
  fp32  greedy codes identical to the reference (CustomVoice, non-streaming and streaming text)
  bf16  talker prefill logits relative error vs the reference in bf16 (stated tolerance), and the
        share of greedy frames equal to the fp32 reference before the first divergence
  codec Code2Wav decode vs the reference decoder (only if engine.qwen3.models.codec is importable)
  perf  bf16 batch 1: time to the first frame (prefill + 1 frame) and RTF over 150 forced frames
"""

from __future__ import annotations

import argparse
import importlib.machinery
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BF16_LOGITS_REL_TOL = 0.05  # ||ours - ref|| / ||ref|| on talker prefill logits, both in bf16


def stub_missing(name: str) -> None:
    """The reference imports modules only its 25 Hz tokenizer uses; stub them if absent."""
    try:
        __import__(name)
    except Exception:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
        if name == "torchaudio":
            comp, kaldi = (
                types.ModuleType("torchaudio.compliance"),
                types.ModuleType("torchaudio.compliance.kaldi"),
            )
            for m in (comp, kaldi):
                m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
            mod.compliance, comp.kaldi = comp, kaldi  # type: ignore[attr-defined]
            sys.modules.update({"torchaudio.compliance": comp, "torchaudio.compliance.kaldi": kaldi})


def reference_config(tiny: bool):  # noqa: ANN201
    from qwen_tts.core.models import Qwen3TTSConfig

    if tiny:
        h, layers, heads, kv, hd, inter, mrope = 64, 2, 4, 2, 16, 128, [4, 2, 2]
        ch, cl, cheads, ckv, chd, ci, text_hidden = 32, 2, 2, 1, 16, 64, 32
    else:
        h, layers, heads, kv, hd, inter, mrope = 2048, 28, 16, 8, 128, 6144, [24, 20, 20]
        ch, cl, cheads, ckv, chd, ci, text_hidden = 1024, 5, 16, 8, 128, 3072, 2048
    cp = dict(
        vocab_size=2048,
        hidden_size=ch,
        intermediate_size=ci,
        num_hidden_layers=cl,
        num_attention_heads=cheads,
        num_key_value_heads=ckv,
        head_dim=chd,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        num_code_groups=16,
        pad_token_id=None,
    )
    talker = dict(
        code_predictor_config=cp,
        vocab_size=3072,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        rope_scaling={"interleaved": True, "mrope_section": mrope, "rope_type": "default"},
        num_code_groups=16,
        text_hidden_size=text_hidden,
        text_vocab_size=151936,
        codec_bos_id=2149,
        codec_eos_token_id=2150,
        codec_think_id=2154,
        codec_nothink_id=2155,
        codec_pad_id=2148,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        codec_language_id={"english": 2050, "chinese": 2055},
        spk_id={"ryan": 3061},
        spk_is_dialect={"ryan": False},
    )
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config={"enc_dim": h, "sample_rate": 24000},
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="1b7",
        tts_model_type="custom_voice",
    )


def prompt_ids(words: int) -> list[int]:
    """ChatML frame with real special ids around `words` arbitrary text ids."""
    body = [1000 + (i * 7919) % 150000 for i in range(words)]
    return [151644, 77091, 198, *body, 151645, 198, 151644, 77091, 198]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--frames", type=int, default=30, help="greedy frames compared")
    ap.add_argument("--perf-frames", type=int, default=150)
    args = ap.parse_args()
    for name in ("torchaudio", "sox", "onnxruntime"):
        stub_missing(name)
    import transformers
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    from engine.qwen3.generate import GenerationRequest, generate_codes
    from engine.qwen3.models.config import GenerationDefaults, parse_config
    from engine.qwen3.models.talker import Talker
    from engine.qwen3.prompt_builder import build_prompt_embeds
    from engine.qwen3.prompts import PromptTokens

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[tuple[str, str, str]] = []
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  device {device}", flush=True)

    torch.manual_seed(0)
    ref_cfg = reference_config(args.tiny)
    with torch.device(device):
        ref = Qwen3TTSForConditionalGeneration._from_config(
            ref_cfg, dtype=torch.float32, attn_implementation="sdpa"
        )
    ref.eval()
    ref.load_generate_config({})
    cfg = parse_config(ref_cfg.to_dict())
    with torch.device("meta"):
        ours = Talker(cfg.talker)
    ours.load_state_dict({k: v.detach().clone() for k, v in ref.talker.state_dict().items()}, assign=True)
    ours.reset_rope(device)
    ours.eval()
    defaults = GenerationDefaults()
    ids = prompt_ids(40)

    def ours_codes(non_streaming: bool, frames: int, forced: bool = False) -> torch.Tensor:
        tokens = PromptTokens(
            text_ids=ids, instruct_ids=None, ref_ids=None, language_id=2050, speaker_id=3061
        )
        prompt = build_prompt_embeds(ours, cfg, tokens, non_streaming=non_streaming)
        req = GenerationRequest(
            prompt=prompt, greedy=True, **({"forced_frames": frames} if forced else {"max_frames": frames})
        )
        return generate_codes(ours, [req], defaults)[0]

    def ref_codes(non_streaming: bool, frames: int) -> torch.Tensor:
        codes, _ = ref.generate(
            input_ids=[torch.tensor([ids], device=device)],
            languages=["english"],
            speakers=["ryan"],
            non_streaming_mode=non_streaming,
            max_new_tokens=frames + 1,
            do_sample=False,
            subtalker_dosample=False,
        )
        return codes[0]

    fp32_ref = {}
    for ns in (True, False):
        a, b = ref_codes(ns, args.frames), ours_codes(ns, args.frames)
        fp32_ref[ns] = a
        same = a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        rows.append(
            (
                f"fp32 greedy codes ({'non-' if ns else ''}streaming text)",
                f"{a.shape[0]} frames",
                "IDENTICAL" if same else f"DIFFER (first frame {first_diff(a, b)})",
            )
        )
        print(rows[-1], flush=True)

    # bf16
    ref.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    tokens = PromptTokens(text_ids=ids, instruct_ids=None, ref_ids=None, language_id=2050, speaker_id=3061)
    prompt = build_prompt_embeds(ours, cfg, tokens, non_streaming=True)
    with torch.no_grad():
        embeds = prompt.prefill[None]
        n = embeds.shape[1]
        cache = ours.allocate_cache(1, n + 2, device, torch.bfloat16)
        mine = ours.logits(
            ours(
                embeds,
                torch.arange(n, device=device)[None],
                cache,
                torch.zeros(1, dtype=torch.long, device=device),
                n,
            )
        ).float()
        theirs = ref.talker(
            inputs_embeds=embeds,
            attention_mask=torch.ones(1, n, dtype=torch.long, device=device),
            use_cache=False,
        ).logits.float()
    rel = float((mine - theirs).norm() / theirs.norm())
    rows.append(
        (
            "bf16 talker prefill logits rel. error",
            f"tol {BF16_LOGITS_REL_TOL}",
            f"{rel:.4f} {'OK' if rel < BF16_LOGITS_REL_TOL else 'ABOVE TOL'}",
        )
    )
    b16_ref, b16_ours = ref_codes(True, args.frames), ours_codes(True, args.frames)
    for name, codes in (("reference", b16_ref), ("ours", b16_ours)):
        agree = first_diff(fp32_ref[True], codes)
        rows.append(
            (
                f"bf16 {name}: greedy frames equal to fp32 ref before divergence",
                f"of {args.frames}",
                str(agree),
            )
        )
    rows.append(
        ("bf16 ours vs bf16 reference: first differing frame", "", str(first_diff(b16_ref, b16_ours)))
    )

    rows.append(codec_row(ref, device))

    # perf (bf16, batch 1, offline loop)
    for _ in range(2):
        ours_codes(True, 3, forced=True)
    sync()
    t = time.perf_counter()
    ours_codes(True, 1, forced=True)
    sync()
    ttfa = time.perf_counter() - t
    sync()
    t = time.perf_counter()
    out = ours_codes(True, args.perf_frames, forced=True)
    sync()
    wall = time.perf_counter() - t
    audio = out.shape[0] * 1920 / 24000
    rows.append(("perf b1 bf16: first frame (prefill + 1 frame, no decode)", "", f"{ttfa * 1e3:.1f} ms"))
    rows.append(
        (
            f"perf b1 bf16: {out.shape[0]} forced frames",
            f"{audio:.1f} s audio",
            f"{wall:.2f} s wall, RTF {wall / audio:.3f}, {wall / out.shape[0] * 1e3:.1f} ms/frame",
        )
    )

    width = max(len(r[0]) for r in rows)
    print("\n" + "-" * (width + 50))
    for name, ref_note, result in rows:
        print(f"{name:<{width}}  {ref_note:<16}  {result}")


def first_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading frames that are equal."""
    n = min(a.shape[0], b.shape[0])
    eq = (a[:n].cpu() == b[:n].cpu()).all(dim=1)
    bad = (~eq).nonzero()
    return int(bad[0]) if len(bad) else n


def codec_row(ref: object, device: str) -> tuple[str, str, str]:
    try:
        from engine.qwen3.models import codec  # noqa: F401
    except ImportError:
        return ("codec decode parity", "", "skipped (engine.qwen3.models.codec not present)")
    return ("codec decode parity", "", "not run here: use the audio engineer's codec parity script")


if __name__ == "__main__":
    main()
