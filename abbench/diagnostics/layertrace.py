"""Layer-level localization of a divergence (``abbench probe RUN --prompt P --arm A --layers``): pure parts.

Two layer traces of the same token history (the ``abbench.layer_trace`` of the vendored engine or the
transformers reference, :mod:`abbench.engine.ops.trace`: per layer and sub-block the hash, the RMS and the float32
values of the last position's hidden state) are compared entry by entry, in the order a layer computes them:
same hash (bitwise equal) or not, each side's RMS, the RMS of the difference and that relative to the
reference's RMS. :attr:`LayerProbe.first_difference` names the first layer and sub-block where they differ;
the rows after it show how the difference grows. :func:`format_layers` renders plain text,
:func:`layers_markdown` a report section, :func:`plot_layers` a PNG (matplotlib, imported when drawing).

No torch: the values are decoded with numpy. :mod:`abbench.diagnostics.layers` gets the traces (it launches the
services).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_ORDER = ("attention", "router", "shared_expert", "experts", "residual")


@dataclass(frozen=True)
class BlockDiff:
    layer: int
    block: str
    ref_hash: str | None
    arm_hash: str | None
    ref_rms: float | None
    arm_rms: float | None
    diff_rms: float | None  # RMS of (arm - reference); None when either side has no values

    @property
    def same(self) -> bool | None:
        """Bitwise equal (the hashes); None when one side did not trace this block."""
        if self.ref_hash is None or self.arm_hash is None:
            return None
        return self.ref_hash == self.arm_hash

    @property
    def rel(self) -> float | None:
        if self.diff_rms is None or not self.ref_rms:
            return None
        return self.diff_rms / self.ref_rms


@dataclass
class LayerProbe:
    prompt_id: str
    arm: str
    reference: str
    position: int  # 0: the last prompt token; N: after the reference's first N output ids
    n_tokens: int  # the history traced
    rows: list[BlockDiff]
    ref_choice: int | None = None
    arm_choice: int | None = None
    ref_top: list[tuple[int, float]] | None = None
    arm_top: list[tuple[int, float]] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def first_difference(self) -> BlockDiff | None:
        return next((r for r in self.rows if r.same is False), None)


def _values(entry: dict[str, Any]) -> np.ndarray | None:
    v = entry.get("values")
    if not v:
        return None
    return np.frombuffer(base64.b64decode(v), dtype="<f4").astype(np.float64)


def compare_traces(ref: list[dict[str, Any]], arm: list[dict[str, Any]]) -> list[BlockDiff]:
    """One row per (layer, block) either side traced, in layer order and then the order a layer computes."""
    a = {(int(e["layer"]), str(e["block"])): e for e in ref}
    b = {(int(e["layer"]), str(e["block"])): e for e in arm}
    order = {blk: i for i, blk in enumerate(BLOCK_ORDER)}
    rows = []
    for key in sorted(set(a) | set(b), key=lambda k: (k[0], order.get(k[1], 99), k[1])):
        ea, eb = a.get(key, {}), b.get(key, {})
        va, vb = _values(ea), _values(eb)
        diff = None
        if va is not None and vb is not None and va.shape == vb.shape:
            diff = float(np.sqrt(np.mean((vb - va) ** 2)))
        rows.append(BlockDiff(layer=key[0], block=key[1], ref_hash=ea.get("hash"), arm_hash=eb.get("hash"),
                              ref_rms=ea.get("rms"), arm_rms=eb.get("rms"), diff_rms=diff))
    return rows


def _g(x: float | None, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def _where(p: LayerProbe) -> str:
    at = "the last prompt position" if p.position == 0 else f"output position {p.position} (the prompt + the " \
        f"reference's first {p.position} ids)"
    return f"{at}, {p.n_tokens} tokens"


def verdict_lines(p: LayerProbe) -> list[str]:
    first = p.first_difference
    lines = [f"layer probe: prompt {p.prompt_id}, arm {p.arm} against {p.reference}, hidden states at {_where(p)}"]
    if not p.rows:
        return lines + ["no layer trace to compare"]
    if first is None:
        same = sum(1 for r in p.rows if r.same)
        lines.append(f"every traced sub-block is bitwise equal ({same} of {len(p.rows)})")
    else:
        rel = f", {_g(first.rel)} of the reference's RMS" if first.rel is not None else ""
        lines.append(f"first difference: layer {first.layer}, {first.block} (RMS of the difference "
                     f"{_g(first.diff_rms)}{rel})")
        last = p.rows[-1]
        if last.diff_rms is not None:
            lines.append(f"at the last traced block (layer {last.layer}, {last.block}): RMS of the difference "
                         f"{_g(last.diff_rms)} ({_g(last.rel)} relative)")
    if p.ref_choice is not None and p.arm_choice is not None:
        same = "the same token" if p.ref_choice == p.arm_choice else "different tokens"
        lines.append(f"next token: {p.reference} {p.ref_choice}, {p.arm} {p.arm_choice} ({same}); top-2 "
                     f"{_top(p.ref_top)} / {_top(p.arm_top)}")
    return lines + [f"note: {n}" for n in p.notes]


def _top(top: list[tuple[int, float]] | None) -> str:
    if not top:
        return "n/a"
    return ", ".join(f"{int(i)}:{float(v):.4f}" for i, v in top[:2])


def _row_cells(r: BlockDiff, first: BlockDiff | None) -> list[str]:
    mark = ">>" if r is first else ("" if r.same in (True, None) else "!")
    same = "—" if r.same is None else ("equal" if r.same else "differs")
    return [mark, str(r.layer), r.block, same, _g(r.ref_rms, 4), _g(r.arm_rms, 4), _g(r.diff_rms), _g(r.rel)]


HEADER = ["", "layer", "block", "bitwise", "RMS ref", "RMS arm", "RMS diff", "diff/ref"]


def format_layers(p: LayerProbe) -> str:
    rows = [HEADER] + [_row_cells(r, p.first_difference) for r in p.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    body = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]
    return "\n".join(verdict_lines(p) + [""] + body + ["", ">> first differing sub-block, ! differs"]) + "\n"


def layers_markdown(p: LayerProbe, *, plot: str | None = None, command: str | None = None) -> str:
    """A Markdown report of the layer probe (``plot``: a relative link to :func:`plot_layers`' PNG)."""
    lines = [f"# Layer probe: {p.prompt_id}, {p.arm} vs {p.reference}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"- {ln}" for ln in verdict_lines(p)] + [""]
    lines += ["Per layer and sub-block (in the order a layer computes them: attention output, router ids, "
              "shared expert, routed experts' output, the residual stream after the layer): bitwise equality "
              "of the hidden state (hash), each side's RMS, the RMS of the difference and that relative to "
              "the reference's RMS.", ""]
    lines.append("| " + " | ".join(h or " " for h in HEADER) + " |")
    lines.append("|" + "|".join(["---"] * 3 + ["---"] + ["---:"] * 4) + "|")
    for r in p.rows:
        lines.append("| " + " | ".join(_row_cells(r, p.first_difference)) + " |")
    if plot:
        lines += ["", f"![RMS of the difference per layer]({plot})"]
    return "\n".join(lines) + "\n"


def plot_layers(p: LayerProbe, path: Path) -> Path | None:
    """RMS of the difference per layer, one line per sub-block (log scale); None when nothing differs."""
    pts = [r for r in p.rows if r.diff_rms is not None]
    if not any(r.diff_rms for r in pts):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for block in [b for b in BLOCK_ORDER if any(r.block == b for r in pts)]:
        rows = [r for r in pts if r.block == block]
        ax.plot([r.layer for r in rows], [max(r.diff_rms or 0.0, 1e-12) for r in rows], marker="o", label=block)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("RMS of (arm - reference)")
    ax.set_title(f"{p.prompt_id}: {p.arm} vs {p.reference} (1e-12 = equal)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
