#!/usr/bin/env bash
# Device call B: wait for the run, then bring it back.
set -u
T0=$(date +%s)
while [ $(( $(date +%s) - T0 )) -lt 560 ] && pgrep -f "abbench run -p h200" >/dev/null; do sleep 5; done
tail -20 /tmp/ab/run.log
cp /tmp/ab/run.log $OUT/ 2>/dev/null
cd /tmp/ab && tar czf $OUT/run.tgz run && ls -la $OUT
pgrep -f "abbench run -p h200" >/dev/null && echo "STILL RUNNING"
