#!/usr/bin/env bash
# Device call J: the candidate decode kernels against the engine's, one layer of Qwen3-30B-A3B at full width.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git status --short | head -40 > $OUT/tree-status.txt 2>&1
true

timeout 150 python3 -m abbench.engine.gpucheck_decode_kernels --moe-blocks 4x1024,2x1024,2x2048,4x2048,8x1024,4x512,1x2048 --contexts 4096 --out $OUT/kernels-blocks.json > $OUT/kernels-blocks.log 2>&1
echo "rc=$?"; cat $OUT/kernels-blocks.log | tail -20
