#!/usr/bin/env bash
# issue 16 re-run, detached: GGUF export -> the profile run (engine code unchanged since the CUDA tests at be022ae)
cd "$(dirname "$0")/.."
. .dev/setup.sh
export ABBENCH_CACHE_DIR=/tmp/abcache ABBENCH_LLAMA_SERVER=/tmp/llamacpp/llama-server
D=/tmp/ab; mkdir -p $D/gpucheck
nvidia-smi > $D/gpucheck/nvidia-smi.txt 2>&1
echo "start $(date +%T)" >> $D/chain.log
t=$SECONDS; python3 -m abbench export-gguf --model qwen3-30b-a3b-half --weights random:0 --dtype bfloat16 \
    --device cuda > $D/gpucheck/export-gguf.log 2>&1
echo "export rc=$? $((SECONDS-t)) s $(date +%T)" >> $D/chain.log
python3 -m abbench run -p h200-peer-llamacpp --out $D/run --no-report -q > $D/run.log 2>&1
echo "run rc=$? $(date +%T)" >> $D/chain.log
touch $D/DONE
