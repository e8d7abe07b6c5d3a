#!/usr/bin/env bash
# Device call Q: CUDA tests, gpucheck (slots 8/37/112/128, host vs device misses), then
# abbench run -p h200-decode-offload, detached; this call (and the next, if needed) waits for it.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/ab ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  mkdir -p /tmp/ab
  { git log -1 --format=%H; git status --short | head -60; } > /tmp/ab/tree-status.txt 2>&1
  nvidia-smi > /tmp/ab/nvidia-smi.txt 2>&1
  ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -o addopts="" -p no:cacheprovider -q \
    tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py > /tmp/ab/pytest-cuda.log 2>&1
  echo "tests rc=$? $(( $(date +%s) - T0 )) s" | tee -a /tmp/ab/pytest-cuda.log; tail -3 /tmp/ab/pytest-cuda.log
  timeout 200 python3 -m abbench.engine.gpucheck --layers 8 --prompt-tokens 4096 --out /tmp/ab/gpucheck-4k.json > /tmp/ab/gpucheck-4k.log 2>&1
  echo "gpucheck rc=$? $(( $(date +%s) - T0 )) s" | tee -a /tmp/ab/gpucheck-4k.log; tail -16 /tmp/ab/gpucheck-4k.log
  ( python3 -m abbench run -p h200-decode-offload --out /tmp/ab/run --no-report -q > /tmp/ab/run.log 2>&1
    echo "rc=$?" > /tmp/ab/DONE ) < /dev/null > /dev/null 2>&1 &
  disown
fi
while [ ! -f /tmp/ab/DONE ] && [ $(( $(date +%s) - T0 )) -lt ${WAIT:-570} ]; do sleep 5; done
tail -5 /tmp/ab/run.log; ls /tmp/ab/run 2>/dev/null | head
if [ -f /tmp/ab/DONE ]; then cat /tmp/ab/DONE; cp /tmp/ab/*.log /tmp/ab/*.txt /tmp/ab/*.json $OUT/ 2>/dev/null; (cd /tmp/ab && tar czf $OUT/run.tgz run); else echo "still running at $(( $(date +%s) - T0 ))s"; cp /tmp/ab/*.log /tmp/ab/*.json $OUT/ 2>/dev/null; fi
