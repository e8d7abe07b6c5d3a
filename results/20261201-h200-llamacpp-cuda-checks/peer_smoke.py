"""On the H200: the CUDA llama-server built on the CPU machine runs, and gives the vendored engine's greedy ids
from the same random weights (tiny preset; float32 and bfloat16; experts on the GPU and in host memory)."""
import json, os, subprocess, sys, time
import httpx, torch
from abbench.peers.gguf_export import export_gguf
from abbench.engine.config import EngineConfig
from abbench.engine.runtime import Engine

BIN = sys.argv[1]
out = {"version": subprocess.run([BIN, "--version"], capture_output=True, text=True, timeout=60).stderr[-800:]}
print(out["version"], flush=True)
gen = torch.Generator().manual_seed(7)
prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (14, 128, 1024, 3000)]
N = 16
for dtype in ("float32", "bfloat16"):
    t0 = time.time()
    path = f"/tmp/tiny-{dtype}-cuda.gguf"
    export_gguf("tiny", path, weights="random:0", dtype=dtype, device="cuda")
    print(f"export {dtype}: {time.time() - t0:.1f} s, {os.path.getsize(path) / 1e6:.0f} MB", flush=True)
    eng = Engine(EngineConfig(model="tiny", weights="random:0", device="cuda", dtype=dtype, chunk_tokens=512,
                              max_context=4096, bandwidth_probe_bytes=0))
    ref = []
    for p in prompts:
        eng.reset()
        ev, _ = eng.run(p, N, ignore_eos=True)
        ref.append([e.token_id for e in ev])
    del eng; torch.cuda.empty_cache()
    kv = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"] if dtype == "float32" else ["-fa", "on"]
    for where in ("gpu", "cpu-moe"):
        args = [BIN, "-m", path, "--host", "127.0.0.1", "--port", "8931", "-c", "4096", "-np", "1", "-ngl", "99",
                "--seed", "0", "--load-mode", "none", "--cache-ram", "0", *kv] + (["--cpu-moe"] if where == "cpu-moe" else [])
        log = open(f"/tmp/ab/llama-{dtype}-{where}.log", "w")
        srv = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(240):
                try:
                    if httpx.get("http://127.0.0.1:8931/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            got, secs = [], []
            for p in prompts:
                t = time.time()
                r = httpx.post("http://127.0.0.1:8931/completion", timeout=300, json={
                    "prompt": p, "n_predict": N, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True, "stream": False})
                secs.append(round(time.time() - t, 3))
                got.append(r.json()["tokens"])
            same = [g == w for g, w in zip(got, ref)]
            first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, ref)]
            row = {"dtype": dtype, "where": where, "equal": same, "first_diff": first, "seconds": secs}
            print(json.dumps(row), flush=True)
            out[f"{dtype}-{where}"] = {**row, "llama": got, "engine": ref}
        finally:
            srv.terminate(); srv.wait(30)
json.dump(out, open("/tmp/ab/peer-smoke.json", "w"), indent=1)
