"""``--prefill-mode auto``: per request, the offloaded prefill path a cost model expects to be fastest.

Contract:
- ``CostModel`` holds what the engine measured at start: host-to-device bandwidth (bytes/s), the bytes of one
  layer's experts and of one expert, the layer count, the experts per layer and per token, one layer step's
  compute time at two or more chunk lengths (``step_s``: {tokens: seconds}, interpolated linearly in tokens,
  extrapolated from the last two), and the host round trip that demand loading pays per layer (``sync_s``).
- ``estimate(model, chunks, chunks_per_window, demand_max_tokens, freqs)`` -> {path: seconds} for chunked,
  layer-major (where it applies) and demand over a chunk plan:
  * streamed paths overlap each layer's copy with compute: chunked max(n_chunks x bank, compute), layer-major
    max(n_windows x bank, compute) (bank = one pass over every layer's experts at the bandwidth; on CPU, where
    a copy is a synchronous memcpy, the sum instead); layer-major only for plans of two chunks or more (one
    chunk is the chunked path);
  * demand runs each short chunk (<= demand_max_tokens) layer by layer with nothing to overlap: per layer the
    step, the round trip, and the copy of the distinct experts the chunk's tokens are expected to route to;
    longer chunks stream as in chunked. The expected distinct experts of a layer for T tokens x k choices
    is sum_e 1 - (1 - p_e)^(T k) over that layer's routing frequencies ``freqs[layer]`` (what the engine has
    seen routed so far; uniform before anything).
- ``Calibration``: the one term the model cannot know in advance, corrected by what the engine saw. Demand's
  copies assume every routing choice independent; real routing is correlated between neighbouring tokens, so a
  chunk touches fewer distinct experts (on the H200, Qwen3-30B-A3B shape, random router: a 64-token suffix's
  demand prefill copied 2,510 experts where independent uniform choices touch ~6,030;
  results/20261201j-h200-qwen3-30b-a3b-sweep-skewed: with the observed frequencies the model still put demand
  above its measured time and picked layer-major where demand was 10% faster). After every demand prefill the engine
  compares the experts it copied with the model's expectation for that prefill; the median ratio of the last
  ``window`` prefills (1.0 until ``MIN_PREFILLS`` have run: one cold or disturbed request steers nothing;
  bounded to 0.25-4) scales demand's copy term from then on. The time terms are measured at start and need no
  correction; a per-path time factor was tried and rejected: it mixes prefills of every shape (a 16K cold
  prefix with a 64-token suffix) into one number.
- ``choose(...) -> (path, reason, estimates, calibrated)``: the cheapest calibrated estimate (ties go to
  layer-major, then chunked: no host syncs); or, with ``demand_max_uncached`` (``--auto-demand-max-tokens``: a
  threshold measured by a sweep instead of the model), demand for prompts of at most that many uncached tokens and the best streamed path
  otherwise. Every path gives bitwise the same output, so the choice changes time only.
Pure: no torch (frequencies are lists or a numpy array, computed on with numpy).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    bandwidth: float  # host->device bytes per second
    layer_bytes: int  # one layer's experts
    expert_bytes: int  # one expert
    n_layers: int
    num_experts: int
    top_k: int
    step_s: dict[int, float]  # one layer step's compute seconds at these chunk lengths
    sync_s: float  # one host round trip (demand reads each layer's routing back)
    overlap: bool = True  # streamed copies overlap compute (CUDA: a copy stream); on CPU they add up

    def streamed(self, copy_s: float, compute_s: float) -> float:
        return max(copy_s, compute_s) if self.overlap else copy_s + compute_s

    def step(self, tokens: int) -> float:
        """One layer step's compute seconds for a ``tokens``-token chunk (piecewise linear in tokens)."""
        pts = sorted(self.step_s.items())
        if len(pts) == 1:
            t, s = pts[0]
            return s * tokens / t
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if tokens <= t1 or (t1, s1) == pts[-1]:
                return max(0.0, s0 + (s1 - s0) * (tokens - t0) / (t1 - t0))
        raise AssertionError("unreachable")

    @property
    def bank_s(self) -> float:
        return self.n_layers * self.layer_bytes / self.bandwidth


def expected_distinct(freqs: list[float] | None, tokens: int, top_k: int, num_experts: int) -> float:
    """Expected distinct experts that ``tokens`` tokens with ``top_k`` choices each touch in a layer whose routing
    frequencies are ``freqs`` (uniform when None): sum_e 1 - (1 - p_e)^(tokens x top_k), at most num_experts."""
    p = _probabilities(None if freqs is None else [freqs], 1, num_experts)
    return float(_distinct_per_layer(p, tokens, top_k, num_experts)[0])


def _probabilities(freqs, n_layers: int, num_experts: int) -> np.ndarray:
    """[L, E] routing probabilities per layer (uniform where ``freqs`` is None or empty)."""
    if freqs is None or len(freqs) == 0:
        return np.full((n_layers, num_experts), 1.0 / num_experts)
    f = np.asarray(freqs, dtype=np.float64)
    return f / f.sum(axis=1, keepdims=True)


def _distinct_per_layer(p: np.ndarray, tokens: int, top_k: int, num_experts: int) -> np.ndarray:
    """[L] expected distinct experts ``tokens`` tokens touch in each layer (``expected_distinct``, vectorised)."""
    return np.minimum(float(num_experts), (1.0 - (1.0 - p) ** (tokens * top_k)).sum(axis=1))


def _demand_parts(model: CostModel, chunks: list[tuple[int, int]], demand_max_tokens: int,
                  freqs) -> tuple[float, float, float]:
    """Demand over ``chunks``: (its seconds that do not depend on the routing: short chunks' steps and round
    trips, streamed chunks; the routed experts its short chunks are expected to copy; the experts its streamed
    chunks copy)."""
    L, E = model.n_layers, model.num_experts
    p = _probabilities(freqs, L, E)
    fixed = routed = streamed = 0.0
    for a, b in chunks:
        t = b - a
        if t > demand_max_tokens:
            fixed += model.streamed(model.bank_s, L * model.step(t))
            streamed += L * E
        else:
            fixed += L * (model.step(t) + model.sync_s)
            routed += float(_distinct_per_layer(p, t, model.top_k, E).sum())
    return fixed, routed, streamed


def expected_demand_copies(model: CostModel, chunks: list[tuple[int, int]], demand_max_tokens: int,
                           freqs=None) -> float:
    """Experts a demand prefill over ``chunks`` is expected to copy: the distinct experts of every short chunk in
    every layer, and every expert of every layer for a chunk that streams."""
    _, routed, streamed = _demand_parts(model, chunks, demand_max_tokens, freqs)
    return routed + streamed


def _estimates(model: CostModel, chunks: list[tuple[int, int]], chunks_per_window: int,
               demand: tuple[float, float, float], copies_factor: float) -> dict[str, float]:
    L, bank = model.n_layers, model.bank_s
    compute = sum(L * model.step(b - a) for a, b in chunks)
    n_windows = -(-len(chunks) // max(1, chunks_per_window))
    out = {"chunked": model.streamed(len(chunks) * bank, compute)}
    if len(chunks) > 1 and chunks_per_window > 1:
        out["layer-major"] = model.streamed(n_windows * bank, compute)
    fixed, routed, _ = demand
    out["demand"] = fixed + copies_factor * routed * model.expert_bytes / model.bandwidth
    return out


def estimate(model: CostModel, chunks: list[tuple[int, int]], chunks_per_window: int, demand_max_tokens: int,
             freqs=None, copies_factor: float = 1.0) -> dict[str, float]:
    """Estimated seconds of each offloaded path over ``chunks`` [(a, b))); demand's copies of routed experts
    scaled by ``copies_factor`` (``Calibration``); see the module docstring. ``freqs``: [L][E] routing counts
    (lists or an array), None for uniform."""
    return _estimates(model, chunks, chunks_per_window, _demand_parts(model, chunks, demand_max_tokens, freqs),
                      copies_factor)


class Calibration:
    """Demand's copies as measured: the median ratio of experts copied to experts expected (module docstring)."""

    FACTOR_RANGE = (0.25, 4.0)  # one wild measurement cannot swing the estimates without bound
    MIN_PREFILLS = 3  # a median of three outvotes one cold or disturbed prefill

    def __init__(self, window: int = 16):
        if window < 1:
            raise ValueError(f"calibration window must be >= 1, got {window}")
        self.window = window
        self._logs: deque[float] = deque(maxlen=window)

    def observe(self, expected_copies: float, copied: float) -> None:
        """A demand prefill copied ``copied`` experts where the model expected ``expected_copies``."""
        if expected_copies > 0 and copied > 0 and math.isfinite(expected_copies) and math.isfinite(copied):
            self._logs.append(math.log(copied / expected_copies))

    @property
    def factor(self) -> float:
        if len(self._logs) < min(self.MIN_PREFILLS, self.window):
            return 1.0
        lo, hi = self.FACTOR_RANGE
        return min(hi, max(lo, math.exp(statistics.median(self._logs))))

    @property
    def seen(self) -> int:
        return len(self._logs)


def choose(model: CostModel, chunks: list[tuple[int, int]], chunks_per_window: int, demand_max_tokens: int,
           freqs=None, demand_max_uncached: int | None = None,
           calibration: Calibration | None = None) -> tuple[str, str, dict[str, float], dict[str, float]]:
    """(path, reason, the model's estimates, the calibrated ones) for one request; see the module docstring."""
    demand = _demand_parts(model, chunks, demand_max_tokens, freqs)
    est = _estimates(model, chunks, chunks_per_window, demand, 1.0)
    factor = calibration.factor if calibration is not None else 1.0
    cal = est if factor == 1.0 else _estimates(model, chunks, chunks_per_window, demand, factor)
    uncached = sum(b - a for a, b in chunks)
    order = [p for p in ("layer-major", "chunked", "demand") if p in cal]
    streamed = min(order[:-1], key=lambda p: (cal[p], order.index(p)))
    if demand_max_uncached is not None:
        if uncached <= demand_max_uncached:
            return ("demand", f"auto: {uncached} uncached tokens <= --auto-demand-max-tokens {demand_max_uncached}",
                    est, cal)
        return streamed, (f"auto: {uncached} uncached tokens > --auto-demand-max-tokens {demand_max_uncached}; "
                          f"{streamed} moves the fewest banks"), est, cal
    best = min(order, key=lambda p: (cal[p], order.index(p)))
    others = ", ".join(f"{p} {cal[p] * 1e3:.1f} ms" for p in order if p != best)
    what = "estimated" if factor == 1.0 else f"estimated (demand copies x{factor:.3f}, measured)"
    return best, f"auto: {best} {what} {cal[best] * 1e3:.1f} ms ({others})", est, cal
