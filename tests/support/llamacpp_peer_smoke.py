"""On a CUDA machine: a CUDA llama-server (built anywhere) runs, and how often it gives the vendored engine's
greedy ids from the same random weights (tiny preset drawn on CUDA; float32 and bfloat16; experts on the GPU
and in host memory, ``--cpu-moe``).

    python tests/support/llamacpp_peer_smoke.py LLAMA_SERVER [--out peer-smoke.json] [--logs DIR]

prints one JSON row per (dtype, placement) and writes them all, with the server's ``--version`` and both
sides' ids, to ``--out``, as ``results/20261201-h200-llamacpp-cuda-checks`` records them (the server's logs go
to ``--logs``). Near-tied positions may differ between the two engines' arithmetic, so this measures; the
live test in ``tests/peers/test_llamacpp_peer.py`` asserts what holds regardless (:func:`smoke` with fewer
prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from tests.support.llamacpp_checks import wait_healthy  # noqa: E402

PORT = 8931
N_TOKENS = 16
PROMPT_LENGTHS = (14, 128, 1024, 3000)


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Random-id prompts (seed 7), one per length."""
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in lengths]


def engine_ids(dtype: str, prompt_list: list[list[int]], n: int) -> list[list[int]]:
    """The vendored engine's greedy ids on CUDA (tiny, random:0, ``dtype``), one list per prompt."""
    import torch

    from abbench.engine.config import EngineConfig
    from abbench.engine.runtime.engine import Engine

    eng = Engine(EngineConfig(model="tiny", weights="random:0", device="cuda", dtype=dtype, chunk_tokens=512,
                              max_context=4096, bandwidth_probe_bytes=0))
    ref = []
    for p in prompt_list:
        eng.reset()
        ev, _ = eng.run(p, n, ignore_eos=True)
        ref.append([e.token_id for e in ev])
    del eng
    torch.cuda.empty_cache()
    return ref


def server_ids(binary: str, gguf: str, dtype: str, where: str, prompt_list: list[list[int]], n: int,
               log_path: Path) -> tuple[list[list[int]], list[float]]:
    """llama-server's greedy ids for each prompt (every layer on the GPU; experts on the GPU, or in host memory
    with ``where = "cpu-moe"``) and each request's seconds."""
    kv = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"] if dtype == "float32" else ["-fa", "on"]
    args = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(PORT), "-c", "4096", "-np", "1", "-ngl", "99",
            "--seed", "0", "--load-mode", "none", "--cache-ram", "0", *kv] + (["--cpu-moe"] if where == "cpu-moe" else [])
    url = f"http://127.0.0.1:{PORT}"
    with open(log_path, "w") as log:
        srv = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, attempts=240)
            got, secs = [], []
            for p in prompt_list:
                t = time.time()
                r = httpx.post(url + "/completion", timeout=300, json={
                    "prompt": p, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True, "stream": False})
                secs.append(round(time.time() - t, 3))
                got.append(r.json()["tokens"])
        finally:
            srv.terminate()
            srv.wait(30)
    return got, secs


def smoke(binary: str, logs: Path, *, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
          places: tuple[str, ...] = ("gpu", "cpu-moe"), lengths: tuple[int, ...] = PROMPT_LENGTHS,
          n: int = N_TOKENS) -> dict:
    """Every (dtype, placement): the GGUF of the weights drawn on CUDA, the engine's ids, the server's ids."""
    from abbench.peers.gguf_export import export_gguf

    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"version": subprocess.run([binary, "--version"], capture_output=True, text=True,
                                           timeout=60).stderr[-800:]}
    print(out["version"], flush=True)
    prompt_list = prompts(lengths)
    for dtype in dtypes:
        t0 = time.time()
        path = str(logs / f"tiny-{dtype}-cuda.gguf")
        export_gguf("tiny", path, weights="random:0", dtype=dtype, device="cuda")
        print(f"export {dtype}: {time.time() - t0:.1f} s, {os.path.getsize(path) / 1e6:.0f} MB", flush=True)
        ref = engine_ids(dtype, prompt_list, n)
        for where in places:
            got, secs = server_ids(binary, path, dtype, where, prompt_list, n, logs / f"llama-{dtype}-{where}.log")
            same = [g == w for g, w in zip(got, ref)]
            first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, ref)]
            row = {"dtype": dtype, "where": where, "equal": same, "first_diff": first, "seconds": secs}
            print(json.dumps(row), flush=True)
            out[f"{dtype}-{where}"] = {**row, "llama": got, "engine": ref}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("binary", help="the llama-server binary")
    p.add_argument("--out", default="/tmp/ab/peer-smoke.json", help="the JSON to write")
    p.add_argument("--logs", default="/tmp/ab", help="folder for the GGUFs and the server logs")
    args = p.parse_args(argv)
    out = smoke(args.binary, Path(args.logs))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
