#!/usr/bin/env bash
# The scaling figure of one host's GPUs behind one port: the benchmark sweep (shared/bench/README.md)
# served by one GPU, then by two, in the same run, on a two-GPU machine.
#   . bench/gpu_env.sh                   # on a bare GPU machine
#   bench/gpus.sh MODEL_DIR [OUT_DIR]
# Two GPUs are served by one gateway process per GPU on the one port (`--gateways 2`, replicas of one
# Redis) when redis-server is on the PATH, else by one gateway in front of both workers. The 2-GPU
# file's `scaling_ratio` is its headline streams over the 1-GPU run's (goal: >= 1.9). Environment:
# CONC_1 (256,512,capacity), CONC_2 (512,1024,capacity), POINT_SECONDS (10).
set -uo pipefail
model=${1:?usage: bench/gpus.sh MODEL_DIR [OUT_DIR]}
out=${2:-bench-out}
python=${PYTHON:-python3}
mkdir -p "$out"
redis_pid=""
if command -v redis-server >/dev/null; then
  redis-server --port 6390 --save "" --appendonly no --daemonize no > "$out/redis.log" 2>&1 &
  redis_pid=$!
fi
for n in 1 2; do
  port=$((8100 + n))
  extra=()
  if [ "$n" -gt 1 ] && [ -n "$redis_pid" ]; then extra=(--gateways "$n" --redis redis://127.0.0.1:6390/0); fi
  $python -m cadence.cli serve --engine qwen3 --model "$model" --gpus "$n" "${extra[@]}" --port "$port" \
    --max-streams auto --log-level warning > "$out/serve-gpus-$n.log" 2>&1 &
  server=$!
  started=$(date +%s)
  until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null; do
    kill -0 $server 2>/dev/null || { echo "cadence serve --gpus $n exited"; tail -20 "$out/serve-gpus-$n.log"; exit 1; }
    sleep 1
  done
  echo "--gpus $n ${extra[*]}: ready $(( $(date +%s) - started )) s after the server started"
  levels=$([ "$n" = 1 ] && echo "${CONC_1:-256,512,capacity}" || echo "${CONC_2:-512,1024,capacity}")
  seconds=${POINT_SECONDS:-10}
  $python -m cadence.cli bench --url "ws://127.0.0.1:$port/v1/stream" --concurrency "$levels" \
    --min-seconds "$seconds" --max-seconds "$((seconds + 15))" --warmup-seconds 5 \
    --voice ryan --language English --model-shapes 1.7B \
    --metrics-url "http://127.0.0.1:$port/metrics" -o "$out/gpus-$n.json" 2>&1 | grep -v "━" | tail -8
  kill -INT $server; sleep 3; kill -9 $server 2>/dev/null
  wait $server 2>/dev/null
done
[ -n "$redis_pid" ] && kill $redis_pid
$python - "$out" <<'PY'
import json, sys
from pathlib import Path

sys.path.insert(0, ".")
from clients.loadtest_report import headline

out = Path(sys.argv[1])
runs = {n: json.loads((out / f"gpus-{n}.json").read_text()) for n in (1, 2)}
one, two = (headline(runs[n]["points"])["concurrency"] for n in (1, 2))
ratio = round(two / one, 3) if one else None
runs[2]["scaling_ratio"] = ratio
(out / "gpus-2.json").write_text(json.dumps(runs[2], indent=1, ensure_ascii=False) + "\n")
print(f"headline streams: 1 GPU {one}, 2 GPUs {two}, scaling_ratio {ratio} (goal >= 1.9)")
PY
