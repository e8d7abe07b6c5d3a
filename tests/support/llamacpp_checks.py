"""Two llama-server behaviours the llamacpp adapter works around, measured against the real server on the tiny
preset (float32 GGUF of the engine's random:0 weights, ``-ngl 0``, one slot):

1. it closes the connection right after a streamed response (a plain one stays open), so a request sent on it
   meanwhile is dropped: back-to-back streamed completions with and without ``closes_after_stream``;
2. an output that ends inside a UTF-8 character: the stream never sends its last token, the refetch completes it.

    ABBENCH_LLAMA_SERVER=... python tests/support/llamacpp_checks.py OUT.json [THREADS]

writes the measurements (and the commit they were made at) to OUT.json, as
``results/20261201-cpu-llamacpp-connection-checks`` records them. The live tests in
``tests/peers/test_llamacpp_peer.py`` assert the properties the adapter relies on with :func:`streams`.
"""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from abbench.client import EngineClient, LlamaCppAdapter  # noqa: E402
from abbench.errors import RequestError  # noqa: E402
from abbench.peers.gguf_export import export_gguf  # noqa: E402
from abbench.peers.llamacpp_serve import gguf_cache_path, resolve_server  # noqa: E402
from abbench.profile import RequestSpec  # noqa: E402



def wait_healthy(url: str, attempts: int) -> bool:
    """Poll ``url``/health every half second until it answers 200 (True) or ``attempts`` polls have failed."""
    for _ in range(attempts):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False

def after_response(port: int, stream: bool) -> str:
    """What the server does with the connection after one response on it (keep-alive asked): "open after 1 s",
    "closed X ms after the last byte" or "data"."""
    body = json.dumps({"prompt": [1000, 2000, 3000], "n_predict": 4, "temperature": 0, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: keep-alive"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while not (data.endswith(b"\r\n0\r\n\r\n") and b'"stop":true' in data if stream else
                   b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
            data += s.recv(65536)
        s.settimeout(1.0)
        t = time.perf_counter()
        try:
            got = s.recv(100)
            return f"closed {1e3 * (time.perf_counter() - t):.2f} ms after the last byte" if got == b"" else "data"
        except socket.timeout:
            return "open after 1 s"


class _KeepsConnection(LlamaCppAdapter):
    """The llamacpp adapter without its workaround: a streamed request does not ask for the close."""

    closes_after_stream = False


def streams(url: str, n_prompts: int, max_tokens: int, *, closes_after_stream: bool = True) -> dict[str, int]:
    """``n_prompts`` back-to-back streamed completions of the four-token prompts ``1000+i, 2000, 3000, 4000``
    through the llamacpp adapter (``closes_after_stream`` as given): ok, refetched (ids completed by the
    non-streamed refetch) and each failure kind, counted."""
    adapter = LlamaCppAdapter() if closes_after_stream else _KeepsConnection()
    kinds: collections.Counter = collections.Counter()
    with EngineClient() as c:
        for i in range(n_prompts):
            try:
                got = c.complete(url, [1000 + i, 2000, 3000, 4000], request=RequestSpec(
                    max_tokens=max_tokens, timeout_s=60, ignore_eos=True), extra={}, target_prompt_tokens=4,
                    adapter=adapter)
                kinds["ok"] += 1
                kinds["refetched"] += "ids_refetched" in (got.engine or {})
            except RequestError as e:
                kinds[e.kind] += 1
    return dict(kinds)


def measure(url: str, port: int) -> dict:
    """Every measurement of the module docstring against the server at ``url``."""
    res: dict = {"after_plain_response": after_response(port, False),
                 "after_streamed_response": after_response(port, True), "back_to_back": []}
    for flag in (False, True, False, True):
        res["back_to_back"].append({"closes_after_stream": flag, "max_tokens": 2,
                                    **streams(url, 200, 2, closes_after_stream=flag)})
    res["mid_character"] = [{"max_tokens": n, **streams(url, 200, n)} for n in (2, 32)]
    return res


def main(out: str, threads: int) -> None:
    server = resolve_server()
    if server is None:
        raise SystemExit("set ABBENCH_LLAMA_SERVER to a llama-server binary (python -m abbench.peers.llamacpp_build)")
    gguf = gguf_cache_path("tiny", "random:0", "float32", "cpu")
    if not gguf.is_file():
        export_gguf("tiny", gguf, weights="random:0", dtype="float32", device="cpu")
    port = 8977
    proc = subprocess.Popen([server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                             "-ngl", "0", "-t", str(threads), "--slot-save-path", "/tmp", "--cache-ram", "0", "-c", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, attempts=120)
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True).stdout.strip())
        res = {"commit": commit, "dirty": dirty, "server": server, "threads": threads, **measure(url, port)}
    finally:
        proc.terminate()
        proc.wait(30)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "output.json", int(sys.argv[2]) if len(sys.argv) > 2 else 2)
