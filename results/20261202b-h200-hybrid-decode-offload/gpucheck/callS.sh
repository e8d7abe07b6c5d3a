#!/usr/bin/env bash
# Device call S: CUDA tests of the decode paths (per-request host/device misses included), then
# abbench run -p h200-hybrid-decode-offload, detached; this call (and the next, if needed) waits for it.
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
  rc=$?
  echo "tests rc=$rc $(( $(date +%s) - T0 )) s" | tee -a /tmp/ab/pytest-cuda.log; tail -4 /tmp/ab/pytest-cuda.log
  if [ $rc -ne 0 ]; then grep -E "^E |FAILED|Error" /tmp/ab/pytest-cuda.log | head -30; cp /tmp/ab/*.log $OUT/; exit 1; fi
  ( python3 -m abbench run -p h200-hybrid-decode-offload --out /tmp/ab/run --no-report -q > /tmp/ab/run.log 2>&1
    echo "rc=$?" > /tmp/ab/DONE ) < /dev/null > /dev/null 2>&1 &
  disown
fi
while [ ! -f /tmp/ab/DONE ] && [ $(( $(date +%s) - T0 )) -lt ${WAIT:-570} ]; do sleep 5; done
tail -5 /tmp/ab/run.log; ls /tmp/ab/run 2>/dev/null | head
if [ -f /tmp/ab/DONE ]; then cat /tmp/ab/DONE; cp /tmp/ab/*.log /tmp/ab/*.txt $OUT/ 2>/dev/null; (cd /tmp/ab && tar czf $OUT/run.tgz run); else echo "still running at $(( $(date +%s) - T0 ))s"; cp /tmp/ab/*.log $OUT/ 2>/dev/null; fi
