"""What a level samples beside its requests: the engine's Prometheus metrics path and, on a GPU, NVML.

:class:`Scraper` runs in a thread of its own every ``interval`` seconds: ``GET`` the metrics path (its text is
kept and parsed after the level, so scraping costs the event loop nothing) and, where NVML is available,
:func:`abbench.nvml.gpu_sample` (memory used and utilisation per GPU). :meth:`Scraper.start` returns after the
first sample, so the client's first, slowest round trip never falls inside the level. A metrics path that fails
(not 200, or a transport error) stops its scraping and says why (``error``); the NVML samples go on. Gauges and
counters are kept; histogram series (``_bucket``, ``_sum``, ``_count``, ``_created``) are left out.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Mapping

import httpx

from abbench.auth import default_tls_context
from abbench.loadrecords import LoadScrape
from abbench.nvml import gpu_sample
from abbench.prometheus import parse_prometheus

__all__ = ["Scraper"]


class Scraper:
    """Samples every ``interval`` s from a thread (module docstring). ``gpus``: False for no NVML, else the NVML
    indices to sample (None: every GPU)."""

    def __init__(self, url: str | None, interval: float, headers: Mapping[str, str],
                 verify: ssl.SSLContext | bool = True, *, gpus: list[int] | None | bool = False) -> None:
        self.url, self.interval, self.headers, self.verify = url, interval, dict(headers), verify
        self.gpus = gpus
        self.samples: list[tuple[float, str | None, dict[str, float] | None]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abbench-load-scrape", daemon=True)
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._thread.start()
        self._ready.wait(30)

    def _get(self, http: httpx.Client) -> str | None:
        try:
            r = http.get(str(self.url), headers=self.headers)
        except httpx.HTTPError as e:
            self.error = f"GET {self.url}: {type(e).__name__}: {e}"
            return None
        if r.status_code != 200:
            self.error = f"GET {self.url}: HTTP {r.status_code}"
            return None
        return r.text

    def _run(self) -> None:
        verify = default_tls_context() if self.verify is True else self.verify  # the public CAs: one context
        http = httpx.Client(trust_env=False, timeout=max(2.0, self.interval), verify=verify) if self.url else None
        try:
            while not self._stop.is_set():
                text = self._get(http) if http is not None and self.error is None else None
                gpu = gpu_sample(None if self.gpus is True else self.gpus) if self.gpus is not False else None
                if text is not None or gpu:
                    self.samples.append((time.perf_counter() - self.t0, text, gpu))
                self._ready.set()
                if self.error is not None and self.gpus is False:
                    return
                self._stop.wait(self.interval)
        finally:
            self._ready.set()
            if http is not None:
                http.close()

    def stop(self) -> list[LoadScrape]:
        """Stop, and the samples as records (times on the scraper's clock, from :meth:`start`)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        out = []
        for t, text, gpu in self.samples:
            m = {k: v for k, v in parse_prometheus(text, strict=False).items() if not _histogram(k)} if text else {}
            out.append(LoadScrape(t=round(t, 6), metrics={**m, **(gpu or {})}))
        return out


def _histogram(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith(("_bucket", "_sum", "_count", "_created"))
