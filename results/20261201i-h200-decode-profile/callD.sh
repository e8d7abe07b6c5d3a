#!/usr/bin/env bash
# Device call D: where a decode step's time goes (resident graphs, offloaded), Qwen3-30B-A3B shape at 32K.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git status --short | head -60 > $OUT/tree-status.txt 2>&1
timeout 400 python3 -m abbench.engine.gpucheck --preset qwen3-30b-a3b --layers 8 --prompt-tokens 32768 \
  --decode-tokens 8 --profile-decode --out $OUT/gpucheck-decode.json > $OUT/gpucheck-decode.log 2>&1
echo rc=$?; cat $OUT/gpucheck-decode.log
