#!/usr/bin/env bash
# The benchmark of deploy/bench/README.md on one GPU machine, in one command:
#   random checkpoint at the real shapes -> `cadence serve --engine qwen3` -> `cadence bench` sweep over
#   loopback WebSocket -> the reference qwen-tts on the same checkpoint -> merged JSON + plots -> an
#   engine-only breakdown (talker / predictor / codec graph times).
# Environment: SIZE (1.7B), CONC (1,64,256,512), POINT_SECONDS (20; seconds measured per point), REF_BATCHES (1,8), REF_FRAMES (40),
#              DEVICE (cuda), OUTDIR ($OUT or ./bench-out), SKIP_REF (set: keep an earlier
#              reference-SIZE.json in OUTDIR instead of running the reference again), SERVE_ARGS
#              (more `cadence serve` flags, e.g. "--gpus 0": the engine in the gateway's process),
#              MAX_STREAMS (auto: the KV budget's slots, admission by measured cost within them; e.g. CONC=1,256,512,capacity,1.5x,2x sweeps to twice the capacity),
#              PORT (8765), TAG (output names: bench-TAG.json; the size by default), PYSPY_AT / PYSPY_FOR (sample the server's Python stacks with py-spy during the load),
#              WARMUP_SECONDS (5: load before each point's measurement)
set -u
cd "$(dirname "$0")/.."
SIZE="${SIZE:-1.7B}"; CONC="${CONC:-1,64,256,512}"; SECONDS_PER_POINT="${POINT_SECONDS:-20}"  # not SECONDS: bash counts time in it
REF_BATCHES="${REF_BATCHES:-1,8}"; REF_FRAMES="${REF_FRAMES:-40}"; DEVICE="${DEVICE:-cuda}"
OUTDIR="${OUTDIR:-${OUT:-./bench-out}}"; mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"; CKPT="${CKPT:-.cache/cadence-random-$SIZE}"; PORT="${PORT:-8765}"
tag="${TAG:-$(echo "$SIZE" | tr 'A-Z' 'a-z')}"  # names the output files

[ -f "$CKPT/config.json" ] || $PY bench/random_checkpoint.py --size "$SIZE" --out "$CKPT" --device "$DEVICE"
$PY -m cadence.cli serve --engine qwen3 --model "$CKPT" --device "$DEVICE" --port $PORT --max-streams "${MAX_STREAMS:-auto}" ${SERVE_ARGS:-} \
  > "$OUTDIR/serve-$tag.log" 2>&1 &
server=$!
$PY - <<PYEOF || { echo "server not ready"; tail -30 "$OUTDIR/serve-$tag.log"; kill -9 $server 2>/dev/null; exit 1; }
import os, time, urllib.request
started = time.time()
for _ in range(480):  # start-up: the checkpoint's load and the graphs' capture
    try:
        os.kill($server, 0)  # a server that died at start-up is not waited for
    except OSError:
        raise SystemExit("the server exited during start-up")
    try:
        urllib.request.urlopen("http://127.0.0.1:$PORT/readyz", timeout=2)
        print(f"ready {time.time() - started:.1f} s after the server started"); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit(1)
PYEOF
if [ -n "${PYSPY_AT:-}" ]; then  # sample the server's stacks (all processes) for PYSPY_FOR s, PYSPY_AT s into the load
  (sleep "$PYSPY_AT"; py-spy record --nonblocking --pid $server --subprocesses --duration "${PYSPY_FOR:-15}" --rate 200 \
     --format raw -o "$OUTDIR/pyspy-$tag.txt" > "$OUTDIR/pyspy-$tag.log" 2>&1) &
fi
timeout 420 $PY -m cadence.cli bench --url "ws://127.0.0.1:$PORT/v1/stream" --concurrency "$CONC" \
  --min-seconds "$SECONDS_PER_POINT" --max-seconds "$((SECONDS_PER_POINT + 15))" --warmup-seconds "${WARMUP_SECONDS:-5}" \
  --voice ryan --language English --model-shapes "$SIZE" --metrics-url "http://127.0.0.1:$PORT/metrics" \
  -o "$OUTDIR/bench-$tag.json" 2>&1 | grep -v "━" | tail -25
kill -INT $server
for _ in $(seq 30); do kill -0 $server 2>/dev/null || break; sleep 0.1; done  # a clean stop, 3 s at most
kill -9 $server 2>/dev/null
tail -5 "$OUTDIR/serve-$tag.log"
[ -n "${SKIP_REF:-}" ] || timeout 150 $PY bench/reference_bench.py --model "$CKPT" --batches "$REF_BATCHES" --frames "$REF_FRAMES" \
  --device "$DEVICE" --dtype "$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)" \
  -o "$OUTDIR/reference-$tag.json" 2>&1 | grep "^{" 
[ -f "$OUTDIR/reference-$tag.json" ] && [ -f "$OUTDIR/bench-$tag.json" ] && \
  $PY bench/merge.py "$OUTDIR/bench-$tag.json" "$OUTDIR/reference-$tag.json"
exit 0
