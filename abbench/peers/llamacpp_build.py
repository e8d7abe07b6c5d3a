"""The recipe that builds llama.cpp's ``llama-server`` (CPU here, CUDA on the H200) from a carried source tarball.

    python -m abbench.peers.llamacpp_build source --sdist llama_cpp_python-0.3.36.tar.gz --out SRC.tar.gz
    python -m abbench.peers.llamacpp_build build  --src SRC.tar.gz --build-dir DIR [--cuda] [--jobs N] [--detach]
    python -m abbench.peers.llamacpp_build status --build-dir DIR

Contract
--------
* ``source`` takes the llama.cpp tree inside a llama-cpp-python sdist from PyPI (``pip download --no-deps
  --no-binary=:all: llama-cpp-python==0.3.36 -d DIR``; ``--pip-download DIR`` runs exactly that), reads its
  llama.cpp commit from the sdist's own git metadata (``.git/modules/vendor/llama.cpp``), leaves out what a
  ``llama-server`` build never reads (:data:`TRIM`: docs, models, tests, examples, the web UI's sources, the
  GPU backends other than CUDA, ...), writes ``LLAMACPP_SOURCE.json`` (commit, commit date and subject, the
  sdist's name and sha256, what was left out) at the tree's root and packs it as ``llama.cpp/`` into a
  gzipped tarball. It refuses a tarball over ``--max-mib`` (default 48: the device takes 64 MiB of carried
  files per call, the rest of the carried tree included).
* ``build`` unpacks the tarball (once: a ``.src-sha256`` stamp), configures with CMake + Ninja
  (:func:`cmake_flags`: Release, static libraries, tests/examples/UI off, the commit from
  ``LLAMACPP_SOURCE.json``; ``--cuda``: ``-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=<arch>``, default 90 for
  the H200), builds only the ``llama-server`` target and writes ``<build-dir>/bin/llama-server.build.json``
  beside the binary: the source record, the CMake flags, compilers and CUDA toolkit from the CMake cache,
  ``llama-server --version``, the binary's sha256 and the build time. A run cites that file (the fingerprint
  reads it, :mod:`abbench.peers.llamacpp_serve`). ``--dry-run`` prints the commands and runs nothing;
  ``--detach`` starts the build in the background (its own session, output in ``<build-dir>/build.log``,
  state in ``<build-dir>/build.status.json``) so a build longer than one device call goes on across calls;
  ``status`` prints that state. Re-running ``build`` on the same build dir is incremental.

* ``build --cuda`` finds what ggml's CUDA backend links besides the toolkit (:mod:`abbench.peers.llamacpp_cuda`):
  cuBLAS from the toolkit, else from an ``nvidia-cublas`` wheel (``--cublas auto``: the running Python's
  ``nvidia/cu13`` or ``nvidia/cublas``, the layout torch's CUDA wheels install; or ``--cublas DIR`` with
  ``include/cublas_v2.h`` and ``lib/libcublas.so*``), and the driver library ``libcuda.so`` from the toolkit's
  stubs or the driver, else (a machine without a GPU driver) a link-time stub it compiles (``DRIVER_STUB``,
  the driver functions ggml's CUDA memory pool calls; the real ``libcuda.so.1`` is loaded at run time). The
  choices go into the CMake flags and the build record (``cuda_dependencies``). So one command builds a CUDA
  server on a CPU machine as well as on the GPU machine.
* ``pack`` strips the built binary and puts it with its build record into one ``.tar.xz`` (~42 MB for the
  CUDA server) to carry to another machine; ``tar xJf`` there gives ``llama-server`` and
  ``llama-server.build.json`` side by side, which is where the fingerprint looks for the record.

No network is needed by ``build``: the UI is not downloaded (``LLAMA_USE_PREBUILT_UI=OFF``), nothing is
fetched by CMake. ``--cmake-arg -DX=Y`` and ``--cmake-arg=-DX=Y`` are the same (a value that starts with a dash
is taken as the value).

Run time: a CUDA build links ``libcudart``/``libcublas`` dynamically;
:func:`abbench.peers.llamacpp_cuda.runtime_library_dirs` lists the Python ``nvidia`` wheel directories that
hold them, which :mod:`abbench.peers.llamacpp_serve` puts on ``LD_LIBRARY_PATH`` before it starts the server.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from abbench.peers.llamacpp_cuda import _version_env, cuda_dependency_flags

__all__ = ["BUILD_INFO_NAME", "SOURCE_INFO_NAME", "TRIM", "build_info_path", "cmake_flags", "main", "pack",
           "read_build_info"]

SOURCE_INFO_NAME = "LLAMACPP_SOURCE.json"
BUILD_INFO_NAME = "llama-server.build.json"
DEFAULT_SDIST = "llama-cpp-python==0.3.36"
DEFAULT_MAX_MIB = 48.0
CUDA_ARCH_H200 = "90"

#: Paths (relative to the llama.cpp root) a llama-server build never reads. Everything else is kept, so every
#: CMakeLists.txt the configure step visits (tools/*, vendor/*, ggml/src/ggml-cpu, ggml/src/ggml-cuda) is there.
TRIM: tuple[str, ...] = (
    ".git", ".github", ".devops", ".gemini", ".pi", "docs", "models", "media", "tests", "examples", "pocs",
    "benches", "gguf-py", "conversion", "grammars", "requirements", "skills", "app", "ci", "flake.nix",
    "build-xcframework.sh", "convert_hf_to_gguf.py", "convert_hf_to_gguf_update.py",
    "convert_llama_ggml_to_gguf.py", "convert_lora_to_gguf.py",
    "tools/ui/src", "tools/ui/static", "tools/ui/tests", "tools/ui/package-lock.json",
    "tools/server/tests", "tools/server/bench", "tools/server/public", "tools/server/public_legacy",
    "ggml/src/ggml-vulkan", "ggml/src/ggml-sycl", "ggml/src/ggml-metal", "ggml/src/ggml-opencl",
    "ggml/src/ggml-cann", "ggml/src/ggml-webgpu", "ggml/src/ggml-hexagon", "ggml/src/ggml-openvino",
    "ggml/src/ggml-et", "ggml/src/ggml-virtgpu", "ggml/src/ggml-zdnn", "ggml/src/ggml-zendnn",
    "ggml/src/ggml-rpc",
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _git(tree: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


# ------------------------------------------------------------------------------------------------ source


def _find_llamacpp(root: Path) -> Path:
    for cand in (root / "vendor" / "llama.cpp", root):
        if (cand / "CMakeLists.txt").is_file() and (cand / "tools" / "server").is_dir():
            return cand
    raise SystemExit(f"no llama.cpp tree (vendor/llama.cpp with tools/server) under {root}")


def _pip_download(dest: Path, spec: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", spec, "-d", str(dest)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download left no llama_cpp_python-*.tar.gz in {dest}")
    return found[-1]


def make_source(sdist: Path, out: Path, max_mib: float = DEFAULT_MAX_MIB) -> dict:
    """Unpack ``sdist``, trim its llama.cpp tree, record its commit and pack it into ``out``."""
    with tempfile.TemporaryDirectory(prefix="llamacpp-src-") as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        tops = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(tops) != 1:
            raise SystemExit(f"{sdist}: expected one top-level directory, found {[p.name for p in tops]}")
        tree = _find_llamacpp(tops[0])
        commit = _git(tree, "rev-parse", "HEAD")
        info = {
            "llama_cpp_commit": commit,
            "llama_cpp_commit_date": _git(tree, "log", "-1", "--format=%cI"),
            "llama_cpp_commit_subject": _git(tree, "log", "-1", "--format=%s"),
            "sdist": sdist.name,
            "sdist_sha256": _sha256(sdist),
            "trimmed": [],
        }
        if commit is None:
            raise SystemExit(f"{sdist}: no git metadata for vendor/llama.cpp; cannot record the llama.cpp commit")
        for rel in TRIM:
            p = tree / rel
            if p.is_dir():
                shutil.rmtree(p)
                info["trimmed"].append(rel)
            elif p.exists():
                p.unlink()
                info["trimmed"].append(rel)
        (tree / SOURCE_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w:gz", compresslevel=9) as tf:
            tf.add(tree, arcname="llama.cpp")
        size = partial.stat().st_size
        if size > max_mib * 2**20:
            partial.unlink()
            raise SystemExit(f"the trimmed source is {size / 2**20:.1f} MiB > --max-mib {max_mib}; trim more (TRIM)")
        partial.replace(out)
    info["tarball"] = str(out)
    info["tarball_bytes"] = size
    info["tarball_sha256"] = _sha256(out)
    return info


# ------------------------------------------------------------------------------------------------- build


def cmake_flags(commit: str | None, *, cuda: bool, cuda_arch: str = CUDA_ARCH_H200, native: bool = True) -> list[str]:
    """The CMake cache flags of a llama-server build (recorded verbatim in the build record)."""
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
        "-DLLAMA_BUILD_NUMBER=0",
        f"-DLLAMA_BUILD_COMMIT={(commit or 'unknown')[:12]}",
    ]
    if cuda:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    return flags


def _unpack(src: Path, build_dir: Path) -> Path:
    """The llama.cpp tree to build: ``src`` itself if it is a directory, else the tarball unpacked once."""
    if src.is_dir():
        return _find_llamacpp(src)
    digest = _sha256(src)
    tree = build_dir / "src" / "llama.cpp"
    stamp = build_dir / "src" / ".src-sha256"
    if tree.is_dir() and stamp.is_file() and stamp.read_text().strip() == digest:
        return tree
    if (build_dir / "src").exists():
        shutil.rmtree(build_dir / "src")
    (build_dir / "src").mkdir(parents=True)
    with tarfile.open(src) as tf:
        tf.extractall(build_dir / "src", filter="data")
    stamp.write_text(digest + "\n")
    return tree


def _commands(tree: Path, build_dir: Path, flags: list[str], jobs: int) -> list[list[str]]:
    obj = build_dir / "build"
    return [
        ["cmake", "-S", str(tree), "-B", str(obj), "-G", "Ninja", *flags],
        ["cmake", "--build", str(obj), "--target", "llama-server", "-j", str(jobs)],
    ]


def build_info_path(build_dir: Path) -> Path:
    return build_dir / "bin" / BUILD_INFO_NAME


def read_build_info(binary: str | Path) -> dict | None:
    """The build record next to a ``llama-server`` binary (None if there is none or it is unreadable)."""
    p = Path(binary).resolve().parent / BUILD_INFO_NAME
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _cmake_cache(obj: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in (obj / "CMakeCache.txt").read_text().splitlines():
            if line and not line.startswith(("#", "//")) and "=" in line and ":" in line.split("=", 1)[0]:
                key, value = line.split("=", 1)
                out[key.split(":", 1)[0]] = value
    except OSError:
        pass
    return out


def _tool_version(argv: list[str], env: dict[str, str] | None = None) -> str | None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (r.stdout + r.stderr).strip()
    return text or None


def _write_status(build_dir: Path, **fields) -> None:
    p = build_dir / "build.status.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({**fields, "updated_at": time.time()}, indent=2) + "\n")
    tmp.replace(p)


def run_build(src: Path, build_dir: Path, *, cuda: bool, cuda_arch: str, jobs: int, native: bool,
              dry_run: bool = False, extra: list[str] | None = None, cublas: str = "auto",
              driver: str = "auto") -> dict | None:
    build_dir = build_dir.resolve()
    deps: dict | None = None
    if cuda:
        dep_flags, deps = cuda_dependency_flags(build_dir, cublas=cublas, driver=driver, dry_run=dry_run,
                                                given=extra)
        extra = dep_flags + list(extra or [])
    if dry_run:
        tree = src if src.is_dir() else build_dir / "src" / "llama.cpp"
        source = {}
        if src.is_dir() and (tree / SOURCE_INFO_NAME).is_file():
            source = json.loads((tree / SOURCE_INFO_NAME).read_text())
        elif src.is_file():
            with tarfile.open(src) as tf:
                try:
                    source = json.loads(tf.extractfile(f"llama.cpp/{SOURCE_INFO_NAME}").read())
                except (KeyError, AttributeError, ValueError):
                    source = {}
        flags = cmake_flags(source.get("llama_cpp_commit"), cuda=cuda, cuda_arch=cuda_arch, native=native)
        flags += list(extra or [])
        if deps and deps["driver"]["source"] == "stub":
            print(f"+ cc -shared -Wl,-soname,libcuda.so.1 -o {deps['driver']['library']}  # driver stub")
        if not src.is_dir():
            print(f"+ tar xzf {src} -C {build_dir / 'src'}")
        for cmd in _commands(tree, build_dir, flags, jobs):
            print("+", " ".join(cmd))
        print(f"+ write {build_info_path(build_dir)}")
        return None
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _write_status(build_dir, state="running", pid=os.getpid(), started_at=started)
    try:
        tree = _unpack(src, build_dir)
        source_file = tree / SOURCE_INFO_NAME
        source = json.loads(source_file.read_text()) if source_file.is_file() else {
            "llama_cpp_commit": _git(tree, "rev-parse", "HEAD"), "note": f"no {SOURCE_INFO_NAME}: read from git"}
        flags = cmake_flags(source.get("llama_cpp_commit"), cuda=cuda, cuda_arch=cuda_arch, native=native)
        flags += list(extra or [])
        for cmd in _commands(tree, build_dir, flags, jobs):
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        obj = build_dir / "build"
        binary = obj / "bin" / "llama-server"
        if not binary.is_file():
            raise SystemExit(f"the build finished without {binary}")
        bindir = build_dir / "bin"
        bindir.mkdir(exist_ok=True)
        shutil.copy2(binary, bindir / "llama-server")
        cache = _cmake_cache(obj)
        info = {
            "binary": str(bindir / "llama-server"),
            "binary_sha256": _sha256(bindir / "llama-server"),
            "source": source,
            "cmake_flags": flags,
            "cuda": cuda,
            "cuda_architectures": cache.get("CMAKE_CUDA_ARCHITECTURES") if cuda else None,
            "cuda_dependencies": deps,
            "cxx_compiler": cache.get("CMAKE_CXX_COMPILER"),
            "cxx_compiler_version": _tool_version([cache.get("CMAKE_CXX_COMPILER", "c++"), "--version"]),
            "cuda_compiler": cache.get("CMAKE_CUDA_COMPILER") if cuda else None,
            "cuda_compiler_version": (_tool_version([cache["CMAKE_CUDA_COMPILER"], "--version"])
                                      if cuda and cache.get("CMAKE_CUDA_COMPILER") else None),
            "cmake_version": _tool_version(["cmake", "--version"]),
            "server_version": _tool_version([str(bindir / "llama-server"), "--version"], _version_env(deps)),
            "build_seconds": round(time.time() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": os.uname().nodename,
            "jobs": jobs,
        }
        build_info_path(build_dir).write_text(json.dumps(info, indent=2) + "\n")
        _write_status(build_dir, state="done", pid=os.getpid(), started_at=started, binary=info["binary"],
                      build_seconds=info["build_seconds"])
        return info
    except BaseException as e:
        _write_status(build_dir, state="failed", pid=os.getpid(), started_at=started, error=repr(e)[:500])
        raise


def pack(build_dir: Path, out: Path, *, strip: bool = True) -> dict:
    """``<build-dir>/bin/llama-server`` (stripped) and its build record in one ``.tar.xz`` to carry."""
    bindir = build_dir.resolve() / "bin"
    binary, record = bindir / "llama-server", build_info_path(build_dir.resolve())
    if not binary.is_file() or not record.is_file():
        raise SystemExit(f"nothing to pack: {binary} and {record} come from a finished build")
    info = json.loads(record.read_text())
    with tempfile.TemporaryDirectory(prefix="llamacpp-pack-") as tmp:
        packed = Path(tmp) / "llama-server"
        if strip:
            subprocess.run([os.environ.get("STRIP") or "strip", "-o", str(packed), str(binary)], check=True)
        else:
            shutil.copy2(binary, packed)
        info["packed"] = {"stripped": strip, "binary_sha256": _sha256(packed), "from": str(binary),
                          "packed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (Path(tmp) / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w:xz", preset=9) as tf:
            tf.add(packed, arcname="llama-server")
            tf.add(Path(tmp) / BUILD_INFO_NAME, arcname=BUILD_INFO_NAME)
        partial.replace(out)
    return {"tarball": str(out), "bytes": out.stat().st_size, "binary_sha256": info["packed"]["binary_sha256"]}


def _detach(argv: list[str], build_dir: Path) -> int:
    """Start this command again without --detach in its own session, output to build.log; return at once."""
    build_dir.mkdir(parents=True, exist_ok=True)
    log = open(build_dir / "build.log", "ab")
    cmd = [sys.executable, "-m", "abbench.peers.llamacpp_build", *[a for a in argv if a != "--detach"]]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    _write_status(build_dir, state="running", pid=proc.pid, started_at=time.time())
    print(f"building in the background: pid {proc.pid}, log {build_dir / 'build.log'}; "
          f"python -m abbench.peers.llamacpp_build status --build-dir {build_dir}")
    return 0


def _status(build_dir: Path) -> int:
    p = build_dir / "build.status.json"
    if not p.is_file():
        print(f"no build under {build_dir}")
        return 1
    st = json.loads(p.read_text())
    if st.get("state") == "running":
        try:
            os.kill(int(st["pid"]), 0)
        except (OSError, KeyError, ValueError):
            st["state"] = "died"
    log = build_dir / "build.log"
    tail = log.read_text(errors="replace").splitlines()[-5:] if log.is_file() else []
    print(json.dumps(st, indent=2))
    for line in tail:
        print("  |", line)
    return 0 if st.get("state") in ("done", "running") else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m abbench.peers.llamacpp_build",
                                 description="Build llama.cpp's llama-server (CPU or CUDA) from a carried source "
                                             "tarball cut from the llama-cpp-python sdist, and record how.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("source", help="trim the sdist's llama.cpp tree into a small source tarball")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--sdist", type=Path, help="llama_cpp_python-X.tar.gz (from pip download)")
    g.add_argument("--pip-download", type=Path, metavar="DIR",
                   help=f"run pip download --no-deps --no-binary=:all: {DEFAULT_SDIST} into DIR first")
    s.add_argument("--out", type=Path, required=True, help="the tarball to write (.tar.gz)")
    s.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help="refuse a larger tarball (default 48)")
    b = sub.add_parser("build", help="configure and build llama-server, write the build record beside it")
    b.add_argument("--src", type=Path, required=True, help="the source tarball (or an unpacked llama.cpp tree)")
    b.add_argument("--build-dir", type=Path, required=True, help="where to unpack, build and put bin/")
    b.add_argument("--cuda", action="store_true", help=f"GGML_CUDA=ON (default arch {CUDA_ARCH_H200}: H200)")
    b.add_argument("--cuda-arch", default=CUDA_ARCH_H200, help="CMAKE_CUDA_ARCHITECTURES with --cuda")
    b.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 2)
    b.add_argument("--no-native", action="store_true", help="GGML_NATIVE=OFF (portable CPU code)")
    b.add_argument("--cmake-arg", action="append", default=[], metavar="-DX=Y",
                   help="extra CMake cache flag (repeatable; recorded)")
    b.add_argument("--cublas", default="auto", metavar="auto|toolkit|DIR",
                   help="with --cuda: where cuBLAS comes from (default auto: the toolkit's, else the running "
                        "Python's nvidia-cublas wheel; DIR holds include/cublas_v2.h and lib/libcublas.so*)")
    b.add_argument("--cuda-driver", default="auto", metavar="auto|stub|FILE",
                   help="with --cuda: the libcuda.so to link (default auto: the toolkit's stubs or the installed "
                        "driver, else a link-time stub, for a build machine without a GPU driver)")
    b.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    b.add_argument("--detach", action="store_true", help="build in the background (see status)")
    st = sub.add_parser("status", help="state of a (detached) build")
    st.add_argument("--build-dir", type=Path, required=True)
    pk = sub.add_parser("pack", help="the built binary (stripped) and its build record in one .tar.xz to carry")
    pk.add_argument("--build-dir", type=Path, required=True)
    pk.add_argument("--out", type=Path, required=True, help="the tarball to write (.tar.xz)")
    pk.add_argument("--no-strip", action="store_true", help="pack the binary as built")
    # "--cmake-arg -DX=Y": argparse would read -DX=Y as an option; take it as the value
    argv = [f"--cmake-arg={argv[i + 1]}" if a == "--cmake-arg" and i + 1 < len(argv) else a
            for i, a in enumerate(argv) if not (i and argv[i - 1] == "--cmake-arg")]
    args = ap.parse_args(argv)

    if args.cmd == "source":
        sdist = args.sdist or _pip_download(args.pip_download, DEFAULT_SDIST)
        info = make_source(sdist, args.out, args.max_mib)
        print(json.dumps({k: v for k, v in info.items() if k != "trimmed"}, indent=2))
        print(f"{args.out}: {info['tarball_bytes'] / 2**20:.2f} MiB")
        return 0
    if args.cmd == "status":
        return _status(args.build_dir)
    if args.cmd == "pack":
        packed = pack(args.build_dir, args.out, strip=not args.no_strip)
        print(json.dumps(packed, indent=2))
        print(f"{args.out}: {packed['bytes'] / 2**20:.1f} MiB; on the other machine: mkdir -p D && tar xJf "
              f"{args.out.name} -C D && export ABBENCH_LLAMA_SERVER=D/llama-server")
        return 0
    if args.detach and not args.dry_run:
        return _detach(argv, args.build_dir.resolve())
    info = run_build(args.src.resolve(), args.build_dir, cuda=args.cuda, cuda_arch=args.cuda_arch,
                     jobs=args.jobs, native=not args.no_native, dry_run=args.dry_run, extra=args.cmake_arg,
                     cublas=args.cublas, driver=args.cuda_driver)
    if info is not None:
        print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
