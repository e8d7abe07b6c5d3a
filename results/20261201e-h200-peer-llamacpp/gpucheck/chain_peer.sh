#!/usr/bin/env bash
# issue 16, detached: GGUF export (beside) + CUDA engine tests -> gpucheck (decode at full width) -> the profile run
cd "$(dirname "$0")/.."
. .dev/setup.sh
export ABBENCH_CACHE_DIR=/tmp/abcache ABBENCH_LLAMA_SERVER=/tmp/llamacpp/llama-server
D=/tmp/ab; mkdir -p $D/gpucheck
{
  python3 -c 'import torch, triton, transformers, gguf; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  free -g
} > $D/gpucheck/versions.txt 2>&1
nvidia-smi > $D/gpucheck/nvidia-smi.txt 2>&1
echo "start $(date +%T)" >> $D/chain.log
( t=$SECONDS; python3 -m abbench export-gguf --model qwen3-30b-a3b-half --weights random:0 --dtype bfloat16 \
    --device cuda > $D/gpucheck/export-gguf.log 2>&1; echo "export rc=$? $((SECONDS-t)) s $(date +%T)" >> $D/chain.log ) &
EXP=$!
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 400 python3 -m pytest -o addopts=-ra -q -p no:cacheprovider \
  tests/engine/test_engine_qwen4.py tests/engine/test_engine_prefill.py tests/engine/test_engine_decode.py \
  tests/engine/test_engine_model.py > $D/gpucheck/pytest-cuda.log 2>&1
rc=$?; echo "tests rc=$rc $(date +%T)" >> $D/chain.log
wait $EXP
if [ $rc -ne 0 ]; then echo "CHAIN STOPPED: tests failed" >> $D/chain.log; touch $D/DONE; exit 1; fi
timeout 300 python3 -m abbench.engine.gpucheck --preset qwen3-30b-a3b-half --layers 8 \
  --out $D/gpucheck/gpucheck-qwen3-30b-a3b-half.json > $D/gpucheck/gpucheck-qwen3-30b-a3b-half.log 2>&1
rc=$?; echo "gpucheck rc=$rc $(date +%T)" >> $D/chain.log
if [ $rc -ne 0 ]; then echo "CHAIN STOPPED: gpucheck failed" >> $D/chain.log; touch $D/DONE; exit 1; fi
ls -la $ABBENCH_CACHE_DIR/gguf >> $D/chain.log
python3 -m abbench run -p h200-peer-llamacpp --out $D/run --no-report -q > $D/run.log 2>&1
echo "run rc=$? $(date +%T)" >> $D/chain.log
touch $D/DONE
