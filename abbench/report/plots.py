"""The report's PNG plots (TTFT, paired ratios, H2D, memory over time, TTFT against peak device memory).

matplotlib (Agg, through ``FigureCanvasAgg``: no global backend switch, no pyplot) is imported only inside
the plotting functions, so ``import abbench.report`` stays cheap. A plot without data is not drawn (a stale
file of that name is removed) and :func:`write_plots` says why.
"""

from __future__ import annotations

import math

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from abbench import analysis as an
from abbench.report.format import group_label, is_na
from abbench.results import RunRecord


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _groups(df: pd.DataFrame) -> list[tuple[Any, Any]]:
    order = {k: i for i, k in enumerate(an.KIND_ORDER)}
    keys = {(k, t) for k, t in zip(df["kind"], df["target_tokens"])}
    return sorted(keys, key=lambda kt: (order.get(kt[0], 9), -1 if is_na(kt[1]) else int(kt[1])))


def _log_if_wide(ax: Any, values: Iterable[float]) -> None:
    """A log y axis when the values span more than 10x, with plain tick labels (0.5, 1, 4, 10: not 4×10^0)."""
    from matplotlib.ticker import FuncFormatter

    xs = [float(v) for v in values if not is_na(v) and float(v) > 0]
    if xs and max(xs) / min(xs) > 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))


def _minor_label(v: float, _pos: Any = None) -> str:
    """A log axis's minor tick: labelled, plainly, at 2 and 5 times a power of ten (0.2, 0.5, 2, 50); blank else."""
    if v <= 0:
        return ""
    mantissa = v / 10 ** math.floor(math.log10(v) + 1e-9)
    return f"{v:g}" if any(abs(mantissa - m) < 1e-6 for m in (2.0, 5.0)) else ""


def plot_ttft(a: an.Analysis, path: Path) -> None:
    df = a.ttft
    groups = _groups(df)
    fig = _figure(max(6.0, 1.2 * len(groups) + 2), 4.2)
    ax = fig.add_subplot()
    arms = [x for x in a.arms if x in set(df["arm"])]
    width = 0.7 / max(1, len(arms))
    for i, arm in enumerate(arms):
        g = df[df["arm"] == arm]
        idx = {kt: j for j, kt in enumerate(groups)}
        xs = [idx[(k, t)] - 0.35 + width * (i + 0.5) for k, t in zip(g["kind"], g["target_tokens"])]
        med, lo, hi = g["median_s"].to_numpy(float), g["min_s"].to_numpy(float), g["max_s"].to_numpy(float)
        ax.errorbar(xs, med, yerr=[med - lo, hi - med], fmt="o", capsize=4, label=arm)
    ax.set_xticks(range(len(groups)), [group_label(k, t) for k, t in groups])
    ax.set_xlabel("prompt (kind, tokens)")
    ax.set_ylabel("TTFT (s): median, min–max")
    _log_if_wide(ax, list(df["min_s"]) + list(df["max_s"]))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="arm", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never on a point
    ax.set_title("Time to first token")
    fig.savefig(path)


def plot_ratios(a: an.Analysis, path: Path) -> None:
    pairs, summ = a.pairs, a.ratios
    arms = [x for x in a.arms if x in set(pairs["arm"])]
    groups = _groups(pairs)
    fig = _figure(max(6.0, 1.2 * len(groups) + 2), 3.2 * len(arms) + 0.6)
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    idx = {kt: j for j, kt in enumerate(groups)}
    for ax, arm in zip(axes, arms):
        g = pairs[pairs["arm"] == arm]
        for (k, t), gg in g.groupby(["kind", "target_tokens"], sort=False):
            j = idx[(k, t)]
            n = len(gg)
            offsets = [0.0] if n == 1 else [-0.25 + 0.5 * i / (n - 1) for i in range(n)]
            ax.scatter([j + o for o in offsets], gg["ratio"], s=22, zorder=3, color="C0")
            s = summ[(summ["arm"] == arm) & (summ["kind"] == k) & (summ["target_tokens"] == t)]
            if not s.empty:
                r = s.iloc[0]
                ax.hlines(r["median_ratio"], j - 0.35, j + 0.35, color="C1", lw=2, zorder=2)
                if not is_na(r["ci_low"]):
                    ax.fill_between([j - 0.35, j + 0.35], r["ci_low"], r["ci_high"], color="C1", alpha=0.2, lw=0)
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xticks(range(len(groups)), [group_label(k, t) for k, t in groups])
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylabel(f"TTFT {arm} / {a.reference}")
        ax.set_xlabel("prompt (kind, tokens)")
        _log_if_wide(ax, list(g["ratio"]) + [1.0])
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_title(f"{arm} vs {a.reference}: pairs (dots), median (line), 95% CI (band)", fontsize=10)
    fig.savefig(path)


def plot_h2d(a: an.Analysis, path: Path) -> None:
    df = a.h2d
    groups = _groups(df)
    arms = [x for x in a.arms if x in set(df["arm"])]
    fig = _figure(max(6.0, 1.2 * len(groups) + 2), 4.0)
    ax = fig.add_subplot()
    width = 0.7 / max(1, len(arms))
    idx = {kt: j for j, kt in enumerate(groups)}
    nvml_label = True
    for i, arm in enumerate(arms):
        g = df[df["arm"] == arm]
        xs = [idx[(k, t)] - 0.35 + width * (i + 0.5) for k, t in zip(g["kind"], g["target_tokens"])]
        eng = g["h2d_bytes"].astype(float) / 1e9
        if eng.notna().any():
            ax.bar(xs, eng.fillna(0.0), width=width * 0.9, label=arm)
        nv = g["nvml_bytes"].astype(float) / 1e9
        if nv.notna().any():
            ax.scatter(xs, nv, marker="x", color="black", zorder=3, label="NVML PCIe RX" if nvml_label else None)
            nvml_label = False
    ax.set_xticks(range(len(groups)), [group_label(k, t) for k, t in groups])
    ax.set_xlabel("prompt (kind, tokens)")
    ax.set_ylabel("host→device per request (GB)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    ax.set_title("H2D bytes (engine counters; NVML estimate as x)")
    fig.savefig(path)


def plot_ttft_memory(a: an.Analysis, path: Path) -> None:
    """TTFT against peak device memory, one marker per arm and prompt length (fresh prompts when there are
    any, else every kind): lower left is better; the lines join each arm's lengths."""
    df = a.ttft_memory
    fresh = df[df["kind"] == "fresh"]
    df = fresh if not fresh.empty else df
    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()
    for i, arm in enumerate(x for x in a.arms if x in set(df["arm"])):
        g = df[df["arm"] == arm].sort_values("target_tokens")
        xs, ys = g["peak_bytes"].astype(float) / 2**30, g["ttft_s"].astype(float)
        ax.plot(xs, ys, marker="o", color=f"C{i % 10}", label=arm)
        for x, y, t in zip(xs, ys, g["target_tokens"]):
            ax.annotate(group_label("", t).strip(), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    sources = sorted(set(df["peak_source"]))
    ax.set_xlabel("peak device memory per request (GiB)\n(" + " / ".join(
        {"engine": "engine's own peak", "nvml": "NVML, service processes"}[s] for s in sources) + ")")
    ax.set_ylabel("median TTFT (s)")
    _log_if_wide(ax, list(df["ttft_s"]))
    ax.grid(True, alpha=0.3)
    ax.legend(title="arm", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("TTFT against peak device memory (labels: prompt tokens)")
    fig.savefig(path)


def plot_memory(record: RunRecord, path: Path) -> None:
    """Memory over time per service, one colour per arm (or set of arms sharing a service): GPU used
    (solid) and the service's processes on the GPU (dashed); host RSS when there is no GPU sample."""
    from matplotlib.lines import Line2D

    pts = record.memory
    gpu = any(p.gpu_mem_used is not None or p.proc_gpu_mem is not None for p in pts)
    fig = _figure(8.0, 4.0)
    ax = fig.add_subplot()
    t0 = record.created_at
    arms_of = an.service_arms(record)
    labels: list[str] = []
    services: list[str] = []
    for p in sorted(pts, key=lambda p: p.t):
        if p.service not in services:
            services.append(p.service)
    for svc in services:
        label = ", ".join(arms_of.get(svc) or [svc])
        if label not in labels:
            labels.append(label)
        color = f"C{labels.index(label) % 10}"
        ps = sorted((p for p in pts if p.service == svc), key=lambda p: p.t)
        ts = [p.t - t0 for p in ps]

        def gib(vals: list[int | None]) -> list[float]:
            return [float("nan") if v is None else v / 2**30 for v in vals]

        if gpu:
            ax.plot(ts, gib([p.gpu_mem_used for p in ps]), color=color, marker=".", ms=3)
            ax.plot(ts, gib([p.proc_gpu_mem for p in ps]), color=color, ls="--")
        else:
            ax.plot(ts, gib([p.host_rss for p in ps]), color=color, marker=".", ms=3)
    handles = [Line2D([], [], color=f"C{i % 10}", label=lab) for i, lab in enumerate(labels)]
    if gpu:
        handles += [Line2D([], [], color="gray", label="GPU used (device)"),
                    Line2D([], [], color="gray", ls="--", label="service processes")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory over time" if gpu else "Host RSS of the services over time (no GPU samples)")
    ax.grid(True, alpha=0.3)
    fig.savefig(path)


def write_plots(record: RunRecord, a: an.Analysis, plots_dir: Path,
                draw: bool = True) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw every plot that has data. Returns (name -> file written, name -> why it was not drawn).
    ``draw=False`` writes and removes nothing and answers the same: the files drawing would write."""
    if draw:
        plots_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    has_memory = any(p.gpu_mem_used is not None or p.proc_gpu_mem is not None or p.host_rss is not None
                     for p in record.memory)
    jobs: dict[str, tuple[bool, str, Callable[[Path], None]]] = {
        "ttft": (not a.ttft.empty, "no measured ok sample with a TTFT", lambda p: plot_ttft(a, p)),
        "ratios": (not a.pairs.empty, "no paired samples", lambda p: plot_ratios(a, p)),
        "h2d": (not a.h2d.empty, "no engine H2D counters or NVML estimate", lambda p: plot_h2d(a, p)),
        "memory": (has_memory, "no background memory samples", lambda p: plot_memory(record, p)),
        "ttft_memory": (not a.ttft_memory.empty, "no peak device memory per request",
                        lambda p: plot_ttft_memory(a, p)),
    }
    if a.load is not None:  # a load run: latency against throughput per level
        from abbench.report.loadplot import plot_load

        cells = a.load
        jobs["load"] = (not cells.empty, "no load level ran", lambda p: plot_load(cells, a.arms, p))
    if not a.numerics_positions.empty:  # an arm judged by numerics: its per-position KL
        jobs["numerics"] = (True, "", lambda p: plot_numerics(a, p))
    if a.sweep:  # a sweep run: its ratio against the quantity
        jobs["sweep"] = (any(not p.points.empty for p in a.sweep), "no sweep point has pairs of both arms",
                         lambda p: plot_sweep(record, a, p))
    for name, (ok, why, plot) in jobs.items():
        path = plots_dir / f"{name}.png"
        if not ok:
            if draw and path.exists():
                path.unlink()
            skipped[name] = why
            continue
        if draw:
            tmp = path.with_name(f".{name}.tmp.png")
            plot(tmp)
            os.replace(tmp, path)
        written[name] = path
    return written, skipped


def _spaced_labels(xs, left: float, right: float, min_gap: float = 0.07) -> list[str]:
    """Tick labels for points on a log axis from ``left`` to ``right``: a point is labelled when it lies at least
    ``min_gap`` of the axis' width from the last labelled one (refined points bunch up near a crossover), else
    its tick stays unlabelled."""
    span = math.log(right / left)
    labels, last = [], None
    for x in sorted(xs):
        if last is None or math.log(x / last) >= min_gap * span:
            labels.append(f"{int(x)}")
            last = x
        else:
            labels.append("")
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [""] * len(xs)
    for rank, i in enumerate(order):
        out[i] = labels[rank]
    return out


def plot_sweep(record: RunRecord, a: an.Analysis, path: Path) -> None:
    """A sweep's paired TTFT ratio against the swept quantity (log x), one panel per arm pair: the pairs
    (dots), the median per point (line), its 95% interval (band), 1 (dashed) and the crossover with its interval
    (a vertical line and a shaded span; an open side reaches the panel's edge)."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    from abbench.analysis.sweep import quantity

    pairs = [p for p in a.sweep if not p.points.empty]
    fig = _figure(7.5, 3.2 * len(pairs) + 0.6)
    axes = fig.subplots(len(pairs), 1, squeeze=False)[:, 0]
    for ax, p in zip(axes, pairs):
        pts = p.points
        xs = pts["x"].astype(float).to_numpy()
        ax.scatter(p.pairs["x"].astype(float), p.pairs["ratio"].astype(float), s=16, color="C0", zorder=3,
                   label="pairs")
        ax.plot(xs, pts["median_ratio"].astype(float), color="C1", marker="o", lw=2, zorder=2, label="median")
        lo, hi = pts["ci_low"].astype(float).to_numpy(), pts["ci_high"].astype(float).to_numpy()
        ax.fill_between(xs, lo, hi, color="C1", alpha=0.2, lw=0, label="95% CI")
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log")
        left, right = xs.min() / 1.5, xs.max() * 1.5
        ax.set_xlim(left, right)
        c = p.crossover
        if c.low is not None and c.high is not None:
            ax.axvspan(max(c.low, left), min(c.high, right), color="C2", alpha=0.15, lw=0,
                       label="crossover 95% CI")
        if c.estimate is not None:
            ax.axvline(c.estimate, color="C2", lw=1.5, label=f"crossover {c.estimate:.0f}")
        _log_if_wide(ax, list(p.pairs["ratio"]) + [1.0])
        ax.set_xticks(xs, _spaced_labels(xs, left, right), fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
        if ax.get_yscale() == "log":
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(quantity(record) + " (log)")
        ax.set_ylabel(f"TTFT {p.a} / {p.b}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(c.summary, fontsize=9)
    fig.savefig(path)


def plot_numerics(a: an.Analysis, path: Path) -> None:
    """The per-position KL divergence of each numerics arm from the parity reference, as a cumulative
    distribution (log x; a KL of 0 is drawn at the axis' left end), its mean marked."""
    import numpy as np

    pos = a.numerics_positions
    fig = _figure(7.5, 3.6)
    ax = fig.subplots()
    kls = pos["kl"].astype(float)
    floor = max(float(kls[kls > 0].min()) / 2 if (kls > 0).any() else 1e-9, 1e-12)
    for i, (arm, g) in enumerate(pos.groupby("arm", sort=False)):
        xs = np.sort(np.maximum(g["kl"].astype(float).to_numpy(), floor))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", color=f"C{i}", lw=1.8, label=f"{arm} ({len(xs)} positions)")
        ax.axvline(max(float(g["kl"].mean()), floor), color=f"C{i}", ls="--", lw=1, label=f"{arm} mean")
    ax.set_xscale("log")
    ax.set_xlabel(f"KL({a.parity_reference} || arm) per position, nats (a lower bound from the top-k logprobs; log)")
    ax.set_ylabel("share of positions at or below")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Numerics: per-position KL divergence from the parity reference", fontsize=10)
    fig.savefig(path)
