#!/usr/bin/env bash
# Device call M: abbench run -p h200-decode-kernels, detached; this call (and the next, if needed) waits for it.
set -u
T0=$(date +%s)
if [ ! -d /tmp/ab ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  mkdir -p /tmp/ab
  git status --short | head -60 > /tmp/ab/tree-status.txt 2>&1
  nvidia-smi > /tmp/ab/nvidia-smi.txt 2>&1
  ( export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 -m abbench run -p h200-decode-kernels --out /tmp/ab/run --no-report -q > /tmp/ab/run.log 2>&1
    echo "rc=$?" > /tmp/ab/DONE ) < /dev/null > /dev/null 2>&1 &
  disown
fi
while [ ! -f /tmp/ab/DONE ] && [ $(( $(date +%s) - T0 )) -lt ${WAIT:-560} ]; do sleep 5; done
tail -5 /tmp/ab/run.log; ls /tmp/ab/run 2>/dev/null | head
if [ -f /tmp/ab/DONE ]; then cat /tmp/ab/DONE; cp /tmp/ab/run.log /tmp/ab/tree-status.txt /tmp/ab/nvidia-smi.txt $OUT/; (cd /tmp/ab && tar czf $OUT/run.tgz run); else echo "still running at $(( $(date +%s) - T0 ))s"; fi
