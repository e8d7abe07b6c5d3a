#!/usr/bin/env bash
# Device call I: CUDA policy/prefill tests, then both sweeps with auto calibrating demand copies (default).
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" > $OUT/versions.txt 2>&1
git rev-parse HEAD >> $OUT/versions.txt 2>&1; git status --short | head -40 >> $OUT/versions.txt
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 90 python3 -m pytest -p no:cacheprovider -n 0 -q -x \
  tests/engine/test_engine_policy.py tests/engine/test_engine_prefill.py > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -3 $OUT/pytest-cuda.log; echo "rc tests=$TRC at $(( $(date +%s) - T0 ))s"
[ $TRC -eq 0 ] || exit 1
rm -rf /tmp/ab && mkdir -p /tmp/ab
for r in skewed uniform; do
  p=h200-qwen3-30b-a3b-sweep; [ $r = skewed ] && p=$p-skewed
  timeout $(( 590 - ($(date +%s) - T0) )) python3 -m abbench run -p $p --out /tmp/ab/$r --no-report -q > /tmp/ab/$r.log 2>&1
  echo "$r rc=$? at $(( $(date +%s) - T0 ))s"; tail -2 /tmp/ab/$r.log
  cp /tmp/ab/$r.log $OUT/; (cd /tmp/ab && tar czf $OUT/$r.tgz $r)
done
echo "end at $(( $(date +%s) - T0 ))s"
