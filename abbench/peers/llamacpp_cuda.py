"""What a CUDA build of ``llama-server`` links besides the CUDA toolkit, and where the built server finds its
CUDA libraries at run time (part of the recipe, :mod:`abbench.peers.llamacpp_build`).

* :func:`cuda_dependency_flags`: cuBLAS from the toolkit, else from an ``nvidia-cublas`` wheel (``auto``: the
  running Python's ``nvidia/cu13``, ``nvidia/cu12`` or ``nvidia/cublas``, the layout torch's CUDA wheels
  install; or a directory with ``include/cublas_v2.h`` and ``lib/libcublas.so*``), and the driver library
  ``libcuda.so`` from the toolkit's stubs or the driver, else a link-time stub compiled here
  (:data:`DRIVER_STUB`); the CMake flags and the build record's ``cuda_dependencies``.
* :func:`runtime_library_dirs` and :func:`with_library_dirs`: the Python ``nvidia`` wheel directories that hold
  ``libcudart``/``libcublas``, put on ``LD_LIBRARY_PATH`` (:mod:`abbench.peers.llamacpp_serve` does, before it
  starts the server).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["DRIVER_STUB", "cuda_dependency_flags", "runtime_library_dirs", "with_library_dirs"]


#: The CUDA driver functions ggml's CUDA backend (its virtual-memory pool) links against, at llama.cpp 0c1e570;
#: a stub exporting them lets the link succeed where no driver is installed (the real library loads at run time).
DRIVER_STUB: tuple[str, ...] = (
    "cuDeviceGet", "cuDeviceGetAttribute", "cuGetErrorString", "cuMemAddressFree", "cuMemAddressReserve",
    "cuMemCreate", "cuMemGetAllocationGranularity", "cuMemMap", "cuMemRelease", "cuMemSetAccess", "cuMemUnmap",
)
_DRIVER_PATHS = ("/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                 "/usr/lib64/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1")


def _toolkit_root() -> Path | None:
    """The CUDA toolkit CMake will find: ``$CUDAToolkit_ROOT``, ``$CUDA_PATH``, ``$CUDA_HOME``, the directory
    above the nvcc it uses (``$CUDACXX``, else nvcc on PATH) or /usr/local/cuda, the first that holds
    ``include/cuda_runtime.h``."""
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    cands = [os.environ.get(v) for v in ("CUDAToolkit_ROOT", "CUDA_PATH", "CUDA_HOME")]
    cands += [str(Path(nvcc).resolve().parent.parent) if nvcc else None, "/usr/local/cuda"]
    for c in cands:
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c).resolve()
    return None


def _nvidia_wheel_dirs() -> list[Path]:
    """The directories of the running Python's ``nvidia`` namespace package (pip's CUDA wheels)."""
    out: list[Path] = []
    for entry in sys.path:
        d = Path(entry or ".") / "nvidia"
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def _cublas_in(d: Path) -> tuple[Path, Path, Path | None] | None:
    """(include dir, libcublas, libcublasLt) if ``d`` holds cuBLAS's header and library."""
    libs = sorted((d / "lib").glob("libcublas.so*")) if (d / "lib").is_dir() else []
    lts = sorted((d / "lib").glob("libcublasLt.so*")) if (d / "lib").is_dir() else []
    if not (d / "include" / "cublas_v2.h").is_file() or not libs:
        return None
    return d / "include", libs[0], (lts[0] if lts else None)


def runtime_library_dirs() -> list[str]:
    """The ``lib`` directories of the running Python's CUDA wheels (``nvidia/cu13``, ``nvidia/cublas``,
    ``nvidia/cuda_runtime``, ...) that hold ``libcudart`` or ``libcublas``: where a CUDA llama-server built
    against those wheels, or on another machine, finds them at run time."""
    out: list[str] = []
    for base in _nvidia_wheel_dirs():
        for lib in sorted(base.glob("*/lib")):
            if any(lib.glob("libcudart.so*")) or any(lib.glob("libcublas.so*")):
                if str(lib) not in out:
                    out.append(str(lib))
    return out


def _write_driver_stub(build_dir: Path, dry_run: bool) -> Path:
    stub = build_dir / "cuda-driver-stub" / "libcuda.so"
    if dry_run:
        return stub
    stub.parent.mkdir(parents=True, exist_ok=True)
    c = stub.with_name("cuda_driver_stub.c")
    c.write_text("/* link-time stand-in for libcuda.so.1 (abbench.peers.llamacpp_build: no GPU driver on the build machine);\n"
                 "   the real driver library is loaded at run time */\n"
                 + "".join(f"int {name}(void) {{ return 999; }}\n" for name in DRIVER_STUB))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(c)], check=True)
    soname = stub.with_name("libcuda.so.1")  # what the binary asks the loader for (its --version, here)
    if not soname.exists():
        soname.symlink_to(stub.name)
    return stub


def with_library_dirs(env: dict[str, str], dirs: list[str]) -> tuple[dict[str, str], list[str]]:
    """``env`` with ``dirs`` ahead of its ``LD_LIBRARY_PATH`` (those not on it already); returns (env, added)."""
    have = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    added = [d for d in dict.fromkeys(dirs) if d not in have]
    out = dict(env)
    if added:
        out["LD_LIBRARY_PATH"] = ":".join(added + have)
    return out, added


def _version_env(deps: dict | None) -> dict[str, str] | None:
    """The environment ``llama-server --version`` runs in after a CUDA build whose libraries are not on the
    loader's path (a wheel's cuBLAS, the driver stub, whose functions are never called by --version)."""
    dirs = []
    if deps and deps.get("cublas", {}).get("library"):
        dirs.append(str(Path(deps["cublas"]["library"]).parent))
    if deps and deps.get("driver", {}).get("source") == "stub":
        dirs.append(str(Path(deps["driver"]["library"]).parent))
    return with_library_dirs(dict(os.environ), dirs)[0] if dirs else None


def cuda_dependency_flags(build_dir: Path, *, cublas: str = "auto", driver: str = "auto", dry_run: bool = False,
                          given: list[str] | None = None) -> tuple[list[str], dict]:
    """CMake flags for cuBLAS and the driver library of a CUDA build, and what was chosen (the build record's
    ``cuda_dependencies``). ``cublas``: ``auto`` (the toolkit's, else a wheel's), ``toolkit`` or a directory;
    ``driver``: ``auto`` (the toolkit's stubs or the installed driver, else a stub), ``stub`` or a file. A
    library already set in ``given`` (the user's ``--cmake-arg`` flags) is left as given."""
    toolkit = _toolkit_root()
    flags: list[str] = []
    record: dict = {"toolkit": str(toolkit) if toolkit else None}
    in_toolkit = toolkit is not None and (toolkit / "include" / "cublas_v2.h").is_file()
    preset = " ".join(given or [])
    if "-DCUDA_cublas_LIBRARY=" in preset:
        record["cublas"] = {"source": "--cmake-arg"}
    elif cublas == "toolkit" or (cublas == "auto" and in_toolkit):
        record["cublas"] = {"source": "toolkit"}
    else:
        candidates = ([Path(cublas)] if cublas != "auto" else
                      [d / sub for d in _nvidia_wheel_dirs() for sub in ("cu13", "cu12", "cublas")])
        found = next((f for f in (_cublas_in(c) for c in candidates) if f), None)
        if found is None:
            where = (f"looked in {', '.join(str(c) for c in candidates)}" if candidates
                     else "this Python has no nvidia package")
            raise SystemExit(f"no cuBLAS: the CUDA toolkit ({toolkit}) has no cublas_v2.h and no nvidia-cublas wheel "
                             f"was found ({where}); pip install nvidia-cublas (or pip download it and unzip it), "
                             "then pass --cublas DIR: the directory with include/cublas_v2.h and lib/libcublas.so*")
        inc, lib, lt = found
        flags += [f"-DCUDA_cublas_LIBRARY={lib}", f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]
        if lt is not None:
            flags.append(f"-DCUDA_cublasLt_LIBRARY={lt}")
        record["cublas"] = {"source": "wheel" if cublas == "auto" else "given", "include": str(inc),
                            "library": str(lib)}
    stubs = [toolkit / rel for rel in ("lib64/stubs/libcuda.so", "targets/x86_64-linux/lib/stubs/libcuda.so")
             ] if toolkit else []
    if "-DCUDA_cuda_driver_LIBRARY=" in preset:
        path, how = None, "--cmake-arg"
    elif driver not in ("auto", "stub"):
        path, how = Path(driver), "given"
    elif driver == "auto" and any(p.is_file() for p in stubs):
        path, how = None, "toolkit stubs"
    elif driver == "auto" and any(Path(p).is_file() for p in _DRIVER_PATHS):
        path, how = next(Path(p) for p in _DRIVER_PATHS if Path(p).is_file()), "driver"
    else:
        path, how = _write_driver_stub(build_dir, dry_run), "stub"
    if path is not None:
        flags.append(f"-DCUDA_cuda_driver_LIBRARY={path}")
    record["driver"] = {"source": how, "library": str(path) if path else None}
    return flags, record
