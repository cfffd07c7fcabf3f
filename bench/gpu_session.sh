#!/usr/bin/env bash
# One GPU session's measurements in parts, each within one 10-minute call on an H200, every
# output under $OUT (or ./bench-out). Carry .whl/ (see bench/gpu_env.sh) and run from the repo root:
#   . bench/gpu_env.sh && bench/gpu_session.sh 1    # GPU tests + engine-only figures
#   . bench/gpu_env.sh && bench/gpu_session.sh 2    # end-to-end sweep through the gateway
#   . bench/gpu_env.sh && bench/gpu_session.sh 3    # FP8, segment joins, prefix cache, aligner
#   . bench/gpu_env.sh && bench/gpu_session.sh 4    # all of it, shortened, in one call
#   . bench/gpu_env.sh && bench/gpu_session.sh 5    # two GPUs: the 1.7B sweep on one; tests,
#                                                         prefix cache and the 0.6B sweep on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 6    # two GPUs: the 1.7B sweep to C=640 on one;
#                                                         Code2Wav's cost per (rows, frames) and tests
#                                                         on the other (the scheduler's cost model)
#   . bench/gpu_env.sh && bench/gpu_session.sh 8    # two GPUs: the default 1.7B sweep to C=640 on
#                                                         one; Code2Wav's kernels (plain and compiled
#                                                         by inductor) and the GPU tests on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 11   # one GPU: the default sweep alone
#   . bench/gpu_env.sh && bench/gpu_session.sh 13   # two GPUs: the default sweep alone on one; the
#                                                         stream, figure and graph tests on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 14   # two GPUs: the default sweep (py-spy at C=512) on
#                                                         one; eager against fused layers and every GPU
#                                                         test on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 15   # two GPUs: the default sweep (py-spy at C=512) on
#                                                         one; early frames off on the other (C=256,384)
#   . bench/gpu_env.sh && bench/gpu_session.sh 16   # two GPUs: the default sweep (py-spy at C=512) on
#                                                         one; every GPU test, then C=576,640 on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 19   # two GPUs: the default sweep (py-spy at C=512) on
#                                                         one; every GPU test, then the sweep with a
#                                                         narrower early-frame margin (safety_margin_s=0.1)
#   . bench/gpu_env.sh && bench/gpu_session.sh 20   # two GPUs: the default sweep on one; the same with
#                                                         full collections ten times rarer in the gateway
#                                                         (CADENCE_GC_FULL_AFTER=100) on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 21   # two GPUs, no profiler: the default sweep on one;
#                                                         every GPU test, then the default again at 448
#                                                         and 512 streams on the other
#   . bench/gpu_env.sh && bench/gpu_session.sh 22   # both GPUs behind one gateway (--gpus 2, an engine
#                                                         worker per GPU): the sweep at 512-1216 streams
# Copy the results into deploy/bench/ with the commands recorded in deploy/bench/README.md.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUTDIR:-${OUT:-./bench-out}}"; mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"; CKPT="${CKPT:-.cache/cadence-random-1.7B}"
export PYTHONUNBUFFERED=1
run() {  # run SECONDS NAME COMMAND...: its output to $OUTDIR/NAME.txt, the tail to stdout
  local limit=$1 name=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUTDIR/$name.txt" 2>&1; echo "   exit $?"
  grep -v "━" "$OUTDIR/$name.txt" | tail -n "${TAIL:-14}"
}
sweep_setup() {  # the checkpoint, the reference's earlier result, the sweep's settings (parts 5 and 6)
  [ -f "$CKPT/config.json" ] || $PY bench/random_checkpoint.py --size 1.7B --out "$CKPT" --device cuda
  [ -f deploy/bench/h200-reference-1.7b.json ] && cp deploy/bench/h200-reference-1.7b.json "$OUTDIR/reference-1.7b.json"
  export SKIP_REF=1 OUTDIR="$OUTDIR" POINT_SECONDS="${POINT_SECONDS:-12}"
}
beside_default() {  # beside_default NAME CONC [SERVE_ARGS]: the default sweep (py-spy at C=512 unless
  # PYSPY_AT is set empty) on GPU 0;
  # on GPU 1 every GPU test, then a sweep at CONC (or $CONC_B) with SERVE_ARGS, its files tagged 1.7b-NAME
  POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
  (export CUDA_VISIBLE_DEVICES=0; PYSPY_AT="${PYSPY_AT-85}" PYSPY_FOR="${PYSPY_FOR:-10}" \
     CONC="${CONC:-1,256,384,512}" run 540 e2e bash bench/gpu_bench_e2e.sh) &
  (export CUDA_VISIBLE_DEVICES=1 PYSPY_AT=
   run 150 gpu-tests $PY -m pytest tests/engine/qwen3/gpu -q -p no:cacheprovider
   SERVE_ARGS="${3:-}" PORT=8766 TAG="1.7b-$1" CONC="${CONC_B:-$2}" run 380 "e2e-$1" bash bench/gpu_bench_e2e.sh) &
  wait
}
case "${1:-}" in
  1)
    run 120 gpu-tests $PY -m pytest tests/engine/qwen3/gpu -q -p no:cacheprovider
    run 420 engine $PY bench/gpu_engine_bench.py --batches 1 64 256 512 --frames 64 --profile-batch 1 256
    ;;
  2)
    [ -f deploy/bench/h200-reference-1.7b.json ] && cp deploy/bench/h200-reference-1.7b.json "$OUTDIR/reference-1.7b.json"
    export CONC="${CONC:-1,64,256,512}" SKIP_REF=1 OUTDIR="$OUTDIR"
    export POINT_SECONDS=15  # seconds measured per concurrency level
    run 560 e2e bash bench/gpu_bench_e2e.sh
    ;;
  3)
    [ -f "$CKPT/config.json" ] || $PY bench/random_checkpoint.py --size 1.7B --out "$CKPT" --device cuda
    run 180 fp8 $PY bench/gpu_fp8_bench.py --out "$OUTDIR/fp8.json" --engine-batches 1 256 --engine-variants talker
    run 180 segment-joins $PY bench/gpu_segment_joins.py --model "$CKPT" --out "$OUTDIR/segment-joins.json" --quiet
    run 90 prefix-cache $PY bench/gpu_prefix_cache.py --checkpoint "$CKPT"
    run 50 aligner $PY bench/gpu_aligner_bench.py --batches 1,8,32,64
    run 50 aligner-sync $PY bench/gpu_aligner_sync_ttfa.py
    ;;
  4)  # a short session's single call: GPU tests, a three-point sweep, prefix cache, aligner, FP8
    run 45 gpu-tests $PY -m pytest tests/engine/qwen3/gpu -q -p no:cacheprovider
    [ -f deploy/bench/h200-reference-1.7b.json ] && cp deploy/bench/h200-reference-1.7b.json "$OUTDIR/reference-1.7b.json"
    (export CONC="${CONC:-1,256,384}" SKIP_REF=1 OUTDIR="$OUTDIR" POINT_SECONDS=12; run 230 e2e bash bench/gpu_bench_e2e.sh)
    run 100 prefix-cache $PY bench/gpu_prefix_cache.py --checkpoint "$CKPT"
    run 40 aligner $PY bench/gpu_aligner_bench.py --batches 1,8,32,64
    run 35 aligner-sync $PY bench/gpu_aligner_sync_ttfa.py
    run 130 fp8 $PY bench/gpu_fp8_bench.py --out "$OUTDIR/fp8.json" --variants talker --frames 100 --rows 4 \
      --engine-batches 256 --engine-variants talker
    ;;
  5)  # two GPUs at once: the 1.7B sweep on GPU 0; tests, prefix cache and the 0.6B sweep on GPU 1
    # (start-up captures graphs and tunes Code2Wav for about 130 s before each sweep's first point)
    sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; CONC="${CONC:-1,256,384,512}" run 540 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1
     run 70 gpu-tests $PY -m pytest tests/engine/qwen3/gpu -q -p no:cacheprovider
     run 120 prefix-cache $PY bench/gpu_prefix_cache.py --checkpoint "$CKPT" --codec-frame-buckets 1 2 4
     SIZE=0.6B PORT=8766 CONC="${CONC_SMALL:-1,256,512}" run 330 e2e-0.6b bash bench/gpu_bench_e2e.sh) &
    wait
    ;;
  6)  # two GPUs: the 1.7B sweep on GPU 0; on GPU 1 every Code2Wav graph shape the engine replays
    sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; CONC="${CONC:-1,256,384,512,640}" run 560 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1
     run 70 gpu-tests $PY -m pytest tests/engine/qwen3/gpu -q -p no:cacheprovider
     run 420 codec-shapes $PY bench/gpu_codec_bench.py --batches 1,8,16,32,64 --frames 1,2,4,8,16,25 \
       --dtypes bf16 --steps 10 --json "$OUTDIR/codec-shapes.json") &
    wait
    ;;
  8)  # two GPUs: the 1.7B sweep as served by default on GPU 0; Code2Wav kernels and the GPU tests on GPU 1
    sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; CONC="${CONC:-1,256,384,512,640}" run 570 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1
     run 330 codec-profile $PY bench/gpu_codec_bench.py --batches 64 --frames 1,4 --dtypes bf16 --steps 10 \
       --profile --compile --kernel-ops 64x4 --json "$OUTDIR/codec-profile.json"
     run 150 gpu-tests $PY -m pytest tests/engine/qwen3/gpu -q -p no:cacheprovider) &
    wait
    ;;
  11)  # one GPU, nothing beside it: the default sweep (start-up about 4 min of the 10)
    POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
    CONC="${CONC:-1,256,384,512}" run 540 e2e bash bench/gpu_bench_e2e.sh
    ;;
  13)  # two GPUs: the default sweep alone on GPU 0; the GPU tests of the streams, the stage figures
       # and graph == eager on GPU 1 (light on the host's CPU)
    POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; CONC="${CONC:-1,256,384,512}" run 540 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1
     run 300 gpu-tests $PY -m pytest -q tests/engine/qwen3/gpu/test_first_chunk_lane.py tests/engine/qwen3/gpu/test_stage_figures.py \
       tests/engine/qwen3/gpu/test_step_syncs.py tests/engine/qwen3/gpu/test_graphs.py) &
    wait
    ;;
  14)  # two GPUs: the default sweep on GPU 0, its server's stacks sampled at C=512; on GPU 1 the
       # decoder layers eager against fused (graph replays alone), then every GPU test
    POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; PYSPY_AT="${PYSPY_AT:-85}" PYSPY_FOR="${PYSPY_FOR:-10}" \
       CONC="${CONC:-1,256,384,512}" run 540 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1
     TAIL=12 run 150 layers $PY bench/gpu_layer_bench.py --batches 1 64 256 512 --json "$OUTDIR/layers.json"
     run 330 gpu-tests $PY -m pytest -q tests/engine/qwen3/gpu -p no:cacheprovider) &
    wait
    ;;
  15)  # two GPUs, one build: the default sweep on GPU 0 (its server's stacks sampled at C=512), and
       # beside it the same sweep with early frames off (max_now_frame_rows=0) at 256 and 384 streams
    POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; PYSPY_AT="${PYSPY_AT:-85}" PYSPY_FOR="${PYSPY_FOR:-10}" \
       CONC="${CONC:-1,256,384,512}" run 540 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1
     SERVE_ARGS="--scheduler max_now_frame_rows=0" PORT=8766 TAG=1.7b-no-early-frames \
       CONC="${CONC_B:-256,384}" run 450 e2e-no-early-frames bash bench/gpu_bench_e2e.sh) &
    wait
    ;;
  16)  # two GPUs, one build: the default sweep on GPU 0 (its server's stacks sampled at C=512); on GPU 1
       # every GPU test, then the same server past 512 streams
    beside_default past-512 576,640
    ;;
  19)  # two GPUs, one build: the default sweep on GPU 0 (py-spy at C=512); on GPU 1 every GPU test, then
       # the sweep with a narrower early-frame margin of 0.1 s (the default is 0.4 s)
    beside_default margin-0.1 384,512 "--scheduler safety_margin_s=0.1"
    ;;
  20)  # two GPUs, one build, no profiler: the default sweep on GPU 0; on GPU 1 the same with the
       # gateway's full collections ten times rarer (each one pauses every stream)
    POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
    (export CUDA_VISIBLE_DEVICES=0; CONC="${CONC:-1,256,384,512}" run 560 e2e bash bench/gpu_bench_e2e.sh) &
    (export CUDA_VISIBLE_DEVICES=1 CADENCE_GC_FULL_AFTER=100
     PORT=8766 TAG=1.7b-full-gc-100 CONC="${CONC:-1,256,384,512}" run 560 e2e-full-gc bash bench/gpu_bench_e2e.sh) &
    wait
    ;;
  21)  # two GPUs, one build, no profiler: the default sweep on GPU 0; on GPU 1 every GPU test, then
       # a second sample of the default where the targets are set (448 and 512 streams)
    PYSPY_AT= beside_default again 448,512
    ;;
  22)  # both GPUs behind one gateway process: an engine worker per GPU (`cadence serve --gpus 2`, each
       # worker admitting up to 640 streams), the sweep from one GPU's best point up to two GPUs' worth
    POINT_SECONDS="${POINT_SECONDS:-10}" sweep_setup
    SERVE_ARGS="--gpus 2" TAG=1.7b-gpus-2 CONC="${CONC:-512,768,1024,1216}" run 560 e2e-gpus-2 bash bench/gpu_bench_e2e.sh
    ;;
  *) echo "usage: bench/gpu_session.sh 1-6|8|11|13-16|19-22"; exit 2 ;;
esac
