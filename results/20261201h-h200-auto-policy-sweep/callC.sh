#!/usr/bin/env bash
# Device call C: CUDA tests of the changed engine paths, then the auto-policy sweep (gpucheck_policy).
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
git status --short | head -40 > $OUT/tree-status.txt 2>&1
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:cacheprovider -n 0 -q -x \
  tests/engine/test_engine_policy.py tests/engine/test_engine_prefill.py \
  "tests/engine/test_engine_hybrid.py::test_prefill_graphs_replay_bitwise_what_eager_steps_compute" \
  "tests/engine/test_engine_hybrid.py::test_attention_batching_is_bitwise_one_call_per_chunk_or_falls_back_with_its_reason" \
  > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -3 $OUT/pytest-cuda.log
echo "== policy sweep at $(( $(date +%s) - T0 ))s"
if [ $TRC -eq 0 ]; then
  timeout $(( 580 - ($(date +%s) - T0) )) python3 -m abbench.engine.gpucheck_policy --model qwen3-30b-a3b-half \
    --prefix 16384 --suffixes 64,128,256,512,1024,2048,4096,8192 --skews 0,1.2 --repeats 2 \
    --gpu-memory-budget 24 > $OUT/gpucheck-policy.log 2>&1
  echo "policy rc=$?"; cat $OUT/gpucheck-policy.log
fi
echo "end at $(( $(date +%s) - T0 ))s"
