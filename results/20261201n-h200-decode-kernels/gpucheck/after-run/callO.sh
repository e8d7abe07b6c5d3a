#!/usr/bin/env bash
# Device call O: the CUDA tests that failed in call N, after the fixes; gpucheck of the hybrid shape with auto kernels.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git status --short | head -60 > $OUT/tree-status.txt 2>&1
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 170 python3 -m pytest -p no:cacheprovider -n 0 -q \
  tests/engine/test_engine_decode.py tests/engine/test_reference.py tests/engine/test_decode_kernels.py -k "not one_path and not split_kv and not fused" > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -3 $OUT/pytest-cuda.log; echo "rc tests=$TRC at $(( $(date +%s) - T0 ))s"
[ $TRC -eq 0 ] || { grep -E "^E |FAILED|ERROR" $OUT/pytest-cuda.log | head -30; }
timeout $(( 300 - ($(date +%s) - T0) )) python3 -m abbench.engine.gpucheck --preset qwen3.5-35b-a3b --layers 8 --prompt-tokens 32768 \
  --out $OUT/gpucheck-hybrid-auto-32k.json > $OUT/gpucheck-hybrid-auto-32k.log 2>&1
echo "gpucheck hybrid auto rc=$? at $(( $(date +%s) - T0 ))s"; grep -v Warn $OUT/gpucheck-hybrid-auto-32k.log | grep "gpucheck\|timing\|equal\|Error"
