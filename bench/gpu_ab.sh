#!/usr/bin/env bash
# Two builds compared in one run on one machine, as the benchmark asks of every comparison: servers
# from this tree ("new") and from BASE ("base": a copy of the other commit, e.g.
#   git archive REV engine cadence gateway clients aligner bench scripts pyproject.toml deploy/bench/corpus.jsonl | tar -x -C .base
# carried beside this tree), one after the other in ORDER, each through bench/gpu_bench_e2e.sh on one
# random checkpoint; then bench/ab_summary.py sets the runs side by side (medians per build) in ab.json.
# The servers need neither py-spy nor redis-server: where the carried files have a size limit, leave
# .whl/py_spy-*.whl and .whl/bin behind to make room for the base tree.
# Environment: BASE (.base), ORDER ("base new base new"), CONC (1,512,768), POINT_SECONDS (8), EACH
#              (150: the seconds one server may take, start-up included), OUTDIR ($OUT or ./bench-out),
#              and bench/gpu_bench_e2e.sh's (SIZE, DEVICE, CKPT, SERVE_ARGS, ...)
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE="$(realpath -m "${BASE:-.base}")"; [ -f "$BASE/bench/gpu_bench_e2e.sh" ] || { echo "gpu_ab: no tree at $BASE"; exit 2; }
OUTDIR="$(realpath -m "${OUTDIR:-${OUT:-./bench-out}}")"; mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"; SIZE="${SIZE:-1.7B}"; DEVICE="${DEVICE:-cuda}"
case "$PY" in */*) PY="$(realpath -s -m "$PY")" ;; esac  # the servers run from either tree
export PYTHON="$PY"
export CKPT="$(realpath -m "${CKPT:-.cache/cadence-random-$SIZE}")"
export SKIP_REF=1 SIZE DEVICE CONC="${CONC:-1,512,768}" POINT_SECONDS="${POINT_SECONDS:-8}"
[ -f "$CKPT/config.json" ] || $PY bench/random_checkpoint.py --size "$SIZE" --out "$CKPT" --device "$DEVICE"
# the overlay of bench/gpu_env.sh (wheels in .cache/site), if any, stays first on the path
site=""; [ -d "$ROOT/.cache/site" ] && site="$ROOT/.cache/site:"
runs=()
i=0
for build in ${ORDER:-base new base new}; do
  i=$((i + 1))
  case "$build" in base) tree=$BASE ;; new) tree=$ROOT ;; *) echo "gpu_ab: ORDER names base or new"; exit 2 ;; esac
  name="$build-$i"
  started=$(date +%s)
  (cd "$tree" && PYTHONPATH="$site$tree" OUTDIR="$OUTDIR" TAG="$name" timeout "${EACH:-150}" \
    bash bench/gpu_bench_e2e.sh > "$OUTDIR/run-$name.txt" 2>&1)
  echo "gpu_ab: $name in $(( $(date +%s) - started )) s, $(grep -m1 ready "$OUTDIR/run-$name.txt" || echo 'never ready')"
  runs+=("$name=$OUTDIR/bench-$name.json")
done
$PY bench/ab_summary.py "${runs[@]}" -o "$OUTDIR/ab.json"
