#!/usr/bin/env bash
# The GPU measurements behind deploy/bench/README.md, by part, each within one 10-minute call on an
# H200; every output under $OUT (or ./bench-out). Carry .whl/ (bench/gpu_wheels.sh) and run from the
# repo root after `. bench/gpu_env.sh`:
#   bench/gpu_session.sh tests      # every GPU test: parity with the reference, graph == eager,
#                                   # streamed == offline, the fused kernels against torch
#   bench/gpu_session.sh codec      # Code2Wav: the fused convolution against cuDNN autotuned, at the
#                                   # engine's buckets, with the kernels of 64 rows x 4 frames by GPU time
#   bench/gpu_session.sh tiles      # each fused convolution under other tilings, beside cuDNN autotuned
#   bench/gpu_session.sh startup    # where the start-up goes: load, each graph's capture and replay
#   bench/gpu_session.sh replace    # a killed engine worker: how soon its replacement serves
#   bench/gpu_session.sh sweep      # the 1.7B sweep to twice the capacity (C=1,256,512,capacity,1.5x,2x)
#   bench/gpu_session.sh aligner    # the sweep without the aligner, then with it (async, sync)
#   bench/gpu_session.sh aligner-bench  # the aligner alone, with and without its CUDA graphs
#   bench/gpu_session.sh small      # the 0.6B sweep
#   bench/gpu_session.sh sizes      # the 1.7B, then the 0.6B, with the same KV slots (KV_MEMORY, 0.4:
#                                   # more than either's step admits, so each one's own cost bounds it)
#   bench/gpu_session.sh gpus       # two GPUs: bench/gpus.sh (the scaling ratio, one run)
#   bench/gpu_session.sh ab         # this tree against .base (another commit), servers alternating:
#                                   # bench/gpu_ab.sh (medians per build, new's ratio to base)
# Copy the results into deploy/bench/ with the commands recorded in deploy/bench/README.md.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUTDIR:-${OUT:-./bench-out}}"; mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"; CKPT="${CKPT:-.cache/cadence-random-1.7B}"
export PYTHONUNBUFFERED=1 OUTDIR CKPT
run() {  # run SECONDS NAME COMMAND...: its output to $OUTDIR/NAME.txt, the tail to stdout
  local limit=$1 name=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUTDIR/$name.txt" 2>&1; echo "   exit $?"
  grep -v "━" "$OUTDIR/$name.txt" | tail -n "${TAIL:-14}"
}
checkpoint() {  # the random checkpoint at the real shapes of SIZE (1.7B by default)
  local size=${1:-1.7B} dir=${2:-$CKPT}
  [ -f "$dir/config.json" ] || $PY bench/random_checkpoint.py --size "$size" --out "$dir" --device cuda
}
reference() {  # the reference's earlier result beside the sweep (SKIP_REF: not run again)
  [ -f "deploy/bench/h200-reference-$1.json" ] && cp "deploy/bench/h200-reference-$1.json" "$OUTDIR/reference-$1.json"
  export SKIP_REF=1
}
case "${1:-}" in
  tests)
    run 560 gpu-tests $PY -m pytest tests/engine/qwen3/gpu tests/engine/qwen3/codec/test_streaming_decode.py \
      tests/engine/qwen3/parity/test_fp8.py tests/aligner/test_gpu.py -q -p no:cacheprovider
    ;;
  codec)
    run 150 codec-fused $PY bench/gpu_codec_bench.py --batches 1,8,16,32,64 --frames 1,2,4,8,16,25 --dtypes bf16 \
      --steps 10 --json "$OUTDIR/codec-fused.json"
    run 60 codec-fused-profile $PY bench/gpu_codec_bench.py --batches 64 --frames 4 --dtypes bf16 --steps 10 --profile
    run 300 codec-cudnn $PY bench/gpu_codec_bench.py --batches 8,16,32,64 --frames 1,4,25 --dtypes bf16 --steps 10 \
      --conv cudnn --json "$OUTDIR/codec-cudnn.json"
    ;;
  tiles)
    run 560 conv-tiles $PY bench/gpu_conv_tiles.py --buckets 64x4,64x25,8x1 --quick --budget-s 420 \
      --json "$OUTDIR/conv-tiles.json"
    ;;
  startup)
    checkpoint
    run 300 startup $PY bench/gpu_startup.py --model "$CKPT" -o "$OUTDIR/startup.json"
    ;;
  replace)
    checkpoint
    run 400 worker-replacement $PY -m bench.worker_replacement -o "$OUTDIR/worker-replacement.json" \
      --bench-args "--voice ryan --language English --model-shapes 1.7B" -- --engine qwen3 --model "$CKPT"
    ;;
  sweep)  # a point near the capacity (512) comes before the relative levels
    checkpoint; reference 1.7b
    CONC="${CONC:-1,256,512,capacity,1.5x,2x}" POINT_SECONDS="${POINT_SECONDS:-10}" run 590 e2e bash bench/gpu_bench_e2e.sh
    ;;
  aligner-bench)  # the aligner alone, with and without its CUDA graphs
    run 200 aligner-bench $PY bench/gpu_aligner_bench.py --seconds 2.5 --batches 1,8,32,64 --eager
    run 200 aligner-bench-10s $PY bench/gpu_aligner_bench.py --seconds 10 --batches 1,8,32,64 --eager
    run 200 aligner-overlap $PY bench/gpu_aligner_bench.py --seconds 4 --batches 1,8,16,32 --iters 8 --overlap
    ;;
  aligner)
    checkpoint
    CONC="${CONC:-1,256,512}" ALIGNED_CONC="${ALIGNED_CONC:-256,512}" POINT_SECONDS="${POINT_SECONDS:-8}" \
      TAIL=30 run 590 aligner bash bench/gpu_bench_aligner.sh
    ;;
  small)
    checkpoint 0.6B .cache/cadence-random-0.6B; reference 0.6b
    SIZE=0.6B CKPT=.cache/cadence-random-0.6B CONC="${CONC:-1,256,512,capacity,2x}" POINT_SECONDS="${POINT_SECONDS:-10}" \
      run 590 e2e-0.6b bash bench/gpu_bench_e2e.sh
    ;;
  sizes)
    checkpoint; checkpoint 0.6B .cache/cadence-random-0.6B; export SKIP_REF=1
    for size in 1.7B 0.6B; do
      SIZE=$size CKPT=.cache/cadence-random-$size TAG=$(echo "$size" | tr 'A-Z' 'a-z')-kv-${KV_MEMORY:-0.4} \
        SERVE_ARGS="--kv-memory ${KV_MEMORY:-0.4}" CONC="${CONC:-512,capacity,1.5x}" \
        POINT_SECONDS="${POINT_SECONDS:-8}" run 290 "e2e-$size" bash bench/gpu_bench_e2e.sh
    done
    ;;
  ab)
    checkpoint
    TAIL=20 run 590 ab bash bench/gpu_ab.sh
    ;;
  gpus)
    checkpoint
    TAIL=20 run 590 gpus bash bench/gpus.sh "$CKPT" "$OUTDIR"
    ;;
  *)
    sed -n '2,21p' "$0"; exit 2
    ;;
esac
