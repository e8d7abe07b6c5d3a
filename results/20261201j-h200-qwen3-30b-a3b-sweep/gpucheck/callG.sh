#!/usr/bin/env bash
# Device call G: bring back the uniform run if call F could not, start/wait for the skewed run, bring it back.
set -u
T0=$(date +%s)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
while [ $(( $(date +%s) - T0 )) -lt 570 ] && pgrep -f "abbench run -p h200-qwen3-30b-a3b-sweep " >/dev/null; do sleep 5; done
if [ -d /tmp/ab/uniform ] && [ ! -d /tmp/ab/skewed ]; then
  cp /tmp/ab/uniform.log $OUT/; (cd /tmp/ab && tar czf $OUT/uniform.tgz uniform)
  setsid nohup python3 -m abbench run -p h200-qwen3-30b-a3b-sweep-skewed --out /tmp/ab/skewed --no-report -q > /tmp/ab/skewed.log 2>&1 < /dev/null &
  echo "skewed started"
fi
while [ $(( $(date +%s) - T0 )) -lt 575 ] && pgrep -f "abbench run -p h200-qwen3-30b-a3b-sweep-skewed" >/dev/null; do sleep 5; done
tail -8 /tmp/ab/skewed.log
cp /tmp/ab/skewed.log $OUT/ 2>/dev/null; (cd /tmp/ab && tar czf $OUT/skewed.tgz skewed)
pgrep -f "abbench run -p h200" >/dev/null && echo "STILL RUNNING"
echo "end at $(( $(date +%s) - T0 ))s"
