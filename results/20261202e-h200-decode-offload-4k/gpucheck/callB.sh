#!/usr/bin/env bash
# Device calls B (issue 29): a chain started once with setsid (it outlives the call that starts it), polled by
# later calls: CUDA engine tests, gpucheck at 8 full-width layers (one layer's misses: copy kernel + experts vs
# the experts reading their misses from the host), then h200-decode-offload-4k and h200-hybrid-decode-offload-4k,
# then the hybrid's gpucheck if time allows.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/ab ]; then
  mkdir -p /tmp/ab/gpucheck
  cp "$0" /tmp/ab/gpucheck/
  cat > /tmp/ab/chain.sh <<'EOF'
set -u
cd "$1"
log() { echo "$(date +%T) $*" >> /tmp/ab/chain.log; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || { log "pip failed"; echo rc=1 > /tmp/ab/DONE; exit 1; }
export ABBENCH_GIT_COMMIT=$(cat .dev/commit.txt) ABBENCH_GIT_DIRTY=0 PYTHONPATH=/tmp/site:$PWD ABBENCH_CACHE_DIR=/tmp/abcache
G=/tmp/ab/gpucheck
{ python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; free -g; nproc; } > $G/versions.txt 2>&1
nvidia-smi > $G/nvidia-smi.txt 2>&1
log "start at $ABBENCH_GIT_COMMIT"
ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 480 python3 -m pytest -o addopts="" -p no:cacheprovider -q \
  tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py > $G/pytest-cuda.log 2>&1
rc=$?; log "tests rc=$rc"
timeout 400 python3 -m abbench.engine.gpucheck --preset qwen3-30b-a3b-half --layers 8 --out $G/gpucheck-qwen3-30b-a3b-half.json > $G/gpucheck-qwen3-30b-a3b-half.log 2>&1
g=$?; log "gpucheck rc=$g"
if [ $rc -ne 0 ] || [ $g -ne 0 ]; then log "CHAIN STOPPED"; echo rc=1 > /tmp/ab/DONE; exit 1; fi
python3 -m abbench run -p h200-decode-offload-4k --out /tmp/ab/off4k --no-report -q > /tmp/ab/off4k.log 2>&1; log "off4k rc=$?"
python3 -m abbench run -p h200-hybrid-decode-offload-4k --out /tmp/ab/hyb4k --no-report -q > /tmp/ab/hyb4k.log 2>&1; log "hyb4k rc=$?"
echo rc=0 > /tmp/ab/DONE
timeout 400 python3 -m abbench.engine.gpucheck --preset qwen3.5-35b-a3b --layers 8 --prompt-tokens 4096 --out $G/gpucheck-hybrid-4k.json > $G/gpucheck-hybrid-4k.log 2>&1
log "gpucheck hybrid rc=$?"
echo done > /tmp/ab/ALL
EOF
  setsid bash /tmp/ab/chain.sh "$PWD" < /dev/null > /tmp/ab/chain.out 2>&1 &
fi
while [ ! -f /tmp/ab/${UNTIL:-DONE} ] && [ $(( $(date +%s) - T0 )) -lt ${WAIT:-560} ]; do sleep 5; done
cat /tmp/ab/chain.log; tail -3 /tmp/ab/gpucheck/pytest-cuda.log 2>/dev/null
tail -22 /tmp/ab/gpucheck/gpucheck-qwen3-30b-a3b-half.log 2>/dev/null
tail -12 /tmp/ab/gpucheck/gpucheck-hybrid-4k.log 2>/dev/null
tail -4 /tmp/ab/off4k.log /tmp/ab/hyb4k.log 2>/dev/null
mkdir -p $OUT/g; cp /tmp/ab/gpucheck/* /tmp/ab/*.log /tmp/ab/chain.out $OUT/g/ 2>/dev/null
for d in off4k hyb4k; do [ -f /tmp/ab/$d/run.json ] && (cd /tmp/ab && tar czf $OUT/$d.tgz $d); done
echo "call took $(( $(date +%s) - T0 )) s"
