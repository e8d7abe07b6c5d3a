#!/usr/bin/env bash
# Device call L: the fused decode kernels on CUDA (tests), gpucheck at full width with them, the attention combine fix timed.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git status --short | head -60 > $OUT/tree-status.txt 2>&1
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 180 python3 -m pytest -p no:cacheprovider -n 0 -q \
  tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -5 $OUT/pytest-cuda.log; echo "rc tests=$TRC at $(( $(date +%s) - T0 ))s"
[ $TRC -eq 0 ] || { grep -B5 -A30 "Error\|FAILED" $OUT/pytest-cuda.log | head -80; exit 1; }
timeout 170 python3 -m abbench.engine.gpucheck --layers 8 --prompt-tokens 32768 --profile-decode \
  --decode-experts triton --decode-attention triton --out $OUT/gpucheck-triton-32k.json > $OUT/gpucheck-triton-32k.log 2>&1
echo "gpucheck triton rc=$? at $(( $(date +%s) - T0 ))s"; grep -v Warn $OUT/gpucheck-triton-32k.log | grep "timing\|equal\|PASS\|FAIL\|all kernels\|Error"
timeout 120 python3 -m abbench.engine.gpucheck_decode_kernels --contexts 4096,32768,131072,262144 \
  --out $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "kernels rc=$? at $(( $(date +%s) - T0 ))s"; grep "split\|engine\|PASS\|FAIL" $OUT/kernels.log
echo "end at $(( $(date +%s) - T0 ))s"
