# Source this on a bare GPU machine (no network) before running the GPU scripts:
#   . bench/gpu_env.sh
# It installs the wheels carried in .whl/ (bench/gpu_wheels.sh downloads them for cp312 manylinux; see
# deploy/bench/README.md) into .cache/site and puts them first on PYTHONPATH, beside the machine's own
# torch. The reference qwen-tts needs transformers 4.57.3, which the overlay provides.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .cache/site .whl/*.whl \
  || return 1 2>/dev/null || exit 1
export PYTHONPATH="$PWD/.cache/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/.cache/site/bin:$PWD/.whl/bin:$PATH" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$PWD/.whl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # redis-server's (bench/gpu_wheels.sh)
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
