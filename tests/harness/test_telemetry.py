"""abbench.telemetry: host sampling of a real process tree, the window/integral logic (with a fake GPU
source that behaves like NVML's blocking 20 ms PCIe counter), Prometheus parsing of real
prometheus_client output, and the environment fingerprint on a machine without a GPU."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from abbench import fingerprint, nvml, prometheus
from abbench import telemetry as tm
from abbench.results import MemoryPoint, Telemetry
from abbench.services import Service, stop_all

HELPER = str(Path(__file__).resolve().parents[1] / "support" / "svc_helper.py")
MiB = 1024 * 1024


def _wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    """Polls ``predicate`` until it holds; fails after ``timeout`` seconds (a wait, not a wall-clock bound: a
    loaded machine may take longer than the few intervals the sampler needs, a broken sampler never gets there)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    stop_all()


@pytest.fixture
def helper(tmp_path: Path):
    with Service.launch(
        "svc", ["{python}", HELPER, "--port", "{port}", "--children", "1", "--alloc-mb", "64"],
        env={}, log_path=tmp_path / "svc.log", health_timeout_s=15, stop_timeout_s=3,
    ) as svc:
        yield svc


# ------------------------------------------------------------------------------------------ without GPU


def test_nvml_absent_is_reported_not_fatal() -> None:
    if tm.nvml_available():
        pytest.skip("this machine has NVML")
    assert tm.nvml_unavailable_reason()
    assert tm.gpu_idle() is None
    assert tm.gpu_snapshot() is None
    s = tm.ServiceMonitor("x", None)
    assert s.gpu is None


def test_devices_for_env() -> None:
    assert tm.devices_for_env({"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert tm.devices_for_env({"CUDA_VISIBLE_DEVICES": "1,-1,3"}) == [1]
    assert tm.devices_for_env({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert tm.devices_for_env({"CUDA_VISIBLE_DEVICES": "MIG-abc"}) is None


def test_sampler_host_rss_of_real_process_tree(helper: Service) -> None:
    assert helper.pid is not None
    tree = tm.process_tree(helper.pid)
    assert len(tree) == 3  # helper, child (64 MiB touched), grandchild
    root_rss = psutil.Process(helper.pid).memory_info().rss
    with tm.ServiceMonitor("svc", helper.pid, interval_s=0.05) as s:
        _wait_until(lambda: len(s) >= 4, "four memory samples at 0.05 s")  # was a 0.3 s sleep: ~6 on an idle machine
        m = s.mark()
        r = httpx.get(helper.base_url + "/health", trust_env=False)
        assert r.status_code == 200
        w = s.window(m)
    pts = s.points()
    assert len(pts) >= 4 and all(isinstance(p, MemoryPoint) and p.service == "svc" for p in pts)
    assert all(p.host_rss is not None and p.host_rss > root_rss + 60 * MiB for p in pts)
    assert pts == sorted(pts, key=lambda p: p.t)
    if not tm.nvml_available():
        assert all(p.gpu_mem_used is None and p.proc_gpu_mem is None and p.pcie_rx_bytes_per_s is None for p in pts)
        assert w["nvml_pcie_rx_bytes"] is None and w["gpu_mem_used_peak"] is None
    assert w["host_rss_peak"] is not None and w["host_rss_peak"] > root_rss + 60 * MiB
    Telemetry(**w)  # the window dict fits the result schema
    with pytest.raises(KeyError):
        s.window(m)  # closed


def test_window_host_cpu_and_the_service_trees_cpu_seconds() -> None:
    """A child that burns ~0.6 s of CPU inside the window: the service's CPU seconds see it, an idle child
    does not; the host's busy and steal shares are fractions."""
    import subprocess
    import sys

    burn = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.6: pass\ntime.sleep(30)")  # burns once told to
    idle = "import time; time.sleep(30)"
    ready = "print('ready', flush=True)\n"  # said once the interpreter has started
    procs = [subprocess.Popen([sys.executable, "-c", ready + code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for code in (idle, burn)]
    try:
        # interpreter start-up is outside the windows: waited for, not slept over (a 0.5 s sleep let a start-up
        # slowed by a loaded machine spill its CPU seconds into the idle child's window)
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
        with tm.ServiceMonitor("idle", procs[0].pid, gpu=None) as quiet, \
                tm.ServiceMonitor("busy", procs[1].pid, gpu=None) as s:
            m, q = s.mark(), quiet.mark()
            procs[1].stdin.write("go\n")
            procs[1].stdin.flush()
            deadline = time.monotonic() + 60  # 0.6 s of CPU: a share of a loaded core may take several seconds
            start_cpu = sum(psutil.Process(procs[1].pid).cpu_times()[:2])
            while sum(psutil.Process(procs[1].pid).cpu_times()[:2]) - start_cpu < 0.55 and time.monotonic() < deadline:
                time.sleep(0.05)
            w, wq = s.window(m), quiet.window(q)
        assert 0.5 < w["service_cpu_s"] < 1.5, w
        assert wq["service_cpu_s"] < 0.05, wq
        assert 0 < w["host_cpu_busy"] <= 1
        assert w["host_cpu_steal"] is None or 0 <= w["host_cpu_steal"] <= 1
        Telemetry(**w)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdin.close()
            p.stdout.close()
    before = psutil.cpu_times()
    assert tm.host_cpu_fractions(before, before) == (None, None)  # no time passed
    with tm.ServiceMonitor("gone", None, gpu=None) as none:
        assert none.window(none.mark())["service_cpu_s"] is None  # no process to account


def test_sampler_survives_service_death(helper: Service) -> None:
    s = tm.ServiceMonitor("svc", helper.pid, interval_s=0.05, gpu=None).start()
    try:
        _wait_until(lambda: len(s) >= 2, "the sampler's first samples")
        helper.stop()
        # two more samples: the later one began after the service was gone (0.15 s sleeps instead left a loaded
        # machine's sampler no sample after the stop); a sampler that died with the service never takes them
        n = len(s)
        _wait_until(lambda: len(s) >= n + 2, "samples after the service's death")
        assert s.points()[-1].host_rss is None
        w = s.window(s.mark())
        assert w["host_rss_peak"] is None
    finally:
        s.stop()


# ------------------------------------------------------------------------------- window logic, fake GPU


class FakeGpu:
    """Behaves like NVML: PCIe reads block for the 20 ms the counter measures. RX rate follows
    ``rate(t)``; device 1 carries half of device 0's traffic."""

    def __init__(self, rate, procs) -> None:
        self.rate = rate
        self.procs = procs
        self.reads = 0
        self._lock = threading.Lock()

    def devices(self) -> list[int]:
        return [0, 1]

    def memory_used(self) -> int | None:
        return 5 * 1024**3

    def processes(self):
        return self.procs()

    def pcie_rx(self, device: int) -> float | None:
        t0 = time.monotonic()
        time.sleep(tm.PCIE_COUNTER_WINDOW_S)
        t1 = time.monotonic()
        with self._lock:
            self.reads += 1
        n = 20
        avg = sum(self.rate(t0 + (t1 - t0) * (i + 0.5) / n) for i in range(n)) / n
        return avg if device == 0 else avg / 2

    def pcie_tx(self, device: int) -> float | None:
        return 1e6


def test_integrate_rate_pure() -> None:
    assert tm.integrate_rate([], [], 0, 1) is None
    assert tm.integrate_rate([0.0, 1.0], [2.0, 2.0], 0.25, 0.75) == pytest.approx(1.0)
    assert tm.integrate_rate([0.0, 1.0], [0.0, 10.0], 0.0, 1.0) == pytest.approx(5.0)
    assert tm.integrate_rate([0.5], [4.0], 0.0, 1.0) == pytest.approx(4.0)  # held beyond the samples
    assert tm.integrate_rate([0.0, 1.0], [1.0, 1.0], 1.0, 1.0) == 0.0


def test_window_integrates_pcie_burst_with_fast_sampling(tmp_path: Path) -> None:
    gb = 1e9
    burst: dict[str, float] = {}

    def rate(t: float) -> float:
        a = burst.get("a")
        return gb if a is not None and a <= t < a + 0.2 else 0.0

    me = psutil.Process().pid
    gpu = FakeGpu(rate, lambda: [(me, 300 * MiB), (4_000_000, 7 * MiB)])
    with tm.ServiceMonitor("svc", me, interval_s=0.2, gpu=gpu) as s:
        time.sleep(0.25)
        reads_before = gpu.reads
        m = s.mark()
        time.sleep(0.05)
        burst["a"] = time.monotonic()  # 0.2 s at 1 GB/s on GPU 0, 0.5 GB/s on GPU 1: 0.3 GB in all
        time.sleep(0.35)
        w = s.window(m)
        fast_reads = gpu.reads - reads_before
    # both devices read back to back during the ~0.4 s window: ~20 reads each on an idle machine, fewer where
    # the reading threads wait for a loaded core; at the 0.2 s interval (no fast reads) it would be ~3 each
    assert fast_reads >= 12
    assert w["nvml_pcie_rx_bytes"] == pytest.approx(0.3 * gb, rel=0.12)
    assert w["gpu_mem_used_peak"] == 5 * 1024**3
    assert w["proc_gpu_mem_peak"] == 300 * MiB  # only our pid; the stranger's 7 MiB is not ours
    Telemetry(**w)
    pts = s.points()
    assert any(p.pcie_tx_bytes_per_s == 2e6 for p in pts)


def test_window_without_traffic_and_pid_namespace_mismatch() -> None:
    gpu = FakeGpu(lambda t: 0.0, lambda: [(4_000_001, 1024)])  # no such pid here: another namespace
    with tm.ServiceMonitor("svc", psutil.Process().pid, interval_s=0.05, gpu=gpu) as s:
        time.sleep(0.1)
        w = s.window(s.mark())
    assert w["nvml_pcie_rx_bytes"] == 0.0
    assert w["proc_gpu_mem_peak"] is None
    gpu2 = FakeGpu(lambda t: 0.0, lambda: [])
    with tm.ServiceMonitor("svc", psutil.Process().pid, interval_s=0.05, gpu=gpu2) as s:
        time.sleep(0.1)
        w = s.window(s.mark())
    assert w["proc_gpu_mem_peak"] == 0  # no GPU context in our tree


# ---------------------------------------------------------------------------------------- Prometheus


def _registry_text() -> str:
    reg = CollectorRegistry()
    c = Counter("abbench_h2d_bytes", "Host to device bytes.", ["path"], registry=reg)
    c.labels(path="layer-major").inc(1.5e9)
    c.labels(path='we"ird\\').inc(3)
    g = Gauge("abbench_prefix_cache_blocks", "Blocks.", registry=reg)
    g.set(12)
    h = Histogram("abbench_prefill_seconds", "Prefill.", ["arm"], registry=reg, buckets=(0.1, 1.0))
    h.labels(arm="B").observe(0.5)
    return generate_latest(reg).decode()


def test_parse_prometheus_real_output() -> None:
    d = prometheus.parse_prometheus(_registry_text())
    assert d['abbench_h2d_bytes_total{path="layer-major"}'] == 1.5e9
    assert d['abbench_h2d_bytes_total{path="we\\"ird\\\\"}'] == 3
    assert d["abbench_prefix_cache_blocks"] == 12
    assert d['abbench_prefill_seconds_bucket{arm="B",le="1.0"}'] == 1
    assert d['abbench_prefill_seconds_bucket{arm="B",le="+Inf"}'] == 1
    assert d['abbench_prefill_seconds_sum{arm="B"}'] == 0.5
    assert prometheus.parse_prometheus("") == {}


def test_parse_prometheus_labels_sorted_and_garbage() -> None:
    text = 'x_total{b="2",a="1"} 4\n'
    assert prometheus.parse_prometheus(text) == {'x_total{a="1",b="2"}': 4.0}
    with pytest.raises(ValueError, match="not Prometheus text"):
        prometheus.parse_prometheus("<html><body>404</body></html>")
    mixed = "good_total 3\nthis is { not valid\nother 2\n"
    with pytest.raises(ValueError):
        prometheus.parse_prometheus(mixed)
    assert prometheus.parse_prometheus(mixed, strict=False) == {"good_total": 3.0, "other": 2.0}


def test_metrics_delta_and_real_scrape(helper: Service) -> None:
    before = prometheus.parse_prometheus(httpx.get(helper.base_url + "/metrics", trust_env=False).text)
    after = prometheus.parse_prometheus(httpx.get(helper.base_url + "/metrics", trust_env=False).text)
    assert prometheus.metrics_delta(before, after) == {'helper_requests_total{path="/metrics"}': 1.0}
    d = prometheus.metrics_delta({"a_total": 5, "gone_total": 1, "c_created": 1.0},
                         {"a_total": 7, "new_total": 2, "c_created": 9.0})
    assert d == {"a_total": 2, "new_total": 2}
    assert prometheus.metrics_delta(None, {"a": 1}) == {"a": 1} and prometheus.metrics_delta({"a": 1}, None) == {}


# --------------------------------------------------------------------------------------- fingerprint


def test_environment_fingerprint_without_gpu() -> None:
    cmds = [["python", "-m", "abbench.engine", "--port", "1234"]]
    fp = fingerprint.environment_fingerprint(cmds)
    for key in ("hostname", "python", "platform", "cpu", "ram_total", "driver_version", "cuda_driver_version",
                "gpus", "nvml", "packages", "git", "engine_commit", "commands"):
        assert key in fp
    assert fp["commands"] == cmds
    assert fp["ram_total"] > 0 and fp["cpu"]["logical"] >= 1
    cpu = fp["cpu"]
    assert set(cpu) >= {"freq_mhz", "freq_max_mhz", "loadavg", "steal_since_boot"}
    assert cpu["loadavg"] is None or (len(cpu["loadavg"]) == 3 and min(cpu["loadavg"]) >= 0)
    assert cpu["steal_since_boot"] is None or 0 <= cpu["steal_since_boot"] <= 1
    assert set(fp["packages"]) >= {"abbench", "torch", "transformers", "tokenizers", "httpx", "numpy", "pandas"}
    assert fp["packages"]["httpx"] == httpx.__version__ and fp["packages"]["abbench"]
    if not tm.nvml_available():
        assert fp["gpus"] == [] and fp["driver_version"] is None and fp["nvml"]["available"] is False
    if fp["git"] is not None:  # running from a checkout
        assert len(fp["git"]["commit"]) == 40 and isinstance(fp["git"]["dirty"], bool)
        assert fp["engine_commit"].startswith(fp["git"]["commit"])
    import json

    json.dumps(fp)  # it goes into run.json


def test_git_state_absent(tmp_path: Path) -> None:
    assert fingerprint.git_state(tmp_path) is None
    fp = fingerprint.environment_fingerprint(repo_dir=tmp_path, engine_commit="vllm-0.9.1")
    assert fp["git"] is None and fp["engine_commit"] == "vllm-0.9.1" and fp["commands"] == []


def test_comparable_key_fields() -> None:
    a = {"gpus": [{"name": "NVIDIA H200"}], "driver_version": "570.1", "cuda_driver_version": "12.8",
         "packages": {"torch": "2.7.0", "transformers": "4.51"}, "engine_commit": "abc", "hostname": "x"}
    assert fingerprint.comparable(a, copy.deepcopy(a)) == []
    b = copy.deepcopy(a)
    b["hostname"] = "y"  # not a key field
    assert fingerprint.comparable(a, b) == []
    b["gpus"][0]["name"] = "NVIDIA H100"
    b["packages"]["torch"] = "2.8.0"
    del b["engine_commit"]
    assert fingerprint.comparable(a, b) == ["gpu_models", "packages.torch", "engine_commit"]
    assert fingerprint.differences(a, b)[1] == "packages.torch: '2.7.0' != '2.8.0'"
    assert set(fingerprint.KEY_FIELDS) == {"gpu_models", "driver_version", "cuda_driver_version", "packages.torch",
                                  "packages.transformers", "engine_commit"}


# ------------------------------------------------------------------ NVML code paths, with a fake pynvml


class _FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def _fake_pynvml(procs: dict[int, list[tuple[int, int | None]]]):
    """A stand-in for ``pynvml`` with two GPUs: GPU 1 lacks the v3 process query (old driver) and the GPU
    max link generation. Every name it defines exists in the real module (checked by the test)."""
    import types

    NOT_FOUND, NOT_SUPPORTED = 13, 3

    def handle(i):
        return ("h", i)

    def procs_v3(h):
        if h[1] == 1:
            raise _FakeNVMLError(NOT_FOUND)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in procs.get(h[1], [])]

    def procs_v2(h):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in procs.get(h[1], [])]

    def gpu_max_gen(h):
        raise _FakeNVMLError(NOT_SUPPORTED)

    return types.SimpleNamespace(
        NVMLError=_FakeNVMLError,
        NVML_ERROR_FUNCTION_NOT_FOUND=NOT_FOUND,
        NVML_PCIE_UTIL_TX_BYTES=0,
        NVML_PCIE_UTIL_RX_BYTES=1,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "570.86.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12080,
        nvmlSystemGetNVMLVersion=lambda: "12.570.86.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-0000-{h[1]}",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:{h[1]:02d}:00.0".encode()),
        nvmlDeviceGetVbiosVersion=lambda h: "96.00.AF.00.01",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=150_000 * MiB, used=(h[1] + 1) * 1000 * MiB,
                                                               free=0),
        nvmlDeviceGetComputeRunningProcesses=procs_v3,
        nvmlDeviceGetComputeRunningProcesses_v2=procs_v2,
        nvmlDeviceGetPcieThroughput=lambda h, c: (1000 if c == 1 else 10) * (h[1] + 1),
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 5,
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1,
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetGpuMaxPcieLinkGeneration=gpu_max_gen,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetClockInfo=lambda h, c: {1: 1980, 2: 3201}[c] - 1000 * h[1] * (c == 1),
        nvmlDeviceGetMaxClockInfo=lambda h, c: {1: 1980, 2: 3201}[c],
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 4 * h[1],  # GPU 1: 0x4, a power cap
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetPowerUsage=lambda h: 95_500,
        nvmlDeviceGetTemperature=lambda h, s: 31 + h[1],
        nvmlDeviceGetPersistenceMode=gpu_max_gen,  # not supported here
    )


@pytest.fixture
def fake_nvml(monkeypatch):
    import sys

    def install(procs):
        fake = _fake_pynvml(procs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setattr(nvml, "SESSION", nvml.NvmlSession())
        return fake

    return install


def test_fake_pynvml_matches_real_api() -> None:
    import pynvml

    fake = _fake_pynvml({})
    missing = [n for n in vars(fake) if n != "NVMLError" and not hasattr(pynvml, n)]
    assert missing == []
    assert pynvml.NVML_PCIE_UTIL_RX_BYTES == 1 and pynvml.NVML_PCIE_UTIL_TX_BYTES == 0
    assert pynvml.NVML_ERROR_FUNCTION_NOT_FOUND == 13


def test_nvml_paths_with_fake_pynvml(fake_nvml) -> None:
    me = psutil.Process().pid
    fake_nvml({0: [(me, 700 * MiB), (4_000_002, 5 * MiB)], 1: [(me, 300 * MiB)]})
    assert tm.nvml_available() and tm.nvml_unavailable_reason() is None
    assert tm.gpu_idle() is False  # processes run
    snap = tm.gpu_snapshot([1])
    assert snap == [{"index": 1, "name": "NVIDIA H200", "memory_used": 2000 * MiB, "memory_total": 150_000 * MiB,
                     "processes": [(me, 300 * MiB)]}]
    assert tm.devices_for_env({"CUDA_VISIBLE_DEVICES": "GPU-0000-1"}) == [1]

    src = tm.NvmlSource()
    assert src.devices() == [0, 1]
    assert src.memory_used() == 3000 * MiB
    assert src.pcie_rx(1) == 2000 * tm.PCIE_KB and src.pcie_tx(0) == 10 * tm.PCIE_KB
    with tm.ServiceMonitor("svc", me, interval_s=0.05) as s:  # gpu="auto" picks NVML
        time.sleep(0.12)
        w = s.window(s.mark())
    p = s.points()[-1]
    assert p.gpu_mem_used == 3000 * MiB and p.proc_gpu_mem == 1000 * MiB
    assert p.pcie_rx_bytes_per_s == 3000 * tm.PCIE_KB
    assert w["proc_gpu_mem_peak"] == 1000 * MiB
    assert w["nvml_pcie_rx_bytes"] is not None and w["nvml_pcie_rx_bytes"] > 0

    fp = fingerprint.environment_fingerprint()
    assert fp["driver_version"] == "570.86.15" and fp["cuda_driver_version"] == "12.8"
    g = fp["gpus"][1]
    assert g["name"] == "NVIDIA H200" and g["memory_total"] == 150_000 * MiB and g["pci_bus_id"] == "00000000:01:00.0"
    assert g["pcie"] == {"gen_max": 5, "width_max": 16, "gen_current": 1, "width_current": 16, "gpu_gen_max": None}
    assert fingerprint.key_value(fp, "gpu_models") == ["NVIDIA H200", "NVIDIA H200"]
    assert g["clocks_mhz"] == {"sm": 980, "sm_max": 1980, "mem": 3201, "mem_max": 3201}
    assert g["clocks_event_reasons"] == 4 and fp["gpus"][0]["clocks_event_reasons"] == 0
    assert g["power_limit_w"] == 700.0 and g["power_w"] == 95.5 and g["temperature_c"] == 32
    assert g["persistence_mode"] is None  # an NVML error is None, never raised
    assert fingerprint.key_value(fp, "gpus[].uuid") == ["GPU-0000-0", "GPU-0000-1"]
    assert fingerprint.key_value(fp, "gpus[].clocks_mhz.sm") == [1980, 980]


def test_gpu_idle_with_fake_pynvml(fake_nvml) -> None:
    fake_nvml({})
    assert tm.gpu_idle() is True
    assert tm.gpu_idle(threshold_bytes=1500 * MiB) is False  # GPU 1 uses 2000 MiB
    assert tm.gpu_idle(threshold_bytes=1500 * MiB, devices=[0]) is True


# ------------------------------------------------------------- real GPU (skipped where NVML is absent)

_GPU_SERVICE = r'''
import http.server, sys, time
try:
    import torch
    assert torch.cuda.is_available()
except Exception as e:
    print("no CUDA torch:", e, flush=True)
    sys.exit(77)
port = int(sys.argv[1])
dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")          # 1 GiB resident on the GPU
host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()            # 1 GiB pinned host buffer
dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n = int(self.path.split("=")[1]) if self.path.startswith("/copy") else 0
        for _ in range(n):
            dev.copy_(host, non_blocking=True)                         # 1 GiB host -> device each
        torch.cuda.synchronize()
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.mark.skipif(not tm.nvml_available(), reason="needs NVML (a GPU and its driver)")
def test_real_gpu_nvml_and_pcie_cross_check(tmp_path: Path) -> None:
    import warnings

    fp = fingerprint.environment_fingerprint()
    assert fp["gpus"] and fp["gpus"][0]["name"] and fp["gpus"][0]["memory_total"] > 0
    assert fp["driver_version"] and fp["cuda_driver_version"]
    assert isinstance(tm.gpu_idle(), bool)
    src = tm.NvmlSource()
    t0 = time.perf_counter()
    assert src.pcie_rx(src.devices()[0]) is not None
    call_ms = (time.perf_counter() - t0) * 1e3
    try:
        svc = Service.launch("gpu", ["{python}", "-c", _GPU_SERVICE, "{port}"], env={},
                             log_path=tmp_path / "gpu.log", health_timeout_s=120, stop_timeout_s=10)
    except Exception as e:  # noqa: BLE001
        if "code 77" in str(e):
            pytest.skip("no CUDA-enabled torch for the GPU service")
        raise
    with svc, tm.ServiceMonitor("gpu", svc.pid, devices=tm.devices_for_env()) as s:
        time.sleep(0.5)
        m = s.mark()
        r = httpx.get(svc.base_url + "/copy?n=32", timeout=120, trust_env=False)
        assert r.status_code == 200
        w = s.window(m)
    assert w["gpu_mem_used_peak"] is not None and w["gpu_mem_used_peak"] > 1 << 30
    if w["proc_gpu_mem_peak"] is not None:  # None: NVML sees another PID namespace
        assert w["proc_gpu_mem_peak"] > 1 << 30
    ratio = (w["nvml_pcie_rx_bytes"] or 0.0) / (32 * 2**30)
    warnings.warn(f"NVML PCIe RX integral / bytes copied = {ratio:.3f}; one RX read took {call_ms:.1f} ms; "
                  f"proc_gpu_mem_peak={w['proc_gpu_mem_peak']}", stacklevel=1)
    assert 0.5 < ratio < 1.5, f"NVML RX integral is {ratio:.3f} x the bytes copied"
