#!/usr/bin/env bash
# Device call N: the engine's CUDA tests with auto decode kernels (Triton on CUDA), gpucheck of the hybrid shape with
# them and with the default kernels.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git status --short | head -60 > $OUT/tree-status.txt 2>&1; git log --oneline -1 >> $OUT/tree-status.txt
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 220 python3 -m pytest -p no:cacheprovider -n 0 -q \
  tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py tests/engine/test_engine_hybrid.py \
  tests/engine/test_reference.py > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -3 $OUT/pytest-cuda.log; echo "rc tests=$TRC at $(( $(date +%s) - T0 ))s"
[ $TRC -eq 0 ] || { grep -E "^E |FAILED|Error" $OUT/pytest-cuda.log | head -40; exit 1; }
for k in auto default; do
  extra=""; [ $k = default ] && extra="--decode-experts grouped --decode-attention torch"
  timeout 150 python3 -m abbench.engine.gpucheck --preset qwen3.5-35b-a3b --layers 8 --prompt-tokens 32768 $extra \
    --out $OUT/gpucheck-hybrid-$k-32k.json > $OUT/gpucheck-hybrid-$k-32k.log 2>&1
  echo "gpucheck hybrid $k rc=$? at $(( $(date +%s) - T0 ))s"; grep -v Warn $OUT/gpucheck-hybrid-$k-32k.log | grep "gpucheck\|timing\|equal\|Error"
done
echo "end at $(( $(date +%s) - T0 ))s"
