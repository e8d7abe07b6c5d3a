"""llama.cpp as a peer arm: the build recipe (abbench/peers/llamacpp_build.py), the launcher
(abbench/peers/llamacpp_serve.py), the llamacpp adapter's handling of mid-character tokens, the profiles,
and, when a llama-server binary is given ($ABBENCH_LLAMA_SERVER), the real server against the engine."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from abbench.adapters import LlamaCppAdapter
from abbench.peers import llamacpp_build as lb
from abbench.peers import llamacpp_cuda as lc
from abbench.peers import llamacpp_serve as ls
from abbench.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
LLAMA_SERVER = os.environ.get(ls.SERVER_ENV)
needs_server = pytest.mark.skipif(
    not LLAMA_SERVER or not os.access(LLAMA_SERVER, os.X_OK),
    reason=f"no llama-server binary: set {ls.SERVER_ENV} to one built with python -m abbench.peers.llamacpp_build "
           "(CI has no llama.cpp build)")


# --------------------------------------------------------------------------------------------- the recipe


def _fake_sdist(tmp: Path) -> Path:
    """A llama_cpp_python sdist in miniature: vendor/llama.cpp is a git repository with a server, the CPU and
    CUDA backends, and things a server build never reads."""
    root = tmp / "llama_cpp_python-9.9.9"
    tree = root / "vendor" / "llama.cpp"
    for rel in ("CMakeLists.txt", "tools/server/server.cpp", "tools/ui/CMakeLists.txt", "tools/ui/src/app.ts",
                "ggml/src/ggml-cpu/ops.cpp", "ggml/src/ggml-cuda/mmq.cu", "ggml/src/ggml-vulkan/x.cpp",
                "docs/build.md", "models/ggml-vocab.gguf", "tests/test-x.cpp", "convert_hf_to_gguf.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fake llama.cpp"]):
        subprocess.run(["git", "-C", str(tree), *cmd], check=True, env=env)
    sdist = tmp / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(root, arcname=root.name)
    return sdist


def test_source_trims_the_tree_and_records_the_commit(tmp_path: Path) -> None:
    sdist = _fake_sdist(tmp_path)
    commit = subprocess.run(["git", "-C", str(tmp_path / "llama_cpp_python-9.9.9/vendor/llama.cpp"), "rev-parse",
                             "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    out = tmp_path / "src.tar.gz"
    info = lb.make_source(sdist, out)
    assert info["llama_cpp_commit"] == commit and info["sdist_sha256"] == lb._sha256(sdist)
    with tarfile.open(out) as tf:
        names = set(tf.getnames())
        recorded = json.loads(tf.extractfile(f"llama.cpp/{lb.SOURCE_INFO_NAME}").read())
    kept = {"CMakeLists.txt", "tools/server/server.cpp", "tools/ui/CMakeLists.txt", "ggml/src/ggml-cpu/ops.cpp",
            "ggml/src/ggml-cuda/mmq.cu"}
    gone = {"tools/ui/src/app.ts", "ggml/src/ggml-vulkan/x.cpp", "docs/build.md", "models/ggml-vocab.gguf",
            "tests/test-x.cpp", "convert_hf_to_gguf.py", ".git/HEAD"}
    assert {f"llama.cpp/{k}" for k in kept} <= names
    assert not {f"llama.cpp/{g}" for g in gone} & names
    assert recorded["llama_cpp_commit"] == commit and ".git" in recorded["trimmed"]
    with pytest.raises(SystemExit, match="max-mib"):
        lb.make_source(sdist, tmp_path / "small.tar.gz", max_mib=1e-6)


def test_build_dry_run_prints_the_cuda_configure_and_the_server_target(tmp_path: Path) -> None:
    info = lb.make_source(_fake_sdist(tmp_path), tmp_path / "src.tar.gz")
    r = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_build", "build", "--src",
                        str(tmp_path / "src.tar.gz"), "--build-dir", str(tmp_path / "b"), "--cuda", "--jobs", "16",
                        "--cmake-arg=-DCUDA_cublas_LIBRARY=/x/libcublas.so.13", "--dry-run"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"-DLLAMA_BUILD_COMMIT={info['llama_cpp_commit'][:12]}" in r.stdout  # read from inside the tarball
    assert "-DCUDA_cublas_LIBRARY=/x/libcublas.so.13" in r.stdout
    assert "-DGGML_CUDA=ON" in r.stdout and "-DCMAKE_CUDA_ARCHITECTURES=90" in r.stdout
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in r.stdout  # no download on a machine without network
    assert "--target llama-server -j 16" in r.stdout
    assert not (tmp_path / "b").exists()  # a dry run creates nothing
    help_ = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_build", "--help"], capture_output=True,
                           text=True, cwd=REPO, timeout=60)
    assert help_.returncode == 0 and "source" in help_.stdout and "build" in help_.stdout
    st = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_build", "status", "--build-dir",
                         str(tmp_path / "none")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert st.returncode == 1 and "no build" in st.stdout


def _fake_toolkit_and_wheel(tmp: Path) -> tuple[Path, Path]:
    """A CUDA toolkit without cuBLAS (like this CPU machine's) and a Python path with an nvidia-cublas wheel
    in torch's cu13 layout."""
    toolkit = tmp / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    site = tmp / "site"
    for rel in ("nvidia/cu13/include/cublas_v2.h", "nvidia/cu13/lib/libcublas.so.13", "nvidia/cu13/lib/libcublasLt.so.13",
                "nvidia/cu13/lib/libcudart.so.13", "nvidia/cudnn/lib/libcudnn.so.9"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    return toolkit, site


def test_cuda_dependencies_come_from_the_wheel_and_a_driver_stub(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine whose toolkit has no cublas_v2.h and that has no GPU driver, cuBLAS comes from the
    nvidia-cublas wheel on the Python path and libcuda.so from a stub that exports the driver functions ggml
    links; both are in the flags and the record. A toolkit with cuBLAS and stubs needs neither."""
    import ctypes

    toolkit, site = _fake_toolkit_and_wheel(tmp_path)
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.setattr(lc, "_DRIVER_PATHS", ())  # no driver installed
    wheel = site / "nvidia" / "cu13"
    flags, record = lc.cuda_dependency_flags(tmp_path / "b", dry_run=True)
    assert f"-DCUDA_cublas_LIBRARY={wheel}/lib/libcublas.so.13" in flags
    assert f"-DCUDA_cublasLt_LIBRARY={wheel}/lib/libcublasLt.so.13" in flags
    assert f"-DCMAKE_CUDA_FLAGS=-I{wheel}/include" in flags and f"-DCMAKE_CXX_FLAGS=-I{wheel}/include" in flags
    stub = tmp_path / "b" / "cuda-driver-stub" / "libcuda.so"
    assert f"-DCUDA_cuda_driver_LIBRARY={stub}" in flags and not stub.exists()  # a dry run writes nothing
    assert record["cublas"]["source"] == "wheel" and record["driver"]["source"] == "stub"
    assert lc.runtime_library_dirs()[:1] == [str(wheel / "lib")]  # cudnn's lib holds neither library
    if shutil.which("cc") or shutil.which("gcc"):
        lc.cuda_dependency_flags(tmp_path / "b")
        assert (stub.parent / "libcuda.so.1").resolve() == stub.resolve()  # the name the loader is asked for
        lib = ctypes.CDLL(str(stub))
        for name in lc.DRIVER_STUB:
            assert getattr(lib, name)() == 999  # exported: the link resolves them
        soname = subprocess.run(["objdump", "-p", str(stub)], capture_output=True, text=True).stdout
        assert "libcuda.so.1" in soname or not shutil.which("objdump")
    (toolkit / "include" / "cublas_v2.h").write_text("")
    (toolkit / "lib64" / "stubs").mkdir(parents=True)
    (toolkit / "lib64" / "stubs" / "libcuda.so").write_text("")
    flags, record = lc.cuda_dependency_flags(tmp_path / "c", dry_run=True)
    assert flags == [] and record["cublas"] == {"source": "toolkit"} and record["driver"]["source"] == "toolkit stubs"
    with pytest.raises(SystemExit, match="no cuBLAS"):
        lc.cuda_dependency_flags(tmp_path / "d", cublas=str(tmp_path / "nowhere"), dry_run=True)
    given = ["-DCUDA_cublas_LIBRARY=/x/libcublas.so.13", "-DCUDA_cuda_driver_LIBRARY=/x/libcuda.so.1"]
    flags, record = lc.cuda_dependency_flags(tmp_path / "e", cublas=str(tmp_path / "nowhere"), driver="stub",
                                             dry_run=True, given=given)
    assert flags == [] and record["cublas"]["source"] == record["driver"]["source"] == "--cmake-arg"


def test_cmake_arg_takes_a_value_that_starts_with_a_dash(tmp_path: Path) -> None:
    lb.make_source(_fake_sdist(tmp_path), tmp_path / "src.tar.gz")
    r = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_build", "build", "--src",
                        str(tmp_path / "src.tar.gz"), "--build-dir", str(tmp_path / "b"), "--cmake-arg",
                        "-DGGML_CUDA_FORCE_CUBLAS=ON", "--dry-run"], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "-DGGML_CUDA_FORCE_CUBLAS=ON" in r.stdout and "-DGGML_CUDA=ON" not in r.stdout


def test_pack_carries_the_stripped_binary_with_its_record(tmp_path: Path) -> None:
    binary = tmp_path / "b" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    shutil.copy2(shutil.which("true"), binary)  # a real ELF executable, so strip works
    (binary.parent / lb.BUILD_INFO_NAME).write_text(json.dumps({"cuda": True, "source": {"llama_cpp_commit": "c0"}}))
    packed = lb.pack(tmp_path / "b", tmp_path / "out" / "srv.tar.xz")
    with tarfile.open(packed["tarball"]) as tf:
        assert sorted(tf.getnames()) == ["llama-server", lb.BUILD_INFO_NAME]
        tf.extractall(tmp_path / "there", filter="data")
    there = tmp_path / "there" / "llama-server"
    assert os.access(there, os.X_OK) and subprocess.run([str(there)]).returncode == 0
    info = lb.read_build_info(there)  # where the fingerprint looks: beside the binary
    assert info["source"]["llama_cpp_commit"] == "c0" and info["packed"]["binary_sha256"] == lb._sha256(there)
    with pytest.raises(SystemExit, match="nothing to pack"):
        lb.pack(tmp_path / "empty", tmp_path / "x.tar.xz")


def test_cmake_flags() -> None:
    cpu = lb.cmake_flags("0c1e57098bba43ac29e6e3b677cdceebdd22334f", cuda=False)
    assert "-DLLAMA_BUILD_COMMIT=0c1e57098bba" in cpu and not any("CUDA" in f for f in cpu)
    assert "-DBUILD_SHARED_LIBS=OFF" in cpu  # one self-contained binary
    gpu = lb.cmake_flags(None, cuda=True, cuda_arch="90a")
    assert "-DCMAKE_CUDA_ARCHITECTURES=90a" in gpu and "-DLLAMA_BUILD_COMMIT=unknown" in gpu


# ------------------------------------------------------------------------------------------- the launcher


def _fake_server(tmp: Path, cuda: bool = False) -> Path:
    """An executable 'llama-server' that prints its argv and library path, with a build record beside it."""
    binary = tmp / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho LIBS \"$LD_LIBRARY_PATH\"\necho ARGV \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    (binary.parent / lb.BUILD_INFO_NAME).write_text(json.dumps({"source": {"llama_cpp_commit": "abc123"},
                                                                "cuda": cuda}))
    return binary


def test_launcher_execs_the_server_on_the_gguf(tmp_path: Path) -> None:
    binary = _fake_server(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not read by the fake server")
    env = {**os.environ, ls.SERVER_ENV: str(binary), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_serve", "--model", "tiny", "--gguf", str(gguf),
                        "--", "--port", "9", "-np", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    record = json.loads(lines[0].removeprefix("abbench-peer: "))
    assert record["build"]["source"]["llama_cpp_commit"] == "abc123" and record["llama_server"] == str(binary)
    assert lines[-1] == f"ARGV -m {gguf} --port 9 -np 1"
    assert lines[-2] == "LIBS " + os.environ.get("LD_LIBRARY_PATH", "")  # a CPU build: the library path as is
    missing = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_serve", "--model", "tiny", "--gguf",
                              str(gguf)], capture_output=True, text=True, timeout=60,
                             env={**env, ls.SERVER_ENV: str(tmp_path / "nope")})
    assert missing.returncode == 2 and ls.SERVER_ENV in missing.stderr


def test_launcher_puts_the_python_cuda_libraries_first_for_a_cuda_build(tmp_path: Path) -> None:
    """A CUDA llama-server built elsewhere links libcudart/libcublas dynamically: the launcher puts the running
    Python's CUDA wheel library directories ahead of LD_LIBRARY_PATH and says so in its record line."""
    binary = _fake_server(tmp_path, cuda=True)
    _, site = _fake_toolkit_and_wheel(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    env = {**os.environ, ls.SERVER_ENV: str(binary), "PYTHONPATH": f"{REPO}:{site}", "LD_LIBRARY_PATH": "/opt/x"}
    r = subprocess.run([sys.executable, "-m", "abbench.peers.llamacpp_serve", "--model", "tiny", "--gguf", str(gguf),
                        "--", "-np", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    lib = str(site / "nvidia" / "cu13" / "lib")
    assert json.loads(lines[0].removeprefix("abbench-peer: "))["ld_library_path_added"] == [lib]
    assert lines[-2] == f"LIBS {lib}:/opt/x" and lines[-1] == f"ARGV -m {gguf} -np 1"


def test_describe_is_what_the_fingerprint_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from abbench.fingerprint import environment_fingerprint

    binary = _fake_server(tmp_path)
    monkeypatch.setenv(ls.SERVER_ENV, str(binary))
    monkeypatch.setenv("ABBENCH_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["{python}", "-m", "abbench.peers.llamacpp_serve", "--model", "tiny", "--dtype", "bfloat16", "--",
            "--port", "{port}"]
    d = ls.describe(argv)
    assert d["build"]["source"]["llama_cpp_commit"] == "abc123"
    assert d["gguf"] == {"path": str(tmp_path / "cache" / "gguf" / "tiny-random0-bfloat16-cpu-v1.gguf"),
                         "exists": False}
    assert ls.describe(["python", "-m", "abbench.engine"]) is None
    assert ls.describe([str(binary), "-m", "x.gguf"])["build"]["source"]["llama_cpp_commit"] == "abc123"
    fp = environment_fingerprint([argv, ["python", "-m", "abbench.engine"]])
    assert fp["peers"] == [d]
    assert "peers" not in environment_fingerprint([["python", "-m", "abbench.engine"]])


# ---------------------------------------------------------------------------------------------- the adapter


def test_llamacpp_body_without_probabilities_of_mid_character_tokens_keeps_its_ids() -> None:
    """llama.cpp's non-streamed body lists every id in `tokens` but leaves mid-character tokens out of
    completion_probabilities (seen on the real server): the ids stay, the unalignable logprobs go."""
    def pos(i: int) -> dict:
        return {"id": i, "logprob": -1.0, "top_logprobs": [{"id": i, "logprob": -1.0}, {"id": 7, "logprob": -2.0}]}

    body = {"content": "x", "tokens": [5, 6, 8], "stop": True, "stop_type": "limit", "tokens_evaluated": 4,
            "tokens_predicted": 3, "completion_probabilities": [pos(5), pos(8)]}
    parts = LlamaCppAdapter().parse_event(body)
    assert parts.token_ids == [5, 6, 8] and parts.logprobs is None and parts.final
    whole = LlamaCppAdapter().parse_event({**body, "completion_probabilities": [pos(5), pos(6), pos(8)]})
    assert whole.token_ids == [5, 6, 8] and [p[0][0] for p in whole.logprobs] == [5, 6, 8]


# --------------------------------------------------------------------------------------------- the profiles


def test_peer_profiles_load_with_per_arm_engines() -> None:
    h200 = load_profile(str(REPO / "profiles" / "h200-peer-llamacpp.toml"))
    arms = {a.name: a for a in h200.arms}
    assert list(arms) == ["chunked", "layer-major", "resident", "llamacpp-host", "llamacpp-host-ub2048",
                          "llamacpp-host-ubmax", "llamacpp-gpu"]
    assert h200.prompts.lengths == [4096, 16384, 32768]
    for name in ("chunked", "layer-major"):
        assert h200.launch_spec(name).argv[-2:] == ["--gpu-memory-budget", "24"]
    for name, a in arms.items():
        argv = h200.launch_spec(name).argv
        if not name.startswith("llamacpp"):
            assert h200.arm_engine(name).adapter == "openai" and "qwen3-30b-a3b-half" in argv
            continue
        assert h200.arm_engine(name).adapter == "llamacpp" and not a.args  # an own command takes no args
        assert argv[argv.index("--model") + 1] == "qwen3-30b-a3b-half" and "--device" in argv
        assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--device") + 1] == "cuda"
        server = argv[argv.index("--") + 1:]
        assert ("--cpu-moe" in server) == (name != "llamacpp-gpu")
        assert "--no-mmap" not in server and server[server.index("--load-mode") + 1] == "none"  # 0c1e570's flag
        ub = server[server.index("-ub") + 1] if "-ub" in server else None
        assert ub == {"llamacpp-host": None, "llamacpp-host-ub2048": "2048", "llamacpp-host-ubmax": "32768",
                      "llamacpp-gpu": None}[name]
    assert "peak_vram_gib[llamacpp-host-ubmax] <= 24" in h200.gate.checks
    for peer in ("llamacpp-host-ub2048", "llamacpp-host-ubmax"):  # faster than each host-expert arm in 24 GB
        assert f"ttft_ratio[layer-major, fresh, 32768, vs {peer}] <= 1.0" in h200.gate.checks
    cpu = load_profile(str(REPO / "profiles" / "cpu-tiny-llamacpp.toml"))
    assert [cpu.arm_engine(a.name).adapter for a in cpu.arms] == ["openai", "llamacpp"]
    assert cpu.arm_engine("llamacpp").reset_path == "/slots/0?action=erase"


# ------------------------------------------------------------------------------------- a real llama-server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _real_server(tmp_path: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """The real llama-server through the launcher on the tiny float32 GGUF (exported into a fresh cache),
    healthy; yields (base URL, port) and stops it after."""
    port = _free_port()
    env = {**os.environ, "ABBENCH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "abbench.peers.llamacpp_serve", "--model", "tiny", "--dtype",
                             "float32", "--", "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "1",
                             "-t", "2", *flags],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.5)
        yield url, port
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


@needs_server
@pytest.mark.slow
def test_real_llama_server_tokenizes_like_the_harness_and_matches_the_engine(tmp_path: Path) -> None:
    """The launcher exports the tiny float32 GGUF into the cache and starts the real server on it: it counts
    and splits prompt text exactly as the harness's tokenizer does, and its greedy ids and logprobs equal the
    vendored engine's in-process ones (float32, no flash attention, f32 KV cache)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from abbench.engine import Engine, EngineConfig
    from abbench.prompts import build_prompts
    from abbench.tokenizers import encode_ids, load_tokenizer

    with _real_server(tmp_path, "-fa", "off", "-ctk", "f32", "-ctv", "f32") as (url, _):
        tok = load_tokenizer("qwen3")
        prof = load_profile(str(REPO / "profiles" / "cpu-tiny-llamacpp.toml"))
        texts = [b.text for b in build_prompts(tok, prof.prompts)]
        texts += ["Hello, world! 123 4567 ...\n\n  tabs\tand spaces  ", "日本語のテキストと emoji 🚀 mixed", "<|im_start|>user\nhi<|im_end|>"]
        for text in texts:
            got = httpx.post(url + "/tokenize", json={"content": text, "add_special": False, "parse_special": True},
                             timeout=60).json()["tokens"]
            assert got == encode_ids(tok, text), text[:60]
        engine = Engine(EngineConfig(model="tiny", weights="random:0", device="cpu", dtype="float32",
                                     chunk_tokens=128))
        for text in texts[:2]:
            ids = encode_ids(tok, text)
            body = httpx.post(url + "/completion", json={"prompt": ids, "n_predict": 12, "temperature": 0,
                                                         "ignore_eos": True, "return_tokens": True, "n_probs": 2},
                              timeout=120).json()
            events = engine.run(ids, 12, temperature=0.0, ignore_eos=True, logprobs=2)[0]
            assert body["tokens"] == [e.token_id for e in events], text[:60]
            if len(body["completion_probabilities"]) == len(events):  # else a mid-character token left them out
                theirs = [p["logprob"] for p in body["completion_probabilities"]]
                assert max(abs(a - e.logprob) for a, e in zip(theirs, events)) < 1e-4


@needs_server
@pytest.mark.slow
def test_real_llama_server_closes_after_a_stream_and_the_client_never_reuses_it(tmp_path: Path) -> None:
    """The premise of ``LlamaCppAdapter.closes_after_stream``: llama-server keeps a connection open after a
    plain response but closes it right after a streamed one (advertising keep-alive all the same), so a request
    sent on it meanwhile is dropped. With the adapter asking for the close, back-to-back streamed completions
    never fail to connect."""
    import collections

    from abbench.client import EngineClient
    from abbench.errors import RequestError
    from abbench.profile import RequestSpec

    with _real_server(tmp_path, "-ngl", "0", "--slot-save-path", str(tmp_path), "--cache-ram", "0") as (url, port):

        def after_response(stream: bool) -> str:
            body = json.dumps({"prompt": [1000, 2000, 3000], "n_predict": 4, "temperature": 0,
                               "stream": stream}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Connection: keep-alive\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                data = b""
                while not (data.endswith(b"\r\n0\r\n\r\n") and b'"stop":true' in data if stream else
                           b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
                    chunk = s.recv(65536)
                    assert chunk, "the server closed before the response was complete"
                    data += chunk
                assert b"keep-alive" in data.split(b"\r\n\r\n")[0].lower()  # it says it keeps the connection
                s.settimeout(1.0)
                try:
                    return "closed" if s.recv(100) == b"" else "data"
                except socket.timeout:
                    return "open"

        assert after_response(stream=False) == "open"
        assert after_response(stream=True) == "closed"
        kinds: collections.Counter = collections.Counter()
        with EngineClient() as c:
            for i in range(100):
                try:
                    c.complete(url, [1000 + i, 2000, 3000, 4000], request=RequestSpec(max_tokens=4, timeout_s=30),
                               extra={}, target_prompt_tokens=4, adapter="llamacpp")
                    kinds["ok"] += 1
                except RequestError as e:
                    kinds[e.kind] += 1
        assert kinds["connect"] == 0 and kinds["ok"] >= 90, dict(kinds)


@needs_server
@pytest.mark.slow
def test_real_llama_server_outputs_ending_inside_a_character_are_completed(tmp_path: Path) -> None:
    """200 two-token streamed outputs of four-token prompts through the adapter as configured by default: every
    one ok, none dropped; those whose stream never sends the last token (it ends inside a UTF-8 character) are
    completed by the refetch (7 of 200 on the tiny preset at llama.cpp 0c1e570). tests/support/llamacpp_checks.py
    measures the same and more (results/20261201-cpu-llamacpp-connection-checks)."""
    from tests.support.llamacpp_checks import streams

    with _real_server(tmp_path, "-ngl", "0", "--slot-save-path", str(tmp_path), "--cache-ram", "0") as (url, _):
        kinds = streams(url, 200, 2)
    assert kinds.get("ok") == 200 and set(kinds) <= {"ok", "refetched"}, kinds
    assert kinds.get("refetched", 0) >= 1, kinds  # the premise: some outputs end inside a character


@needs_server
@pytest.mark.slow
def test_cuda_llama_server_serves_the_engines_cuda_weights(tmp_path: Path) -> None:
    """On a CUDA machine, with a CUDA llama-server: the GGUF of the tiny preset's weights drawn on CUDA is
    served (float32, experts in host memory) and each prompt's greedy output starts with the vendored engine's
    first id on the same weights. tests/support/llamacpp_peer_smoke.py measures every dtype and placement
    (results/20261201-h200-llamacpp-cuda-checks)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tests.support.llamacpp_peer_smoke import smoke

    out = smoke(str(LLAMA_SERVER), tmp_path, dtypes=("float32",), places=("cpu-moe",), lengths=(14, 128), n=8)
    assert "version" in out["version"]
    row = out["float32-cpu-moe"]
    assert [len(ids) for ids in row["llama"]] == [8, 8]
    assert [ids[0] for ids in row["llama"]] == [ids[0] for ids in row["engine"]]
