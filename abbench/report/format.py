"""Formatting for the report: numbers for humans, and GitHub-flavoured Markdown tables.

Tables follow llama.cpp's compare-llama-bench: a descriptive column whose value is the same in every row
is dropped and stated once above the table; measured values are always shown. Numbers are formatted for
humans: times in ms (s above 10 s), transfers in GB (10^9 bytes, like GB/s), memory in GiB, ratios as
``0.52x``; a missing value is a dash.
"""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd

MAX_LISTED = 40
"""Longest list of failures/missing steps written out in full; the rest is counted."""
DASH = "—"


def is_na(v: Any) -> bool:
    if v is None or v is pd.NA:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def fmt_s(v: Any) -> str:
    """Seconds for humans: '0.42 ms', '12.3 ms', '523.4 ms', '1234 ms', '12.35 s'."""
    if is_na(v):
        return DASH
    x = float(v)
    ms = x * 1e3
    if abs(x) >= 10:
        return f"{x:.2f} s"
    if abs(ms) >= 1000:
        return f"{ms:.0f} ms"
    if abs(ms) >= 100:
        return f"{ms:.1f} ms"
    if abs(ms) >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def fmt_gb(v: Any) -> str:
    """Bytes as decimal GB (transfers, like GB/s); MB/kB below 1 GB."""
    if is_na(v):
        return DASH
    x = float(v)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_gib(v: Any) -> str:
    """Bytes as binary GiB (memory); MiB below 1 GiB."""
    if is_na(v):
        return DASH
    x = float(v)
    if abs(x) >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    return f"{x / 2**20:.1f} MiB"


def fmt_ratio(v: Any) -> str:
    return DASH if is_na(v) else f"{float(v):.3f}x"


def fmt_pct(v: Any, digits: int = 0) -> str:
    """A share (0.42) as a percentage ('42%')."""
    return DASH if is_na(v) else f"{100 * float(v):.{digits}f}%"


def fmt_num(v: Any, digits: int = 2) -> str:
    if is_na(v):
        return DASH
    x = float(v)
    return f"{int(x)}" if x == int(x) and abs(x) < 1e15 else f"{x:.{digits}f}"


def fmt_int(v: Any) -> str:
    return DASH if is_na(v) else str(int(v))


def fmt_text(v: Any) -> str:
    return DASH if is_na(v) or v == "" else str(v)


def fmt_bool(v: Any) -> str:
    return DASH if is_na(v) else ("yes" if v else "no")


def fmt_counts(d: Any) -> str:
    if not isinstance(d, dict) or not d:
        return DASH
    return ", ".join(f"{k} ×{n}" for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    text = text.replace("`", "'")
    return f"`{text}`"


@dataclass(frozen=True)
class Col:
    """One table column: the frame's key, its header, a formatter, whether it is descriptive (dropped when
    constant across rows) and right-aligned."""

    key: str
    header: str
    fmt: Callable[[Any], str] = fmt_text
    descriptive: bool = False
    right: bool = True


def table(df: pd.DataFrame, cols: list[Col], *, drop_constant: bool = True) -> str:
    """A GFM table. With more than one row, descriptive columns that hold one value are dropped and
    stated once above the table (compare-llama-bench style)."""
    if df.empty:
        return "_No rows._"
    cells = {c.key: [c.fmt(v) for v in df[c.key]] if c.key in df else [DASH] * len(df) for c in cols}
    shown, constant = [], []
    for c in cols:
        if drop_constant and c.descriptive and len(df) > 1 and len(set(cells[c.key])) == 1:
            constant.append(f"{c.header}: {cells[c.key][0]}")
        else:
            shown.append(c)
    lines = []
    if constant:
        lines += ["Same in every row: " + "; ".join(cell(x) for x in constant) + ".", ""]
    lines.append("| " + " | ".join(cell(c.header) for c in shown) + " |")
    lines.append("|" + "|".join("---:" if c.right else "---" for c in shown) + "|")
    for i in range(len(df)):
        lines.append("| " + " | ".join(cell(cells[c.key][i]) for c in shown) + " |")
    return "\n".join(lines)


def bullets(items: Iterable[str], limit: int = MAX_LISTED) -> str:
    items = list(items)
    out = [f"- {x}" for x in items[:limit]]
    if len(items) > limit:
        out.append(f"- ... and {len(items) - limit} more")
    return "\n".join(out)


def when(t: float | None) -> str:
    if t is None:
        return DASH
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def command_of(env: dict[str, Any]) -> str | None:
    for key in ("command", "argv", "cli", "cmdline"):
        v = env.get(key)
        if isinstance(v, list) and v:
            return shlex.join(str(x) for x in v)
        if isinstance(v, str) and v:
            return v
    return None


def env_value(v: Any, limit: int = 160) -> str:
    if isinstance(v, list):
        text = shlex.join(str(x) for x in v) if all(isinstance(x, str) for x in v) else ", ".join(map(str, v))
    else:
        text = str(v)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return code(text)


def group_label(kind: Any, tokens: Any) -> str:
    return f"{kind} {fmt_int(tokens)}"
