#!/usr/bin/env bash
# Device call A (issue 29), detached chain: llama.cpp's CUDA server built here (16 cores) while the GPU runs the
# CUDA engine tests, gpucheck at 8 full-width layers (fetch-kernel variants included) and the GGUF export; then
# h200-peer-decode and h200-decode-offload-4k, one after the other, with the CPUs free.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/ab ]; then
  mkdir -p /tmp/ab/gpucheck
  cp "$0" /tmp/ab/gpucheck/
  cat > /tmp/ab/chain.sh <<'EOF'
set -u
cd "$1"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || { echo "pip failed" >> /tmp/ab/chain.log; echo rc=1 > /tmp/ab/DONE; exit 1; }
export ABBENCH_GIT_COMMIT=$(cat .dev/commit.txt) ABBENCH_GIT_DIRTY=0 PYTHONPATH=/tmp/site:$PWD ABBENCH_CACHE_DIR=/tmp/abcache ABBENCH_LLAMA_SERVER=/tmp/lb/bin/llama-server
G=/tmp/ab/gpucheck
log() { echo "$(date +%T) $*" >> /tmp/ab/chain.log; }
{ git log -1 --format=%H; git status --short | head -60; } > $G/tree-status.txt 2>&1
{ python3 -c 'import torch, triton, transformers, gguf; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; free -g; nproc; } > $G/versions.txt 2>&1
nvidia-smi > $G/nvidia-smi.txt 2>&1
log start
( python3 -m abbench.peers.llamacpp_build build --src .dev/llamacpp-src.tar.gz --build-dir /tmp/lb --cuda --jobs 12 > $G/llamacpp-build.log 2>&1; log "build rc=$?" ) &
BUILD=$!
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 500 python3 -m pytest -o addopts="" -p no:cacheprovider -q \
  tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py tests/engine/test_engine_prefill.py \
  tests/engine/test_engine_model.py > $G/pytest-cuda.log 2>&1
rc=$?; log "tests rc=$rc"
( python3 -m abbench export-gguf --model qwen3-30b-a3b-half --weights random:0 --dtype bfloat16 --device cuda > $G/export-gguf.log 2>&1; log "export rc=$?" ) &
EXP=$!
timeout 400 python3 -m abbench.engine.gpucheck --preset qwen3-30b-a3b-half --layers 8 --out $G/gpucheck-qwen3-30b-a3b-half.json > $G/gpucheck-qwen3-30b-a3b-half.log 2>&1
g=$?; log "gpucheck rc=$g"
wait $EXP; wait $BUILD
if [ $rc -ne 0 ]; then log "CHAIN STOPPED: tests failed"; echo rc=1 > /tmp/ab/DONE; exit 1; fi
if [ -x /tmp/lb/bin/llama-server ]; then
  python3 -m abbench run -p h200-peer-decode --out /tmp/ab/peer --no-report -q > /tmp/ab/peer.log 2>&1; log "peer rc=$?"
else log "no llama-server"; fi
python3 -m abbench run -p h200-decode-offload-4k --out /tmp/ab/off4k --no-report -q > /tmp/ab/off4k.log 2>&1; log "off4k rc=$?"
echo rc=0 > /tmp/ab/DONE
EOF
  ( bash /tmp/ab/chain.sh "$PWD" ) < /dev/null > /tmp/ab/chain.out 2>&1 &
  disown
fi
while [ ! -f /tmp/ab/DONE ] && [ $(( $(date +%s) - T0 )) -lt ${WAIT:-560} ]; do sleep 5; done
cat /tmp/ab/chain.log; tail -3 /tmp/ab/gpucheck/pytest-cuda.log 2>/dev/null; grep -E "^\[|/[0-9]+\]" /tmp/ab/gpucheck/llamacpp-build.log 2>/dev/null | tail -1
tail -25 /tmp/ab/gpucheck/gpucheck-qwen3-30b-a3b-half.log 2>/dev/null
mkdir -p $OUT/g; cp /tmp/ab/gpucheck/* /tmp/ab/*.log /tmp/ab/chain.out $OUT/g/ 2>/dev/null
if [ -f /tmp/ab/DONE ]; then cat /tmp/ab/DONE; for d in peer off4k; do [ -d /tmp/ab/$d ] && (cd /tmp/ab && tar czf $OUT/$d.tgz $d); done; cp /tmp/lb/*.json $OUT/g/ 2>/dev/null; fi
echo "call took $(( $(date +%s) - T0 )) s"
