"""A full cyclic garbage collection's pause in a process that holds what an engine worker holds
(torch, the engine's modules, a Code2Wav at the real decoder shapes), before and after gc.freeze().
The engine worker's step thread stops for the whole pause.

    .venv/bin/python -m bench.gc_pause
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.qwen3.engine  # noqa: E402,F401
import engine.qwen3.runner  # noqa: E402,F401
from bench.gpu_codec_bench import REAL_DECODER  # noqa: E402
from engine.qwen3.models.codec import Code2Wav  # noqa: E402


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    model = Code2Wav(REAL_DECODER)
    full_collection_ms()
    print(
        f"tracked objects: {len(gc.get_objects())} (Code2Wav: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params)"
    )
    print("full collection, ms:", [round(full_collection_ms(), 1) for _ in range(3)])
    gc.freeze()
    print(f"frozen: {gc.get_freeze_count()} objects")
    print("full collection after gc.freeze(), ms:", [round(full_collection_ms(), 1) for _ in range(3)])


if __name__ == "__main__":
    main()
