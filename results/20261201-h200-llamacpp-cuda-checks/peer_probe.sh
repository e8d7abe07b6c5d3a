cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
xz -dc .peer/llama-server.xz > /tmp/llama-server && chmod +x /tmp/llama-server
L1=$(dirname "$(find /opt/torch/.venv -name 'libcublas.so.13' | head -1)"); export LD_LIBRARY_PATH=$L1:$LD_LIBRARY_PATH
free -g > $OUT/probe.log; df -h /tmp >> $OUT/probe.log
t0=$SECONDS
timeout 200 python3 -c "
import time; t=time.time()
from abbench.peers.gguf_export import export_gguf
s = export_gguf('qwen3-30b-a3b-half', '/tmp/half.gguf', weights='random:0', dtype='bfloat16', device='cuda')
print('export', round(time.time()-t,1), 's', {k: v for k, v in s.items() if k != 'metadata'})
" >> $OUT/probe.log 2>&1
echo "export rc=$? $((SECONDS-t0)) s" >> $OUT/probe.log; ls -la /tmp/half.gguf >> $OUT/probe.log
for ub in 32768 8192; do
  t1=$SECONDS
  /tmp/llama-server -m /tmp/half.gguf --host 127.0.0.1 --port 8932 -c 33280 -np 1 -ngl 99 -fa on --load-mode none --cache-ram 0 --cpu-moe -ub $ub -b $ub > $OUT/llama-ub$ub.log 2>&1 &
  pid=$!
  python3 -c "
import time, httpx
for i in range(300):
    try:
        if httpx.get('http://127.0.0.1:8932/health', timeout=2).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)
"
  echo "ub=$ub ready after $((SECONDS-t1)) s" >> $OUT/probe.log
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> $OUT/probe.log
  python3 - >> $OUT/probe.log 2>&1 <<'PY'
import time, httpx, torch
ids = torch.randint(0, 150000, (16384,), generator=torch.Generator().manual_seed(3)).tolist()
for n in (4096, 16384):
    t = time.time()
    r = httpx.post("http://127.0.0.1:8932/completion", timeout=120, json={"prompt": ids[:n], "n_predict": 2,
        "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
    j = r.json(); print("prompt", n, "wall", round(time.time() - t, 3), "timings", j.get("timings"), flush=True)
PY
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> $OUT/probe.log
  kill $pid; wait $pid
  grep -i "compute buffer\|CUDA_Host\|model buffer\|KV buffer" $OUT/llama-ub$ub.log >> $OUT/probe.log
done
