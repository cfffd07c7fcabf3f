#!/usr/bin/env bash
# Download into .whl/ the wheels a bare GPU machine (CPython 3.12, its own torch, no network) needs to
# run `cadence serve` and `cadence bench`: the server's dependencies the machine lacks, at the
# versions installed in .venv here (the tested ones). bench/gpu_env.sh installs them there.
#   bench/gpu_wheels.sh            # then carry .whl/ to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
names="starlette anyio uvicorn h11 httptools uvloop websockets soxr soundfile cffi pycparser
espeakng-loader prometheus-client redis httpx httpcore idna certifi rich markdown-it-py mdurl pygments av"
freeze="$(.venv/bin/python -m pip freeze --disable-pip-version-check 2>/dev/null)"
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: the install on the GPU machine refuses two of a package
for name in $names; do
  pinned="$(echo "$freeze" | grep -i "^${name//-/[-_]}==" || true)"
  [ -n "$pinned" ] || { echo "gpu_wheels: $name is not installed in .venv (run scripts/setup first)" >&2; exit 1; }
  echo "gpu_wheels: $pinned"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .whl "$pinned" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64
done
# py-spy for PYSPY_AT (bench/gpu_bench_e2e.sh): a tool of the benchmark, not of the server
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .whl py-spy==0.4.3 \
  --python-version 3.12 --implementation cp --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
echo "gpu_wheels: py-spy==0.4.3"
# pytest-asyncio for `bench/gpu_session.sh tests`: the GPU test files hold async tests beside the GPU
# ones (a bare GPU image has pytest, not the plugin)
asyncio_pin="$(echo "$freeze" | grep -i "^pytest[-_]asyncio==")"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .whl "$asyncio_pin"
echo "gpu_wheels: $asyncio_pin"
# redis-server for the multi-gateway runs (bench/gpus.sh): this machine's binary and the libraries a
# bare GPU image may lack, into .whl/bin and .whl/lib (bench/gpu_env.sh puts them on the paths)
if command -v redis-server >/dev/null; then
  mkdir -p .whl/bin .whl/lib
  cp -L "$(command -v redis-server)" .whl/bin/redis-server
  ldd "$(command -v redis-server)" | awk '/=> \//{print $3}' | grep -E 'liblzf|libjemalloc|libatomic' \
    | xargs -r -I{} cp -L {} .whl/lib/
  echo "gpu_wheels: redis-server $(redis-server --version | cut -d' ' -f3)"
fi
