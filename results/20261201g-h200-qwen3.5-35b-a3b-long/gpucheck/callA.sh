#!/usr/bin/env bash
# Device call A: wheels, CUDA engine tests, gpucheck_hybrid at full width (prefill graphs on/off, attention
# batching), then (if all pass) the h200-qwen3.5-35b-a3b-long run in its own session.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" > $OUT/versions.txt 2>&1
git rev-parse HEAD >> $OUT/versions.txt 2>&1; git status --short | head >> $OUT/versions.txt
echo "== tests $(( $(date +%s) - T0 ))s"
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 270 python3 -m pytest -p no:cacheprovider -n 0 -q -x \
  tests/engine/test_engine_hybrid.py tests/engine/test_engine_prefill.py tests/engine/test_engine_decode.py \
  tests/engine/test_engine_qwen4.py > $OUT/pytest-cuda.log 2>&1
TRC=$?; tail -3 $OUT/pytest-cuda.log
echo "== gpucheck graphs on $(( $(date +%s) - T0 ))s"
timeout 200 python3 -m abbench.engine.gpucheck_hybrid --layers 8 --tokens 131072 --window-chunks 64 \
  --modes layer-major,resident --mode-repeats 2 --gpu-busy --attention-batch 2 --repeats 3 \
  --attention-batch-positions 0,2048,4096,8192,16384,32768,65536,131072,253952 > $OUT/gpucheck-graphs.log 2>&1
G1=$?; cat $OUT/gpucheck-graphs.log
echo "== gpucheck graphs off $(( $(date +%s) - T0 ))s"
timeout 150 python3 -m abbench.engine.gpucheck_hybrid --layers 8 --tokens 131072 --window-chunks 64 \
  --modes layer-major,resident --mode-repeats 2 --gpu-busy --repeats 1 --no-prefill-graphs > $OUT/gpucheck-eager.log 2>&1
G2=$?; cat $OUT/gpucheck-eager.log
echo "rc tests=$TRC graphs=$G1 eager=$G2 at $(( $(date +%s) - T0 ))s"
if [ $TRC -eq 0 ] && [ $G1 -eq 0 ]; then
  rm -rf /tmp/ab && mkdir -p /tmp/ab
  setsid nohup python3 -m abbench run -p h200-qwen3.5-35b-a3b-long --out /tmp/ab/run --no-report -q > /tmp/ab/run.log 2>&1 < /dev/null &
  echo "run started"
  # wait here as long as the call allows, then return (call B waits for the rest)
  while [ $(( $(date +%s) - T0 )) -lt 570 ] && pgrep -f "abbench run -p h200" >/dev/null; do sleep 10; done
  tail -5 /tmp/ab/run.log
fi
echo "end at $(( $(date +%s) - T0 ))s"
