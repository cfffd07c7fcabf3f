#!/usr/bin/env bash
# The standard sweep with word timestamps from the aligner, on one GPU machine, in one command:
#   random TTS and aligner checkpoints at the real shapes -> `cadence serve --engine qwen3` -> the
#   `cadence bench` sweep (words estimated) -> the same server with `--aligner` -> the sweep in
#   `alignment: "async"` sessions -> the sweep in `"sync"` sessions -> bench/aligner_sweep.py merges
#   the three into bench-TAG-aligner.json: per point each run's TTFA, RTF, underruns and the words'
#   lag behind their first audio (p90), and the figures of the aligner's targets.
# Environment: as bench/gpu_bench_e2e.sh: SIZE (1.7B), CONC (1,64,256,512), POINT_SECONDS (20), DEVICE
#              (cuda), OUTDIR ($OUT or ./bench-out), SERVE_ARGS, PORT (8765), TAG (the size); and
#              MAX_STREAMS (auto), ALIGNED_CONC (CONC: the levels of the two runs with the aligner), SYNC_CONC
#              (ALIGNED_CONC: the sync run's own levels),
#              ALIGNER_CKPT (.cache/cadence-random-aligner), STREAMS (256: where sync's added TTFA is
#              read), WARMUP_SECONDS (5), SKIP_PLAIN (set: keep an earlier bench-TAG-plain.json in OUTDIR),
#              PYSPY_AT / PYSPY_FOR (sample the aligned server's stacks with py-spy, PYSPY_AT s into
#              the async sweep), MODEL_TIMES (set: the random aligner's own word times instead of
#              --aligner-forced-times, the benchmark's speech rate, with which sync probes confirm
#              words as a trained model's do),
#              TINY (set: tiny random checkpoints, a smoke run on a CPU: TINY=1 DEVICE=cpu CONC=1,2 POINT_SECONDS=3)
set -u
cd "$(dirname "$0")/.."
SIZE="${SIZE:-1.7B}"; CONC="${CONC:-1,64,256,512}"; SECONDS_PER_POINT="${POINT_SECONDS:-20}"  # not SECONDS: bash counts time in it
DEVICE="${DEVICE:-cuda}"; OUTDIR="${OUTDIR:-${OUT:-./bench-out}}"; mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"; PORT="${PORT:-8765}"; WARMUP="${WARMUP_SECONDS:-5}"
[ -z "${TINY:-}" ] || SIZE=tiny
CKPT="${CKPT:-.cache/cadence-random-$SIZE}"
ALIGNER_CKPT="${ALIGNER_CKPT:-.cache/cadence-random-aligner${TINY:+-tiny}}"
tag="${TAG:-$(echo "$SIZE" | tr 'A-Z' 'a-z')}"  # names the output files

[ -f "$CKPT/config.json" ] || $PY bench/random_checkpoint.py --size "$SIZE" --out "$CKPT" --device "$DEVICE"
[ -f "$ALIGNER_CKPT/config.json" ] || $PY bench/random_aligner_checkpoint.py ${TINY:+--tiny} --out "$ALIGNER_CKPT" --device "$DEVICE"

serve() {  # serve NAME [cadence serve flags]: start the server and wait for /readyz
  name=$1; shift
  $PY -m cadence.cli serve --engine qwen3 --model "$CKPT" --device "$DEVICE" --port "$PORT" --max-streams "${MAX_STREAMS:-auto}" \
    ${SERVE_ARGS:-} "$@" > "$OUTDIR/serve-$tag-$name.log" 2>&1 &
  server=$!
  $PY - "$server" "$PORT" <<'PYEOF' || { echo "server not ready"; tail -30 "$OUTDIR/serve-$tag-$name.log"; kill -9 $server 2>/dev/null; exit 1; }
import os, sys, time, urllib.request
pid, port = int(sys.argv[1]), sys.argv[2]
started = time.time()
for _ in range(600):  # start-up: the checkpoints' load, the graphs' capture, the aligner's warm-up
    try:
        os.kill(pid, 0)  # a server that died at start-up is not waited for
    except OSError:
        raise SystemExit("the server exited during start-up")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
        print(f"ready {time.time() - started:.1f} s after the server started"); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit(1)
PYEOF
}
sweep() {  # sweep NAME LEVELS [cadence bench flags]
  name=$1; levels=$2; shift 2
  timeout 420 $PY -m cadence.cli bench --url "ws://127.0.0.1:$PORT/v1/stream" --concurrency "$levels" \
    --min-seconds "$SECONDS_PER_POINT" --max-seconds "$((SECONDS_PER_POINT + 15))" --warmup-seconds "$WARMUP" \
    --voice ryan --language English --model-shapes "$SIZE" --metrics-url "http://127.0.0.1:$PORT/metrics" \
    -o "$OUTDIR/bench-$tag-$name.json" "$@" 2>&1 | grep -v "━" | tail -25
}
stop() {  # stop NAME
  kill -INT $server; sleep 3; kill -9 $server 2>/dev/null; tail -5 "$OUTDIR/serve-$tag-$1.log"
}

if [ -z "${SKIP_PLAIN:-}" ]; then
  serve plain; sweep plain "$CONC"; stop plain
fi
times=--aligner-forced-times; [ -z "${MODEL_TIMES:-}" ] || times=
serve aligner --aligner "$ALIGNER_CKPT" $times
if [ -n "${PYSPY_AT:-}" ]; then
  (sleep "$PYSPY_AT"; py-spy record --nonblocking --pid $server --subprocesses --duration "${PYSPY_FOR:-15}" --rate 200 \
     --format raw -o "$OUTDIR/pyspy-$tag-async.txt" > "$OUTDIR/pyspy-$tag-async.log" 2>&1) &
fi
sweep async "${ALIGNED_CONC:-$CONC}" --alignment async
sweep sync "${SYNC_CONC:-${ALIGNED_CONC:-$CONC}}" --alignment sync
stop aligner
for name in plain async sync; do
  [ -f "$OUTDIR/bench-$tag-$name.json" ] || { echo "no bench-$tag-$name.json"; exit 1; }
done
$PY bench/aligner_sweep.py --plain "$OUTDIR/bench-$tag-plain.json" --async "$OUTDIR/bench-$tag-async.json" \
  --sync "$OUTDIR/bench-$tag-sync.json" --streams "${STREAMS:-256}" -o "$OUTDIR/bench-$tag-aligner.json"
