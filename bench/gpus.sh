#!/usr/bin/env bash
# The scaling figure of `cadence serve --gpus`: the benchmark sweep (shared/bench/README.md) with
# one engine worker per GPU on 1 GPU, then on 2 GPUs, in the same session, on a 2-GPU machine.
#   . bench/gpu_env.sh                   # on a bare GPU machine
#   bench/gpus.sh MODEL_DIR [OUT_DIR] [GPU_NAME]
# Goal: the 2-GPU run sustains >= 1.9x the streams of the 1-GPU run at p90 RTF < 1.
set -euo pipefail
model=${1:?usage: bench/gpus.sh MODEL_DIR [OUT_DIR] [GPU_NAME]}
out=${2:-deploy/bench}
gpu=${3:-H200}
python=${PYTHON:-python3}
mkdir -p "$out"
for n in 1 2; do
  port=$((8100 + n))
  $python -m cadence.cli serve --engine qwen3 --model "$model" --gpus "$n" --port "$port" \
    --max-streams 1024 --log-level warning &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null; do
    kill -0 $server || { echo "cadence serve --gpus $n exited" >&2; exit 1; }
    sleep 2
  done
  $python -m cadence.cli bench --url "ws://127.0.0.1:$port/v1/stream" --gpu "${n}x$gpu" \
    --concurrency 1,32,64,128,256,384,512,768,1024,1536,2048 --stop-rtf 1.0 \
    --metrics-url "http://127.0.0.1:$port/metrics" -o "$out/gpus-$n.json"
  kill -TERM $server; wait $server || true
  trap - EXIT
done
$python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def best(path):
    points = json.loads(path.read_text())["points"]
    ok = [p for p in points if p["rtf_p90"] is not None and p["rtf_p90"] < 1.0]
    return max((p["concurrency"] for p in ok), default=0)
one, two = best(out / "gpus-1.json"), best(out / "gpus-2.json")
print(f"streams at p90 RTF < 1: 1 GPU {one}, 2 GPUs {two}, scaling {two / one if one else float('nan'):.2f}x (goal >= 1.9x)")
PY
