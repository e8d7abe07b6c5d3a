"""Mixture-of-experts ops: the softmax top-k router, the experts through one grouped-GEMM path, and the probes
that say whether ``torch._grouped_mm`` runs (and captures in a CUDA graph) on a device and dtype.

- ``route(h [T, H], router [E, H], top_k, norm_topk_prob, bias)`` -> (weights [T, k] in h's dtype, ids [T, k]);
  ``decode_route`` is its one-token form ("torch", or the Triton router of :mod:`abbench.engine.ops.kernels`,
  optionally looking the experts up in the decode slot table in the same kernel).
- ``moe_experts(h [T, H], top_w, top_ids [T, k], gate_up [G, 2I, H], down [G, H, I], mm)`` -> [T, H]: the
  assignments sorted by expert with a stable argsort, group ends from ``searchsorted`` (no host sync),
  ``grouped_mm`` on transposed views (no copy), a deterministic combine (``index_copy_``, a weighted sum over
  the k slots) instead of atomics. ``looped_mm`` computes the same with one matmul per group (a host sync),
  where the grouped GEMM fails (``expert_kernel`` says which). At most ``MAX_GROUPED_MM_GROUPS`` groups, on
  every device (``TooManyGroups``), so CPU tests see CUDA's limit.
- ``Fp8Experts``: a layer's (or a slice's) experts as an FP8 bank keeps them, float8 e4m3 values and float32
  row scales, which ``moe_experts`` multiplies without a dequantized copy (``--fp8-dequant gemm``, ``w8a8``): on
  CUDA through ``kernels.grouped_mm_fp8`` (the values and scales read in the GEMM's inner loop; with ``math``
  "fp8" the activations quantized per row and FP8 multiplied by FP8), elsewhere in torch: the weights
  dequantized into a temporary (the same weights, bit for bit) and the grouped GEMM, or for "fp8" the
  activations quantized as ``fp8.quantize_rows`` does and the FP8 values multiplied in float32.
- ``router_skew_bias``: per layer a logit bias that concentrates random weights' routing as a trained router's.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.nn.functional as F

from abbench.engine.config import MAX_GROUPED_MM_GROUPS
from abbench.engine.ops import kernels
from abbench.engine.ops.fp8 import quantize_rows
from abbench.engine.ops.kernels import route_topk


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool,
          bias: torch.Tensor | None = None):
    """Softmax top-k router. Returns (weights [T, k] in h.dtype, expert ids [T, k] int64). ``bias`` [E] float32
    (random weights with ``router_skew`` only: :func:`router_skew_bias`) is added to the logits in float32."""
    logits = F.linear(h, router)  # [T, E]
    if bias is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    else:
        probs = torch.softmax(logits.float() + bias, dim=-1)  # [T, E]
    top_w, top_ids = torch.topk(probs, top_k, dim=-1)  # [T, k], [T, k]
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)  # [T, k]
    return top_w.to(h.dtype), top_ids


def decode_route(kernel: str, h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 bias: torch.Tensor | None = None, lookup=None):
    """``route`` for one decode token h [1, H]: its torch ops ("torch") or, for "triton"
    (``EngineConfig.decode_experts``), the router matmul and one kernel for softmax, top-k and renormalisation
    (``decode_kernels.route_topk``) -> (weights [1, k] in h.dtype, expert ids [1, k] int64). ``lookup`` (a
    ``decode_kernels.SlotLookup``, "triton" only): the same kernel looks the experts up in the slot table."""
    if kernel == "triton":
        return route_topk(F.linear(h, router), top_k, norm_topk_prob, h.dtype, bias, lookup=lookup)
    if lookup is not None:
        raise ValueError("a slot lookup in the router needs the Triton router (decode_experts 'triton')")
    return route(h, router, top_k, norm_topk_prob, bias)


def router_skew_bias(num_experts: int, num_layers: int, skew: float, seed: int,
                     device: torch.device) -> list[torch.Tensor] | None:
    """Per layer a router logit bias [E] float32 that concentrates routing as trained routers do: each layer ranks
    its experts in a seeded random order and expert of rank r gets -skew x ln(r), which multiplies its softmax
    weight by r^-skew (a Zipf-like preference of exponent ``skew``). None for skew 0 (uniform random routing)."""
    if skew <= 0:
        return None
    out = []
    for layer in range(num_layers):
        gen = torch.Generator(device="cpu").manual_seed(seed * 7_919 + layer)
        rank = torch.empty(num_experts, dtype=torch.float32)
        rank[torch.randperm(num_experts, generator=gen)] = torch.arange(1, num_experts + 1, dtype=torch.float32)
        out.append((-skew * rank.log()).to(device))  # [E]
    return out


class TooManyGroups(ValueError):
    """A grouped GEMM was asked for more groups than CUDA's kernel takes (on any device, so CPU tests see it)."""


def check_groups(w: torch.Tensor) -> None:
    if w.shape[0] > MAX_GROUPED_MM_GROUPS:
        raise TooManyGroups(f"grouped GEMM over {w.shape[0]} groups > {MAX_GROUPED_MM_GROUPS} (CUDA's "
                            "torch._grouped_mm limit); pass one layer's experts or slots")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [M, K] in group order times their group's ``w[g]`` [N, K] (nn.Linear layout) -> [M, N].
    ``offs`` [G] int32 holds each group's end row. At most MAX_GROUPED_MM_GROUPS groups, on every device."""
    check_groups(w)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # [M, N]


def looped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Same as ``grouped_mm`` with one matmul per non-empty group (reads offs on the host)."""
    check_groups(w)
    out = x.new_empty(x.shape[0], w.shape[1])  # [M, N]
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[g])  # [m_g, N]
        start = end
    return out


@dataclasses.dataclass(frozen=True)
class Fp8Experts:
    """Experts as an FP8 bank keeps them: ``values`` [G, N, K] float8 e4m3 and their row scales ``scales``
    [G, N] float32; the weight is ``values * scales`` computed in float32 and rounded once to the compute
    dtype (``bank.dequantize_into``'s per-row rule). ``moe_experts`` takes them where it takes [G, N, K]
    weights, multiplying them in ``math`` (``kernels.GROUPED_FP8_MATHS``: "bf16" weight-only, "fp8" W8A8). A
    slice (``[a:b]``) views both."""

    values: torch.Tensor
    scales: torch.Tensor
    math: str = "bf16"

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def data_ptr(self) -> int:  # what keys a captured graph's weights (the scales live beside the values)
        return self.values.data_ptr()

    def __getitem__(self, index) -> Fp8Experts:
        return Fp8Experts(self.values[index], self.scales[index], self.math)

    def copy_(self, other: Fp8Experts, non_blocking: bool = False) -> Fp8Experts:
        self.values.copy_(other.values, non_blocking=non_blocking)
        self.scales.copy_(other.scales, non_blocking=non_blocking)
        return self

    @staticmethod
    def empty(groups: int, n: int, k: int, device: torch.device | str, math: str = "bf16") -> Fp8Experts:
        return Fp8Experts(torch.empty((groups, n, k), device=device, dtype=torch.float8_e4m3fn),
                          torch.empty((groups, n), device=device, dtype=torch.float32), math)


def fp8_grouped_mm(x: torch.Tensor, w: Fp8Experts, offs: torch.Tensor, mm=grouped_mm) -> torch.Tensor:
    """``mm(x, w, offs)`` over FP8 experts in ``w.math`` -> [M, N] in x's dtype. On CUDA
    ``kernels.grouped_mm_fp8``: its own summation order (so every prefill mode of an engine that uses it must, to
    share bits). Elsewhere, "bf16": the weights dequantized into a temporary and ``mm``, bitwise the grouped GEMM
    over a dequantized layer; "fp8": ``w8a8_reference``."""
    check_groups(w.values)
    if x.is_cuda:
        return kernels.grouped_mm_fp8(x, w.values, w.scales, offs, math=w.math)
    if w.math == "fp8":
        return w8a8_reference(x, w, offs, mm)
    dense = (w.values.to(torch.float32) * w.scales.unsqueeze(-1)).to(x.dtype)  # [G, N, K]
    return mm(x, dense, offs)


def w8a8_reference(x: torch.Tensor, w: Fp8Experts, offs: torch.Tensor, mm=grouped_mm) -> torch.Tensor:
    """The W8A8 grouped GEMM in torch: x quantized per row (``fp8.quantize_rows``), its FP8 values times the
    weights' FP8 values summed in float32 (``mm``), then times the row's and the channel's scales -> [M, N] in
    x's dtype. What ``kernels.grouped_mm_fp8(math="fp8")`` computes, in another summation order."""
    xq, xs = quantize_rows(x)
    acc = mm(xq.to(torch.float32), w.values.to(torch.float32), offs)  # [M, N]
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))  # [G]
    group = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)  # [M] each row's expert
    return (acc * xs.unsqueeze(-1) * w.scales[group]).to(x.dtype)


def moe_experts(h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor, gate_up: torch.Tensor | Fp8Experts,
                down: torch.Tensor | Fp8Experts, mm=grouped_mm) -> torch.Tensor:
    """SwiGLU experts for h [T, H] routed to ``top_ids`` [T, k] (indices into the first dim of the weights)
    with ``top_w`` [T, k]. ``gate_up`` [G, 2I, H] (gate rows first), ``down`` [G, H, I], each a tensor or
    ``Fp8Experts``. Returns [T, H]."""
    if isinstance(gate_up, Fp8Experts):
        plain = mm
        mm = lambda x, w, offs: fp8_grouped_mm(x, w, offs, plain)  # noqa: E731
    T, k = top_ids.shape
    G, two_i, _ = gate_up.shape
    flat = top_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k] assignment indices, grouped by expert
    groups = torch.arange(G, device=flat.device, dtype=flat.dtype)  # [G]
    offs = torch.searchsorted(flat[order], groups, right=True).to(torch.int32)  # [G] end row of each group
    xs = h[order // k]  # [T*k, H] token rows in group order
    gu = mm(xs, gate_up, offs)  # [T*k, 2I]
    act = F.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2:]  # [T*k, I]
    ys = mm(act, down, offs)  # [T*k, H]
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # [T*k, H] back in (token, slot) order
    return (y.view(T, k, -1) * top_w.unsqueeze(-1)).sum(dim=1)  # [T, H]


def probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device/dtype and agrees with the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(24, 32, generator=gen).to(device, dtype)  # [M, K]
        w = torch.randn(4, 16, 32, generator=gen).to(device, dtype)  # [G, N, K]
        offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32, device=device)  # [G]
        a, b = grouped_mm(x, w, offs).float(), looped_mm(x, w, offs).float()  # [M, N]
        return bool(torch.allclose(a, b, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def probe_graph_capture(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm can be captured in a CUDA graph on this device/dtype. It runs for float32 on
    CUDA too (torch 2.11), but through a fallback that reads the group offsets back to the host, which graph
    capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"); the bf16 kernel on
    Hopper captures. False off CUDA and wherever the capture fails (the failed capture is discarded, and with it
    torch's "The CUDA Graph is empty" warning, which is this probe's expected outcome, not a fault). Asked once
    per process for each (device, dtype): every engine and decoder built afterwards reuses the answer."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        return _capture_grouped_mm(device, dtype)


def _capture_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.ones(24, 32, device=device, dtype=dtype)  # [M, K]
    w = torch.ones(4, 16, 32, device=device, dtype=dtype)  # [G, N, K]
    offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32, device=device)  # [G]
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            grouped_mm(x, w, offs)  # warm up outside the capture, as every captured piece is
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = grouped_mm(x, w, offs)  # [M, N]
        graph.replay()
        torch.cuda.synchronize(device)
        return bool(torch.all(y == 32))  # ones . ones over K=32 (exact in any float dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        torch.cuda.synchronize(device)
        return False


def expert_kernel(device: torch.device, dtype: torch.dtype):
    """(grouped GEMM works, its name for reports, the mm function every MoE call uses) on this device/dtype.
    Decode captures CUDA graphs only where :func:`probe_graph_capture` says the grouped GEMM captures."""
    grouped = probe_grouped_mm(device, dtype)
    name = "torch._grouped_mm" if grouped else "per-expert loop (torch._grouped_mm failed)"
    return grouped, name, grouped_mm if grouped else looped_mm
