"""Load levels against the CPU vLLM and the vendored engine on their tiny checkpoints, driven by the load
generator directly (without a run directory of ``abbench run``): each server at concurrency 1, 4 and 8, two
rounds, every prompt also run alone; the run directories and their reports are written under ``--out``.

    python tests/support/load_cpu_peers.py --out /tmp/load-peers [--only vllm|engine]

vLLM is ``cpu-tiny-vllm``'s service (its CPU environment from ``python -m abbench.peers.vllm_env``, the
``tiny-qwen3-moe-hd64`` checkpoint, float32, eager); the engine is ``cpu-tiny``'s (tiny preset, random weights).
Each server is started in a process group of its own and stopped at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from abbench.loadgen import Level, Target, build_load_prompts, run_level  # noqa: E402
from abbench.ports import free_port  # noqa: E402
from abbench.profile import LengthDist, LoadSpec, PromptsSpec, RequestSpec, profile_from_dict  # noqa: E402
from abbench.report import write_report  # noqa: E402
from abbench.results import RunRecord, load_run, save_run  # noqa: E402
from abbench.tokenizers import load_tokenizer  # noqa: E402

LOAD = LoadSpec(concurrency=[1, 4, 8], requests=32, prompts=16, prompt_tokens=LengthDist(fixed=128),
                output_tokens=LengthDist(fixed=32), seed=0, slo=["ttft_s <= 0.5"])
MODEL = "tiny-qwen3-moe-hd64"


def _vllm(port: int) -> list[str]:
    return [sys.executable, "-m", "abbench.peers.vllm_serve", "--model", f"{MODEL}:0", "--tokenizer", "qwen3", "--",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", "2048", "--seed", "0", "--enforce-eager", "--kv-cache-memory-bytes", "1G",
            "--enable-prompt-tokens-details", "--generation-config", "vllm"]


def _engine(port: int) -> list[str]:
    return [sys.executable, "-m", "abbench.engine", "--model", "tiny", "--weights", "random:0", "--device", "cpu",
            "--port", str(port)]


def measure(name: str, out: Path) -> Path:
    port = free_port()
    argv = _vllm(port) if name == "vllm" else _engine(port)
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        t = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); see {out / f'{name}.log'}")
            try:
                if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t > 900:
                raise RuntimeError(f"{name} did not become healthy in 900 s")
            time.sleep(1)
        prompts = build_load_prompts(load_tokenizer("qwen3"), PromptsSpec(), LOAD, 32)
        target = Target(url, RequestSpec(max_tokens=32, logprobs=2), adapter="vllm" if name == "vllm" else "openai",
                        model=MODEL if name == "vllm" else None, arm=name, metrics_path="/metrics")
        run_level(Level("concurrency", 4, requests=16), target, prompts)  # warm-up: not recorded
        levels = []
        for rnd in (1, 2):
            levels.append(run_level(Level.from_spec(LOAD, "concurrency", 1, round=rnd, role="reference"), target,
                                    prompts))
            for kind, v in LOAD.levels():
                levels.append(run_level(Level.from_spec(LOAD, kind, v, round=rnd), target, prompts))
                print(levels[-1].summary(), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    arm = {"name": name, **({"adapter": "vllm", "model": MODEL} if name == "vllm" else {})}
    prof = profile_from_dict({"name": f"cpu-tiny-{name}-load", "engine": {"base_url": url}, "arms": [arm],
                              "request": {"max_tokens": 32}, "load": LOAD.model_dump(),
                              "gate": {"checks": [f"parity_under_load[{name}, c=8]"]}})
    run_dir = out / f"{name}-load"
    save_run(run_dir, RunRecord(run_id=run_dir.name, status="complete", created_at=time.time(), abbench_version="0",
                                profile=prof.model_dump(), load=levels))
    record, problems = load_run(run_dir)
    return write_report(record, problems, out / f"{run_dir.name}.md", out / run_dir.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", choices=["vllm", "engine"], default=None)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in ([a.only] if a.only else ["vllm", "engine"]):
        print(measure(name, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
