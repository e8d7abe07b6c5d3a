"""The NVML session: ``nvmlInit`` once per process, availability, device indices, GPU snapshots and idleness.

Contract
--------
Without NVML (no driver, no GPU, no ``pynvml``) :func:`nvml_available` is False, one log line says why
(:func:`nvml_unavailable_reason`; the fingerprint's ``nvml.reason`` records it) and every function here
returns ``None`` or ``[]``; nothing raises. The line is at debug level where the machine has no NVIDIA
driver (no ``pynvml``, no library, driver not loaded: a CPU machine, nothing to warn of) and a warning
otherwise (a driver that fails to initialise).
:mod:`abbench.telemetry` (the service monitor) and :mod:`abbench.fingerprint` (the environment fingerprint)
both read the GPUs through this module, so neither imports the other.

* :data:`SESSION` initialises NVML lazily and thread-safely, and shuts it down at exit; :func:`module` is
  the initialised ``pynvml`` module (or None), :func:`errors` the exception types NVML calls raise.
* :func:`device_indices` validates NVML indices; :func:`devices_for_env` maps a service's
  ``CUDA_VISIBLE_DEVICES`` to NVML indices.
* :func:`gpu_snapshot` / :func:`gpu_idle`: per-GPU memory and compute processes, and whether the GPUs
  are idle before a run; :func:`gpu_sample`: per-GPU memory used and utilisation as flat gauges (the load
  generator samples them during a level).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

GPU_IDLE_THRESHOLD_BYTES = 2 * 1024**3

class NvmlSession:
    """``nvmlInit`` once; remembers why NVML is unavailable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ok: bool | None = None
        self.reason: str | None = None
        self.module: Any = None

    def ensure(self) -> bool:
        if self.ok is not None:
            return self.ok
        with self._lock:
            if self.ok is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self.module = pynvml
                    self.ok = True
                    atexit.register(self._shutdown)
                    no_driver = False
                except ImportError:
                    self.reason = "nvidia-ml-py (module pynvml) is not installed"
                    self.ok, no_driver = False, True
                except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, OSError
                    self.reason = f"NVML could not be initialised ({type(e).__name__}: {e})"
                    self.ok, no_driver = False, _no_driver(e)
                if not self.ok:  # no driver (a CPU machine): nothing to warn of; the fingerprint records why
                    log.log(logging.DEBUG if no_driver else logging.WARNING,
                            "NVML not available: %s; GPU telemetry will be empty (None)", self.reason)
        return bool(self.ok)

    def _shutdown(self) -> None:
        try:
            self.module.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _no_driver(e: BaseException) -> bool:
    """Whether an ``nvmlInit`` failure means the machine has no NVIDIA driver (no library, driver not loaded,
    no GPU): expected on a CPU machine, said at debug level only."""
    name = type(e).__name__
    return isinstance(e, OSError) or any(k in name for k in ("LibraryNotFound", "DriverNotLoaded", "NotFound"))


SESSION = NvmlSession()


def nvml_available() -> bool:
    """True when NVML initialised (done once, lazily)."""
    return SESSION.ensure()


def nvml_unavailable_reason() -> str | None:
    """Why NVML is not available (None when it is, or before the first check)."""
    SESSION.ensure()
    return SESSION.reason


def module() -> Any:
    """The initialised ``pynvml`` module, or None."""
    return SESSION.module if SESSION.ensure() else None


def errors() -> tuple[type[BaseException], ...]:
    m = SESSION.module
    return (m.NVMLError, OSError) if m is not None else (OSError,)


def err_code(e: BaseException) -> int | None:
    return getattr(e, "value", None)


def device_indices(devices: list[int] | None) -> list[int]:
    m = module()
    if m is None:
        return []
    try:
        count = int(m.nvmlDeviceGetCount())
    except errors() as e:
        log.warning("nvmlDeviceGetCount failed: %s", e)
        return []
    if devices is None:
        return list(range(count))
    bad = [d for d in devices if not 0 <= d < count]
    if bad:
        log.warning("NVML sees %d GPU(s); ignoring device indices %s", count, bad)
    return [d for d in devices if 0 <= d < count]


def devices_for_env(env: dict[str, str] | None = None) -> list[int] | None:
    """NVML indices of the GPUs a service may use, from ``CUDA_VISIBLE_DEVICES`` in ``env`` (falling back
    to ``os.environ``). None = all (unset, or entries abbench cannot map, such as MIG instances).

    Integer entries are taken as NVML indices, which match CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (NVML enumerates by PCI bus id); ``GPU-...`` UUID entries (or their prefixes) are matched exactly."""
    value = (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if value is None or value.strip() == "":
        return None if value is None else []
    m = module()
    out: list[int] = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        if item.lstrip("-").isdigit():
            if int(item) < 0:
                break  # CUDA stops at the first invalid entry
            out.append(int(item))
            continue
        if item.startswith("MIG-") or m is None:
            return None
        found = None
        for i in device_indices(None):
            try:
                uuid = str(m.nvmlDeviceGetUUID(m.nvmlDeviceGetHandleByIndex(i)))
            except errors():
                continue
            if uuid.startswith(item):
                found = i
                break
        if found is None:
            return None
        out.append(found)
    return out


def compute_processes(m: Any, handle: Any) -> list[Any]:
    try:
        return list(m.nvmlDeviceGetComputeRunningProcesses(handle))  # _v3 in nvidia-ml-py >= 11.515
    except m.NVMLError as e:
        if err_code(e) != m.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return list(m.nvmlDeviceGetComputeRunningProcesses_v2(handle))  # older drivers


def gpu_snapshot(devices: list[int] | None = None) -> list[dict[str, Any]] | None:
    """Per GPU: index, name, memory used/total and compute processes ``[(pid, bytes|None)]``. None
    without NVML. For messages such as "GPU 0 is not idle: pid 123 holds 40 GiB"."""
    m = module()
    if m is None:
        return None
    out: list[dict[str, Any]] = []
    for i in device_indices(devices):
        d: dict[str, Any] = {"index": i}
        try:
            h = m.nvmlDeviceGetHandleByIndex(i)
            d["name"] = str(m.nvmlDeviceGetName(h))
            mem = m.nvmlDeviceGetMemoryInfo(h)
            d["memory_used"], d["memory_total"] = int(mem.used), int(mem.total)
            d["processes"] = [(int(p.pid), p.usedGpuMemory) for p in compute_processes(m, h)]
        except errors() as e:
            d["error"] = str(e)
        out.append(d)
    return out


def gpu_idle(threshold_bytes: int = GPU_IDLE_THRESHOLD_BYTES, devices: list[int] | None = None) -> bool | None:
    """None without NVML (or when NVML cannot answer); else True when no compute process runs on the GPUs
    and each GPU's used memory is below ``threshold_bytes`` (the driver reserves some memory even when
    idle, hence a threshold rather than zero)."""
    snap = gpu_snapshot(devices)
    if snap is None or not snap or any("error" in d for d in snap):
        return None
    return all(not d["processes"] and d["memory_used"] < threshold_bytes for d in snap)


def gpu_sample(devices: list[int] | None = None) -> dict[str, float] | None:
    """Per GPU, ``nvml_gpu_memory_used_bytes{gpu="i"}`` and ``nvml_gpu_utilization_pct{gpu="i"}`` (what a
    Prometheus scrape would name them); None without NVML; a GPU NVML cannot answer for is left out."""
    m = module()
    if m is None:
        return None
    out: dict[str, float] = {}
    for i in device_indices(devices):
        try:
            h = m.nvmlDeviceGetHandleByIndex(i)
            mem = m.nvmlDeviceGetMemoryInfo(h)
            util = m.nvmlDeviceGetUtilizationRates(h)
        except errors():
            continue
        out[f'nvml_gpu_memory_used_bytes{{gpu="{i}"}}'] = float(mem.used)
        out[f'nvml_gpu_utilization_pct{{gpu="{i}"}}'] = float(util.gpu)
    return out
