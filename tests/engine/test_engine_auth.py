"""The serving API key: every route but /health refuses a request without it, and the launcher (both backends:
the vendored engine and the transformers reference) refuses to listen beyond loopback without one unless told
``--insecure-no-auth``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from abbench.engine.config import EngineConfig  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.serve.launch import API_KEY_ENV, is_loopback  # noqa: E402
from abbench.engine.serve.server import create_app  # noqa: E402
from abbench.engine.serve.tokenizer import load_tokenizer  # noqa: E402
from tests.support.uvicorn_thread import ServerThread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "engine-key-5c2e8a1f9d3b7e60"


@pytest.fixture(scope="module")
def keyed():  # type: ignore[no-untyped-def]
    engine = Engine(EngineConfig(model="tiny", weights="random:0", device="cpu", chunk_tokens=16, max_context=128))
    served = ServerThread(create_app(engine, load_tokenizer("qwen3"), served_model_name="tiny", api_key=KEY))
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client
    served.stop()


BODY = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
ROUTES = [("POST", "/v1/completions", BODY), ("POST", "/v1/completions", {**BODY, "stream": True}),
          ("POST", "/reset", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
          ("GET", "/nothing-here", None)]


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"bearer {KEY}", KEY, f"Bearer {KEY}x", f"Basic {KEY}"],
                         ids=["none", "wrong", "lowercase-scheme", "no-scheme", "longer", "basic"])
def test_every_route_but_health_refuses_a_request_without_the_key(keyed, header) -> None:  # type: ignore[no-untyped-def]
    headers = {"Authorization": header} if header else {}
    for method, path, body in ROUTES:
        r = keyed.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
        assert KEY not in r.text and r.headers["www-authenticate"] == "Bearer"
    assert keyed.get("/health", headers=headers).status_code == 200


def test_the_key_opens_every_route(keyed) -> None:  # type: ignore[no-untyped-def]
    auth = {"Authorization": f"Bearer {KEY}"}
    r = keyed.post("/v1/completions", json=BODY, headers=auth)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    assert keyed.post("/reset", headers=auth).status_code == 200
    assert keyed.get("/metrics", headers=auth).status_code == 200
    assert keyed.get("/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
    assert keyed.get("/nothing-here", headers=auth).status_code == 404


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "192.168.0.10", "8.8.8.8", "no-such-host.invalid"):
        assert not is_loopback(host), host


BACKEND_ARGS = {"engine": [], "transformers": ["--backend", "transformers", "--model", "tiny-qwen3-moe:0"]}


def _refusal(backend: str, host: str, extra: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "abbench.engine", *BACKEND_ARGS[backend], "--host", host, *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
@pytest.mark.parametrize("backend", ["engine", "transformers"])
def test_unkeyed_non_loopback_bind_is_refused(backend: str, host: str, tmp_path: Path) -> None:
    """Both backends go through one launcher and one guard: the same refusal, before anything is loaded (the
    transformers backend writes no tiny checkpoint into the cache first)."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {"ABBENCH_CACHE_DIR": str(tmp_path)}
    res = _refusal(backend, host, ["--port", "0"], env)
    assert res.returncode == 2, res.stderr
    assert f"--host {host} is not a loopback address and no API key is set" in res.stderr
    assert API_KEY_ENV in res.stderr and "--insecure-no-auth" in res.stderr
    empty = _refusal(backend, host, ["--api-key", " "], env)
    assert empty.returncode == 2 and "--api-key is empty" in empty.stderr
    assert list(tmp_path.iterdir()) == []
    if backend == "transformers":  # word for word the engine's refusal (the error line, after the program name)
        engine = _refusal("engine", host, ["--port", "0"], env)
        assert res.stderr.splitlines()[-1].split(": error: ", 1)[1] == \
            engine.stderr.splitlines()[-1].split(": error: ", 1)[1]


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "abbench.engine", "--port", "0", "--max-context", "64", *args],
                            cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"server exited early: {''.join(lines)}"
        lines.append(line)
        m = re.match(r"abbench engine ready: http://[^:]+:(\d+)", line)
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}", lines
    proc.kill()
    pytest.fail(f"no ready line: {''.join(lines)}")


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    return out


@pytest.mark.slow
def test_keyed_engine_process_on_all_interfaces(tmp_path: Path) -> None:
    """With the key in the environment it binds 0.0.0.0, refuses unauthenticated requests, serves keyed ones,
    and never prints the key."""
    proc, url, lines = _start(["--host", "0.0.0.0", "--log-level", "info"], {**os.environ, API_KEY_ENV: KEY})
    try:
        assert "API key required" in lines[-1]
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            assert client.post("/v1/completions", json=BODY).status_code == 401
            assert client.post("/reset").status_code == 401
            r = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200
    finally:
        out = "".join(lines) + _stop(proc)
    assert KEY not in out
    assert "http: httptools, event loop: uvloop" in out  # the engine extra's fast paths, picked and said
    # Told explicitly, it serves open on all interfaces.
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc, url, lines = _start(["--host", "0.0.0.0", "--insecure-no-auth", "--log-level", "warning"], env)
    try:
        assert "no API key" in lines[-1]
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    finally:
        _stop(proc)


@pytest.mark.slow
def test_keyed_reference_process() -> None:
    """The transformers backend takes the key the same way: unauthenticated requests are refused, keyed ones
    served, the key never printed."""
    args = [*BACKEND_ARGS["transformers"], "--tokenizer", "qwen3", "--host", "0.0.0.0", "--log-level", "info"]
    proc, url, lines = _start(args, {**os.environ, API_KEY_ENV: KEY})
    try:
        assert "transformers reference" in lines[-1] and "API key required" in lines[-1]
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            assert client.post("/v1/completions", json=BODY).status_code == 401
            assert client.post("/reset").status_code == 401
            r = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    finally:
        out = "".join(lines) + _stop(proc)
    assert KEY not in out
