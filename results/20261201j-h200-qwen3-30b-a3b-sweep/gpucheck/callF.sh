#!/usr/bin/env bash
# Device call F: CUDA engine tests (prefill, policy), then the uniform-routing sweep in its own session.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" > $OUT/versions.txt 2>&1
git rev-parse HEAD >> $OUT/versions.txt 2>&1; git status --short | head -40 >> $OUT/versions.txt
echo "== tests $(( $(date +%s) - T0 ))s"
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:cacheprovider -n 0 -q -x \
  tests/engine/test_engine_prefill.py tests/engine/test_engine_policy.py > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -3 $OUT/pytest-cuda.log
echo "rc tests=$TRC at $(( $(date +%s) - T0 ))s"
if [ $TRC -eq 0 ]; then
  rm -rf /tmp/ab && mkdir -p /tmp/ab
  setsid nohup python3 -m abbench run -p h200-qwen3-30b-a3b-sweep --out /tmp/ab/uniform --no-report -q > /tmp/ab/uniform.log 2>&1 < /dev/null &
  echo "run started"
  while [ $(( $(date +%s) - T0 )) -lt 575 ] && pgrep -f "abbench run -p h200" >/dev/null; do sleep 5; done
  tail -5 /tmp/ab/uniform.log
  if ! pgrep -f "abbench run -p h200" >/dev/null; then
    cp /tmp/ab/uniform.log $OUT/; (cd /tmp/ab && tar czf $OUT/uniform.tgz uniform)
    setsid nohup python3 -m abbench run -p h200-qwen3-30b-a3b-sweep-skewed --out /tmp/ab/skewed --no-report -q > /tmp/ab/skewed.log 2>&1 < /dev/null &
    echo "skewed started"
  fi
fi
echo "end at $(( $(date +%s) - T0 ))s"
