"""Layer traces: per layer and sub-block, the hidden state of the last prompt position, hashed.

A request with ``trace_layers: true`` (server flag ``--allow-request-overrides``) makes the runtime hang a
:class:`LayerTrace` on the model for its prefill (``Model.trace``). The model calls it from its two layer
halves with the whole chunk's tensors (``attn_block``: ``attention``, the attention output before the
residual add, and ``router``, the routed expert ids; ``moe_block``: ``experts``, the routed experts' output,
and ``residual``, the hidden state after the layer). Every prefill path runs the chunks of a layer in order,
so the last call per (layer, block) holds the prompt's last chunk, whose last row is the last prompt position.

:meth:`LayerTrace.export` gives one entry per (layer, block), layers in order: ``hash`` (sha256 of the raw
bytes in the model's dtype, 16 hex digits: equal hashes mean bitwise-equal states), ``rms`` (float32 RMS;
None for the router ids) and ``values`` (the state as base64 float32 little-endian, so a caller can take
the RMS of the difference between two engines; None for the router ids). Only the last row of each call is
kept (a copy), so tracing costs a few kB per layer; hashing happens once, at export.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import torch

BLOCKS = ("attention", "router", "shared_expert", "experts", "residual")
"""Sub-blocks in the order a layer computes them (the order of :meth:`LayerTrace.export`)."""


class LayerTrace:
    """Callable ``(layer, block, tensor [T, ...])``: keeps the last row of the latest call per (layer, block)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, layer: int, block: str, t: torch.Tensor) -> None:
        self.rows[(int(layer), block)] = t[-1].detach().clone()

    def export(self) -> list[dict[str, Any]]:
        order = {b: i for i, b in enumerate(BLOCKS)}
        out = []
        for (layer, block), t in sorted(self.rows.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99))):
            out.append(entry(layer, block, t))
        return out


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in its own dtype (bfloat16 through an int16 view: numpy has no bfloat16)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def entry(layer: int, block: str, t: torch.Tensor) -> dict[str, Any]:
    """One exported trace entry (module docstring)."""
    digest = hashlib.sha256(raw_bytes(t) + str(t.dtype).encode()).hexdigest()[:16]
    if not t.is_floating_point():
        return {"layer": layer, "block": block, "hash": digest, "rms": None, "values": None}
    f = t.detach().float().cpu()
    return {"layer": layer, "block": block, "hash": digest, "rms": float(f.pow(2).mean().sqrt()),
            "values": base64.b64encode(f.contiguous().numpy().astype("<f4").tobytes()).decode()}
