"""Service telemetry: the monitor that samples one service's GPU memory, PCIe and host RSS, process-tree RSS.

Contract
--------
Telemetry never stops a run. Without NVML (no driver, no GPU, no ``pynvml``) :func:`nvml_available` is
False, one log line says so (debug level on a machine with no NVIDIA driver), every GPU field is ``None``
and host figures still work. NVML errors during a run (``NVMLError`` of any kind) turn the affected field
into ``None`` and are logged once.

* :class:`ServiceMonitor` (background threads, a context manager) samples one service (root pid + key) every
  ``interval_s`` (default 0.2 s) into :class:`~abbench.results.MemoryPoint` s:

  - ``gpu_mem_used``: ``nvmlDeviceGetMemoryInfo(h).used`` summed over the sampled devices (whole GPUs:
    every process, plus the driver's reservation);
  - ``proc_gpu_mem``: ``usedGpuMemory`` of ``nvmlDeviceGetComputeRunningProcesses`` entries whose pid is in
    the service's process tree (root + psutil recursive children), summed. ``None`` when NVML lists
    processes but none of their pids exists here (abbench runs in another PID namespace than the driver
    sees, e.g. a container without ``--pid=host``); ``0`` when the tree simply has no GPU context;
  - ``host_rss``: RSS of the process tree summed (pages shared between the processes count once per
    process, so this is an upper bound of the tree's resident memory);
  - ``pcie_rx_bytes_per_s`` / ``pcie_tx_bytes_per_s``: the latest ``nvmlDeviceGetPcieThroughput`` values
    (``NVML_PCIE_UTIL_RX_BYTES``/``TX_BYTES``, RX = into the GPU = host->device), summed over devices.

  **Devices**: the sampled devices are the NVML indices given (``devices=``), by default every GPU NVML
  sees; :func:`devices_for_env` maps a service's ``CUDA_VISIBLE_DEVICES`` to NVML indices so a run on a
  shared multi-GPU host only counts the service's GPUs. Fields are sums over those devices.

* **Per-request windows**: ``m = monitor.mark()`` just before a request and ``monitor.window(m)`` just after
  it return a dict that fits :class:`~abbench.results.Telemetry` (``nvml_pcie_rx_bytes``,
  ``gpu_mem_used_peak``, ``proc_gpu_mem_peak``, ``host_rss_peak``). Peaks are over the memory samples
  taken inside the window plus one taken synchronously when ``window`` is called (so a short request has
  at least one). ``nvml_pcie_rx_bytes`` is the trapezoid integral of RX bytes/s over [mark, window],
  per device, summed. The host's CPU over the same window (:func:`host_cpu_fractions`, psutil's system-wide
  CPU times): ``host_cpu_busy`` (the fraction of all CPUs' time not idle or waiting on I/O) and
  ``host_cpu_steal`` (the fraction a hypervisor gave to others: Linux guests; None elsewhere); and
  ``service_cpu_s``, the CPU seconds (user + system) the service's process tree spent in the window (a
  process that starts inside it counts from zero; one that exits inside it is lost). These say how the host
  was doing while the request ran: a contended or throttled CPU slows an engine that works on the CPU.

  *Accuracy of* ``nvml_pcie_rx_bytes``. NVML offers no cumulative PCIe byte counter, only a rate in KB/s
  measured by the driver over a ~20 ms interval (:data:`PCIE_COUNTER_WINDOW_S`; the call typically blocks
  for that interval). A rate sampled every 200 ms would miss 90 % of the time, so while any window is open
  each device gets its own thread that reads RX with a period of about 20 ms: back to back when the call
  blocks for its interval, else pausing ``20 ms - call time`` (no busy spinning). Each reading is stamped
  at the middle of the interval it most likely covers (return time - 10 ms). When the reads tile the
  request, the integral is within a few per cent of the bytes the counter saw, plus an edge error of up
  to about rate x 10-20 ms at each end of the window; traffic bursts shorter than the gaps between reads
  (when the driver answers instantly from its own sampling, whose phase abbench cannot see) are missed or
  over-weighted. The KB unit is taken as 1024 bytes (:data:`PCIE_KB`; if NVIDIA means 1000 the figures
  are 2.4 % high). The counter sees all traffic into the GPU (other processes, page migrations, possibly
  protocol overhead), and overlapping windows of concurrent requests all see the same traffic. Use it as
  a cross-check of the engine's own H2D counter, never as the primary measure. TX is read only outside
  windows (every ``interval_s``) so that RX readings tile the window. Without an RX reading within
  ``max(2 * interval_s, 0.5)`` s of both window ends the value is ``None``.

* :func:`gpu_idle` is ``None`` without NVML; otherwise True when no compute process runs on the sampled
  GPUs and each one's used memory is below ``threshold_bytes``.

The NVML session, device selection and GPU idleness live in :mod:`abbench.nvml` (re-exported here:
:func:`nvml_available`, :func:`devices_for_env`, :func:`gpu_snapshot`, :func:`gpu_idle`); Prometheus parsing in
:mod:`abbench.prometheus`; the environment fingerprint in :mod:`abbench.fingerprint`.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from abbench import nvml
from abbench.nvml import (  # noqa: F401 - part of this module's API (the monitor's device selection)
    devices_for_env,
    gpu_idle,
    gpu_snapshot,
    nvml_available,
    nvml_unavailable_reason,
)
from abbench.results import MemoryPoint

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.2
PCIE_COUNTER_WINDOW_S = 0.020
PCIE_KB = 1024
FAST_PCIE_MIN_GAP_S = 0.0005
_PCIE_KEEP_S = 120.0

class GpuSource(Protocol):
    """What :class:`ServiceMonitor` reads from the GPUs; :class:`NvmlSource` is the real one (tests use fakes).
    Every method returns None when the value cannot be read."""

    def devices(self) -> list[int]: ...

    def memory_used(self) -> int | None: ...

    def processes(self) -> list[tuple[int, int | None]] | None: ...

    def pcie_rx(self, device: int) -> float | None: ...

    def pcie_tx(self, device: int) -> float | None: ...


class NvmlSource:
    """:class:`GpuSource` over NVML for the given NVML device indices (None = all)."""

    def __init__(self, devices: list[int] | None = None) -> None:
        self._m = nvml.module()
        if self._m is None:
            raise RuntimeError(f"NVML is not available: {nvml.SESSION.reason}")
        self._handles = {i: self._m.nvmlDeviceGetHandleByIndex(i) for i in nvml.device_indices(devices)}
        self._broken: set[str] = set()
        self._lock = threading.Lock()

    def _fail(self, what: str, e: BaseException) -> None:
        with self._lock:
            if what in self._broken:
                return
            self._broken.add(what)
        log.warning("NVML %s failed (%s); that field will be None", what, e)

    def devices(self) -> list[int]:
        return list(self._handles)

    def memory_used(self) -> int | None:
        if "memory" in self._broken or not self._handles:
            return None
        try:
            return sum(int(self._m.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles.values())
        except nvml.errors() as e:
            self._fail("memory", e)
            return None

    def processes(self) -> list[tuple[int, int | None]] | None:
        if "processes" in self._broken or not self._handles:
            return None
        out: list[tuple[int, int | None]] = []
        try:
            for h in self._handles.values():
                for p in nvml.compute_processes(self._m, h):
                    used = p.usedGpuMemory
                    out.append((int(p.pid), int(used) if used is not None else None))
        except nvml.errors() as e:
            self._fail("processes", e)
            return None
        return out

    def _pcie(self, device: int, counter: int, what: str) -> float | None:
        key = f"{what}:{device}"
        if key in self._broken or device not in self._handles:
            return None
        try:
            kb_s = self._m.nvmlDeviceGetPcieThroughput(self._handles[device], counter)
        except nvml.errors() as e:
            self._fail(key, e)
            return None
        return float(kb_s) * PCIE_KB

    def pcie_rx(self, device: int) -> float | None:
        return self._pcie(device, self._m.NVML_PCIE_UTIL_RX_BYTES, "PCIe RX throughput")

    def pcie_tx(self, device: int) -> float | None:
        return self._pcie(device, self._m.NVML_PCIE_UTIL_TX_BYTES, "PCIe TX throughput")


# ============================================================================================== sampling


def integrate_rate(times: list[float], rates: list[float], start: float, end: float) -> float | None:
    """Trapezoid integral of a sampled rate over [start, end]. Between samples the rate is linear; beyond
    the first/last sample it is held. None when there are no samples."""
    if end <= start:
        return 0.0
    if not times:
        return None

    def at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        if i == 0:
            return rates[0]
        if i == len(times):
            return rates[-1]
        t0, t1 = times[i - 1], times[i]
        if t1 == t0:
            return rates[i]
        return rates[i - 1] + (rates[i] - rates[i - 1]) * (t - t0) / (t1 - t0)

    lo = bisect.bisect_right(times, start)
    hi = bisect.bisect_left(times, end)
    pts = [(start, at(start)), *zip(times[lo:hi], rates[lo:hi]), (end, at(end))]
    return sum((t1 - t0) * (r0 + r1) / 2 for (t0, r0), (t1, r1) in zip(pts, pts[1:]))


@dataclass
class _MemSample:
    mono: float
    wall: float
    gpu_mem_used: int | None
    proc_gpu_mem: int | None
    host_rss: int | None
    rx: float | None
    tx: float | None


@dataclass
class _Mark:
    """An open telemetry window: when it opened, the host's CPU times and the service tree's CPU seconds."""

    mono: float
    host_cpu: Any
    tree_cpu: dict[int, float]


class _PcieSeries:
    def __init__(self) -> None:
        self.t: list[float] = []
        self.rx: list[float] = []
        self.tx: float | None = None


def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and its recursive children (empty when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tree_cpu(procs: list[psutil.Process]) -> dict[int, float]:
    """pid -> CPU seconds (user + system) of each process that can still be read."""
    out: dict[int, float] = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[p.pid] = float(t.user + t.system)
    return out


def host_cpu_fractions(before: Any, after: Any) -> tuple[float | None, float | None]:
    """(busy, steal) fractions of all CPUs' time between two ``psutil.cpu_times()`` readings; (None, None)
    when no time passed. ``steal`` is None where the platform has no such field."""
    fields = before._fields
    total = sum(getattr(after, f) - getattr(before, f) for f in fields)
    if total <= 0:
        return None, None
    idle = sum(getattr(after, f) - getattr(before, f) for f in ("idle", "iowait") if f in fields)
    steal = (after.steal - before.steal) / total if "steal" in fields else None
    return max(0.0, min(1.0, 1.0 - idle / total)), (max(0.0, min(1.0, steal)) if steal is not None else None)


def tree_rss(procs: list[psutil.Process]) -> int | None:
    total, seen = 0, False
    for p in procs:
        try:
            total += p.memory_info().rss
            seen = True
        except psutil.Error:
            continue
    return total if seen else None


class ServiceMonitor:
    """Background sampling of one service; see the module docstring for what and how accurately.

    ``gpu="auto"`` reads NVML when it is available (else GPU fields are None); pass a :class:`GpuSource`
    to substitute one, or None for host-only sampling."""

    def __init__(
        self,
        service: str,
        pid: int | None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        devices: list[int] | None = None,
        gpu: GpuSource | None | str = "auto",
        fast_pcie: bool = True,
    ) -> None:
        self.service = service
        self.pid = pid
        self.interval_s = interval_s
        self.fast_pcie = fast_pcie
        if gpu == "auto":
            gpu = None
            if nvml_available():
                try:
                    gpu = NvmlSource(devices)
                except Exception as e:  # noqa: BLE001 - a lost GPU must not stop the run
                    log.warning("NVML sampling disabled for %s: %s", service, e)
        assert gpu is None or not isinstance(gpu, str), f"gpu must be 'auto', None or a GpuSource, not {gpu!r}"
        self.gpu: GpuSource | None = gpu
        self._lock = threading.Lock()
        self._mem: list[_MemSample] = []
        self._pcie: dict[int, _PcieSeries] = {d: _PcieSeries() for d in (gpu.devices() if gpu else [])}
        self._marks: dict[int, _Mark] = {}
        self._next_mark = 0
        self._stop = threading.Event()
        self._wake = {d: threading.Event() for d in self._pcie}
        self._threads: list[threading.Thread] = []
        self._failed_once = False
        self._pcie_dead: set[int] = set()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> ServiceMonitor:
        if self._threads:
            return self
        self._stop.clear()
        t = threading.Thread(target=self._mem_loop, name=f"abbench-sampler-{self.service}", daemon=True)
        self._threads.append(t)
        for d in self._pcie:
            self._threads.append(
                threading.Thread(target=self._pcie_loop, args=(d,), name=f"abbench-pcie{d}-{self.service}",
                                 daemon=True)
            )
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for e in self._wake.values():
            e.set()
        for t in self._threads:
            t.join(timeout=max(2.0, 3 * self.interval_s))
        self._threads = []

    def __enter__(self) -> ServiceMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- sampling ---------------------------------------------------------------------------------

    def _latest_pcie(self) -> tuple[float | None, float | None]:
        rx = [s.rx[-1] for s in self._pcie.values() if s.rx]
        tx = [s.tx for s in self._pcie.values() if s.tx is not None]
        return (sum(rx) if rx else None), (sum(tx) if tx else None)

    def _procs(self) -> list[psutil.Process]:
        return process_tree(self.pid) if self.pid is not None else []

    def sample_now(self, procs: list[psutil.Process] | None = None) -> MemoryPoint:
        """Take one memory sample now (it joins the series) and return it; ``procs``: the service's process
        tree when the caller has just listed it."""
        procs = self._procs() if procs is None else procs
        rss = tree_rss(procs)
        gpu_used = proc_gpu = None
        if self.gpu is not None:
            gpu_used = self.gpu.memory_used()
            gprocs = self.gpu.processes()
            if gprocs is not None and self.pid is not None:
                pids = {p.pid for p in procs}
                mine = [used for pid, used in gprocs if pid in pids]
                if mine:
                    known = [u for u in mine if u is not None]
                    proc_gpu = sum(known) if known else None  # None: the driver does not say (WDDM, MIG)
                elif gprocs and not any(psutil.pid_exists(pid) for pid, _ in gprocs):
                    proc_gpu = None  # another PID namespace: cannot attribute
                else:
                    proc_gpu = 0
        with self._lock:
            rx, tx = self._latest_pcie()
            s = _MemSample(time.monotonic(), time.time(), gpu_used, proc_gpu, rss, rx, tx)
            if not self._mem or self._mem[-1].mono <= s.mono:
                self._mem.append(s)
            else:
                bisect.insort(self._mem, s, key=lambda x: x.mono)
        return self._point(s)

    def _point(self, s: _MemSample) -> MemoryPoint:
        return MemoryPoint(
            t=s.wall,
            service=self.service,
            gpu_mem_used=s.gpu_mem_used,
            proc_gpu_mem=s.proc_gpu_mem,
            host_rss=s.host_rss,
            pcie_rx_bytes_per_s=s.rx,
            pcie_tx_bytes_per_s=s.tx,
        )

    def _mem_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_now()
            except Exception:  # noqa: BLE001 - telemetry never crashes the run
                if not self._failed_once:
                    self._failed_once = True
                    log.exception("telemetry sample of %s failed; sampling goes on", self.service)
            self._stop.wait(self.interval_s)

    def _pcie_loop(self, device: int) -> None:
        assert self.gpu is not None
        series = self._pcie[device]
        wake = self._wake[device]
        try:
            self._pcie_reads(device, series, wake)
        finally:
            self._pcie_dead.add(device)

    def _pcie_reads(self, device: int, series: _PcieSeries, wake: threading.Event) -> None:
        assert self.gpu is not None
        # Outside windows: RX and TX every interval_s. Inside (a mark is open): RX only, period ~20 ms.
        next_tx = 0.0
        n = 0
        while not self._stop.is_set():
            fast = self.fast_pcie and bool(self._marks)
            try:
                t0 = time.monotonic()
                rx = self.gpu.pcie_rx(device)
                t1 = time.monotonic()
                t = t1 - PCIE_COUNTER_WINDOW_S / 2
                if rx is None:
                    return  # unsupported: the source logged why
                with self._lock:
                    series.t.append(t)
                    series.rx.append(rx)
                n += 1
                if not fast and time.monotonic() >= next_tx:
                    series.tx = self.gpu.pcie_tx(device)
                    next_tx = time.monotonic() + self.interval_s
                if n % 512 == 0:
                    self._prune(series)
            except Exception:  # noqa: BLE001
                if not self._failed_once:
                    self._failed_once = True
                    log.exception("PCIe sampling of GPU %d failed; it stops", device)
                return
            if fast:
                self._stop.wait(max(FAST_PCIE_MIN_GAP_S, PCIE_COUNTER_WINDOW_S - (t1 - t0)))
            else:
                wake.wait(self.interval_s)
                wake.clear()

    def _prune(self, series: _PcieSeries) -> None:
        with self._lock:
            keep_from = time.monotonic() - _PCIE_KEEP_S
            if self._marks:
                keep_from = min(keep_from, min(m.mono for m in self._marks.values()) - 1.0)
            i = bisect.bisect_left(series.t, keep_from)
            if i > 0:
                del series.t[:i]
                del series.rx[:i]

    # -- results ----------------------------------------------------------------------------------

    def points(self, since: int = 0) -> list[MemoryPoint]:
        """The memory samples so far (from index ``since``), as :class:`MemoryPoint` s."""
        with self._lock:
            mem = self._mem[since:]
        return [self._point(s) for s in mem]

    def __len__(self) -> int:
        return len(self._mem)

    def mark(self) -> int:
        """Open a window now and return its handle for :meth:`window`: it reads the host's and the service's
        CPU times (a few ms; no memory sample). While a window is open, PCIe RX is read about every 20 ms on
        each device."""
        host, tree = psutil.cpu_times(), tree_cpu(self._procs())
        with self._lock:
            m = self._next_mark
            self._next_mark += 1
            self._marks[m] = _Mark(time.monotonic(), host, tree)
        for e in self._wake.values():
            e.set()
        return m

    def window(self, start_mark: int, *, settle_s: float = 0.1) -> dict[str, Any]:
        """Close the window opened by :meth:`mark` and return Telemetry fields over it (see the module
        docstring). Waits up to ``settle_s`` for a PCIe reading after the end so the last ~20 ms count."""
        with self._lock:
            if start_mark not in self._marks:
                raise KeyError(f"unknown or already closed telemetry mark {start_mark}")
            start = self._marks[start_mark].mono
        end = time.monotonic()
        if self._threads and not self._stop.is_set():
            deadline = end + settle_s
            while time.monotonic() < deadline:
                with self._lock:
                    done = all(
                        s.t and s.t[-1] >= end for d, s in self._pcie.items() if d not in self._pcie_dead
                    )
                if done:
                    break
                time.sleep(0.002)
        procs = self._procs()
        host_after, tree_after = psutil.cpu_times(), tree_cpu(procs)
        self.sample_now(procs)  # the state at the end: a short request gets at least one memory sample
        with self._lock:
            opened = self._marks.pop(start_mark)
            mem = self._mem[bisect.bisect_left(self._mem, start, key=lambda s: s.mono):]
            rx_total: float | None = None
            max_gap = max(2 * self.interval_s, 0.5)
            for series in self._pcie.values():
                lo = bisect.bisect_left(series.t, start - max_gap)
                hi = bisect.bisect_right(series.t, end + max_gap)
                ts, rs = series.t[lo:hi], series.rx[lo:hi]
                if not ts or ts[0] > start + max_gap or ts[-1] < end - max_gap:
                    continue
                v = integrate_rate(ts, rs, start, end)
                if v is not None:
                    rx_total = (rx_total or 0.0) + v

        def peak(vals: list[int | None]) -> int | None:
            got = [v for v in vals if v is not None]
            return max(got) if got else None

        busy, steal = host_cpu_fractions(opened.host_cpu, host_after)
        service_cpu = (sum(max(0.0, t - opened.tree_cpu.get(pid, 0.0)) for pid, t in tree_after.items())
                       if tree_after else None)
        return {
            "nvml_pcie_rx_bytes": None if rx_total is None or math.isnan(rx_total) else rx_total,
            "host_cpu_busy": busy,
            "host_cpu_steal": steal,
            "service_cpu_s": service_cpu,
            "gpu_mem_used_peak": peak([s.gpu_mem_used for s in mem]),
            "proc_gpu_mem_peak": peak([s.proc_gpu_mem for s in mem]),
            "host_rss_peak": peak([s.host_rss for s in mem]),
        }


Sampler = ServiceMonitor
"""The former name, kept importable."""
