#!/usr/bin/env bash
# Device call D (issue 29): the hybrid's gpucheck at 8 full-width layers at the committed device-miss path.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export ABBENCH_GIT_COMMIT=$(cat .dev/commit.txt) ABBENCH_GIT_DIRTY=0 PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT
cp "$0" $OUT/
timeout $(( ${BUDGET:-270} - ($(date +%s) - T0) )) python3 -m abbench.engine.gpucheck --preset qwen3.5-35b-a3b --layers 8 --prompt-tokens 4096 --out $OUT/gpucheck-hybrid-4k.json > $OUT/gpucheck-hybrid-4k.log 2>&1
echo "gpucheck rc=$? after $(( $(date +%s) - T0 )) s at $ABBENCH_GIT_COMMIT" | tee $OUT/rc.txt
grep -v Warning $OUT/gpucheck-hybrid-4k.log | tail -25
