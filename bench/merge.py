"""Put the reference side-by-side figures into a Cadence benchmark JSON, with the ratio.

python bench/merge.py BENCH.json REFERENCE.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def merge(bench_path: Path, reference_path: Path) -> dict:
    bench = json.loads(bench_path.read_text())
    reference = json.loads(reference_path.read_text())
    bench["reference"] = reference
    ours = max((p.get("audio_s_per_s") or 0.0 for p in bench.get("points", [])), default=0.0)
    theirs = max((p.get("audio_s_per_s") or 0.0 for p in reference.get("points", [])), default=0.0)
    bench["reference_ratio"] = {
        "audio_s_per_s_ours": ours,
        "audio_s_per_s_reference": theirs,
        "ratio": (ours / theirs) if theirs else None,
        "note": "best audio-s/s over the sweep against the reference's best static batch, same GPU, same run",
    }
    bench_path.write_text(json.dumps(bench, indent=1))
    return bench["reference_ratio"]


if __name__ == "__main__":
    print(json.dumps(merge(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
