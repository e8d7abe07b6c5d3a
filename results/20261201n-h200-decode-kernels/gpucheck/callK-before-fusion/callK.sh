#!/usr/bin/env bash
# Device call K: decode kernels on CUDA (tests), gpucheck at full width with and without the Triton kernels, kernel timings.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" > $OUT/versions.txt 2>&1
git status --short | head -40 >> $OUT/versions.txt
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 180 python3 -m pytest -p no:cacheprovider -n 0 -q -x \
  tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -5 $OUT/pytest-cuda.log; echo "rc tests=$TRC at $(( $(date +%s) - T0 ))s"
[ $TRC -eq 0 ] || exit 1
timeout 170 python3 -m abbench.engine.gpucheck --layers 8 --prompt-tokens 32768 --profile-decode \
  --decode-experts triton --decode-attention triton --out $OUT/gpucheck-triton-32k.json > $OUT/gpucheck-triton-32k.log 2>&1
echo "gpucheck triton rc=$? at $(( $(date +%s) - T0 ))s"; tail -30 $OUT/gpucheck-triton-32k.log
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m abbench.engine.gpucheck_decode_kernels --contexts 4096,32768,131072,262144 \
  --out $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "kernels rc=$? at $(( $(date +%s) - T0 ))s"; tail -25 $OUT/kernels.log
R=$(( 585 - ($(date +%s) - T0) ))
[ $R -gt 100 ] && { timeout $R python3 -m abbench.engine.gpucheck --layers 8 --prompt-tokens 32768 --profile-decode \
  --out $OUT/gpucheck-default-32k.json > $OUT/gpucheck-default-32k.log 2>&1; echo "gpucheck default rc=$? at $(( $(date +%s) - T0 ))s"; tail -30 $OUT/gpucheck-default-32k.log; }
echo "end at $(( $(date +%s) - T0 ))s"
