"""Read an abbench Markdown report back into data, for tests that pin its figures.

Independent of abbench's own formatting code: a report is split into ``## `` sections, each section's GFM
tables are parsed into rows keyed by column header, and the "Same in every row: H: v; ..." line the report
writes above a table (a constant column moved out of it) is merged back into every row. Cells are read back
into numbers with :func:`quantity`, which also says how precise the printed figure is, so a test compares
the printed figure with its own recomputation to the precision shown.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

DASH = "—"


def sections(md: str) -> dict[str, str]:
    """``## Heading`` -> the section's text (up to the next ``## ``)."""
    out: dict[str, str] = {}
    name = None
    buf: list[str] = []
    for line in md.splitlines():
        if line.startswith("## "):
            if name is not None:
                out[name] = "\n".join(buf)
            name, buf = line[3:].strip(), []
        elif name is not None:
            buf.append(line)
    if name is not None:
        out[name] = "\n".join(buf)
    return out


def _split_row(line: str) -> list[str]:
    inner = line.strip()
    assert inner.startswith("|") and inner.endswith("|"), line
    inner = inner[1:-1]
    cells = re.split(r"(?<!\\)\|", inner)
    return [c.strip().replace("\\|", "|") for c in cells]


def _same_line(line: str) -> dict[str, str]:
    body = line.removeprefix("Same in every row: ").rstrip(".")
    out = {}
    for part in re.split(r"(?<!\\); ", body):
        key, _, value = part.partition(": ")
        out[key.strip()] = value.strip()
    return out


def tables(section: str) -> list[list[dict[str, str]]]:
    """Every table of a section, as rows (header -> cell), constant columns merged back in."""
    lines = section.splitlines()
    out: list[list[dict[str, str]]] = []
    same: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Same in every row: "):
            same = _same_line(line)
        elif line.startswith("|"):
            header = _split_row(line)
            assert re.fullmatch(r"\|(\s*-+:?\s*\|)+", lines[i + 1].replace(" ", "")), lines[i + 1]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = _split_row(lines[i])
                assert len(cells) == len(header), (header, cells)
                row = dict(same)
                for h, c in zip(header, cells):
                    assert h not in same, f"column {h} both in the table and above it"
                    row[h] = c
                rows.append(row)
                i += 1
            out.append(rows)
            same = {}
            continue
        i += 1
    return out


@dataclass(frozen=True)
class Quantity:
    value: float
    tol: float
    """Half a unit of the last printed digit, in the value's unit (seconds, bytes, ...)."""


_UNITS = {"ms": 1e-3, "s": 1.0, "B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9, "MiB": 2**20, "GiB": 2**30, "x": 1.0,
          "": 1.0}


def quantity(cell: str) -> Quantity | None:
    """'66.73 ms' -> 0.06673 s (tol 5e-6); '25.07 MB' -> bytes; '1.042x'; '3'; '—' -> None."""
    cell = cell.strip()
    if cell == DASH:
        return None
    m = re.fullmatch(r"(-?\d+(?:\.(\d+))?)\s*(ms|s|B|kB|MB|GB|MiB|GiB|x)?", cell)
    assert m, f"not a figure: {cell!r}"
    unit = m.group(3) or ""
    decimals = len(m.group(2) or "")
    scale = _UNITS[unit]
    tol = 0.5 * 10.0 ** (-decimals) * scale
    if unit == "" and decimals == 0:
        tol = 0.0  # a bare integer is printed only when the value is one
    return Quantity(float(m.group(1)) * scale, tol)


def assert_figure(cell: str, expected: float | None, what: str = "") -> None:
    """The printed ``cell`` is ``expected`` to the precision printed ('—' when expected is None)."""
    if expected is None or (isinstance(expected, float) and math.isnan(expected)):
        assert cell.strip() == DASH, f"{what}: printed {cell!r}, expected no figure"
        return
    q = quantity(cell)
    assert q is not None, f"{what}: printed {DASH}, expected {expected!r}"
    slack = q.tol * (1 + 1e-9) + 1e-12 * max(1.0, abs(expected))
    assert abs(q.value - expected) <= slack, f"{what}: printed {cell!r}, recomputed {expected!r}"
