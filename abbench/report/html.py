"""The report as one self-contained HTML file: the Markdown report's content, its plots inline, sortable tables.

Contract
--------
:func:`render_html` turns the Markdown :func:`~abbench.report.write_report` wrote (GitHub-flavoured: tables,
``<details>`` blocks) into one HTML document; :func:`write_html` reads ``reports/<run-id>.md`` and writes
``reports/<run-id>.html`` beside it. The document needs nothing else to open:

* every image the Markdown shows (``![alt](run/ttft.png)``, resolved against the Markdown's folder) is
  embedded as a ``data:`` URI; a link to one of them (the "Plots" list) becomes a link to the embedded figure;
  an image that cannot be read is named as missing, never fetched;
* a small inline stylesheet and a small inline script, no fonts, no CDN: a Content-Security-Policy in the
  page forbids any fetch but ``data:`` images, so a browser opening it offline shows all of it;
* every heading carries an ``id`` (GitHub's anchor for that heading, so ``report.html#verdict`` works as
  ``report.md#verdict`` does) and a ``#`` link to itself; the level-2 headings are listed at the top;
* the script makes every table sortable by clicking a header (again: the other direction): numbers sort as
  numbers with their units ("1.23 s" after "523.4 ms", "+5.0%", "12,345", "0.873x"), text by the reader's
  collation with digits as numbers, and an empty cell or an em dash last in both directions.

Raw HTML in the Markdown is escaped except the ``<details>`` and ``<summary>`` tags the report writes, so a
profile's text cannot put markup or a script into the page.

The page's script marks what it did, for a reader's tools and the tests: ``data-sortable`` on each table
it wired, ``data-decoded`` (and ``data-natural-width``) on each image the browser decoded, and on ``<html>``
``data-tables`` / ``data-images`` (counts) and ``data-ready``. A query ``?sort=T,C[,desc]`` clicks the header
of column C (0-based) of table T once on load (twice for desc), as a reader would; the sorted table gets
``data-sorted-by="C asc"`` or ``"C desc"``.
"""

from __future__ import annotations

import base64
import html
import os
import re
import unicodedata
from pathlib import Path

__all__ = ["github_slug", "html_path", "render_html", "write_html"]

_MIME = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
         ".gif": "image/gif", ".webp": "image/webp"}
_ALLOWED_TAG = re.compile(r"&lt;(/?)(details|summary)&gt;")
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"

CSS = """
:root { color-scheme: light dark; --fg: #1f2328; --bg: #fff; --muted: #59636e; --line: #d1d9e0; --alt: #f6f8fa;
  --pass: #1a7f37; --fail: #cf222e; --link: #0969da; }
@media (prefers-color-scheme: dark) { :root { --fg: #e6edf3; --bg: #0d1117; --muted: #9198a1; --line: #3d444d;
  --alt: #151b23; --pass: #3fb950; --fail: #f85149; --link: #4493f8; } }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1180px; padding: 24px 32px 64px; color: var(--fg); background: var(--bg);
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
a { color: var(--link); }
h1, h2, h3, h4 { line-height: 1.25; margin: 1.6em 0 .6em; }
h1 { font-size: 1.9em; margin-top: .4em; }
h2 { font-size: 1.45em; padding-bottom: .25em; border-bottom: 1px solid var(--line); }
h1 .anchor, h2 .anchor, h3 .anchor, h4 .anchor { margin-left: .35em; color: var(--muted); text-decoration: none;
  visibility: hidden; font-weight: normal; }
h1:hover .anchor, h2:hover .anchor, h3:hover .anchor, h4:hover .anchor { visibility: visible; }
code { font: .88em/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: var(--alt);
  padding: .1em .3em; border-radius: 4px; overflow-wrap: anywhere; }
pre code { display: block; padding: .8em; overflow-x: auto; }
nav.toc { margin: 1em 0; padding: .6em .9em; background: var(--alt); border-radius: 6px; font-size: .92em; }
nav.toc a { margin-right: 1em; white-space: nowrap; }
.table-wrap { overflow-x: auto; margin: .8em 0; }
table { border-collapse: collapse; font-size: .9em; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid var(--line); padding: .3em .6em; vertical-align: top; }
tbody tr:nth-child(even) { background: var(--alt); }
th { background: var(--alt); }
th[data-sort-key] { cursor: pointer; user-select: none; }
th[data-sort-key]::after { content: "\\00a0\\2195"; color: var(--muted); font-size: .8em; }
th[aria-sort="ascending"]::after { content: "\\00a0\\25B2"; color: var(--fg); }
th[aria-sort="descending"]::after { content: "\\00a0\\25BC"; color: var(--fg); }
img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; background: #fff; }
details { margin: .8em 0; }
summary { cursor: pointer; font-weight: 600; }
strong.verdict.pass { color: var(--pass); }
strong.verdict.fail { color: var(--fail); }
.missing { color: var(--fail); }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var UNITS = {"": 1, "ns": 1e-9, "\u00b5s": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1, "min": 60, "h": 3600,
    "B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 1024, "MiB": 1048576,
    "GiB": 1073741824, "TiB": 1099511627776, "x": 1, "\u00d7": 1, "%": 1, "k": 1e3, "K": 1e3,
    "GB/s": 1e9, "MB/s": 1e6, "tok/s": 1};
  var NUM = /^([+\-\u2212]?)(\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE]([+\-]?\d+))?\s*([^\s\d,;:()]*)/;
  var collator = new Intl.Collator(undefined, {numeric: true, sensitivity: "base"});

  // The sort key of a cell's text: rank 0 a number (v), 1 text (s), 2 empty or a dash (always last).
  function sortKey(text) {
    var t = text.replace(/\s+/g, " ").trim();
    if (t === "" || t === "\u2014" || t === "\u2013" || t === "-") return {rank: 2, v: 0, s: ""};
    var m = NUM.exec(t);
    var unit = m ? m[4].replace(/[.,;]+$/, "") : null;
    if (m && Object.prototype.hasOwnProperty.call(UNITS, unit)) {
      var v = parseFloat(m[2].replace(/,/g, "") + (m[3] ? "e" + m[3] : "")) * UNITS[unit];
      return {rank: 0, v: (m[1] === "-" || m[1] === "\u2212") ? -v : v, s: t};
    }
    return {rank: 1, v: 0, s: t};
  }

  function compare(a, b, dir) {
    if (a.rank !== b.rank) return a.rank - b.rank;  // numbers, then text, then dashes: in both directions
    if (a.rank === 2) return 0;
    var c = a.rank === 0 ? (a.v < b.v ? -1 : a.v > b.v ? 1 : 0) : collator.compare(a.s, b.s);
    return dir * c;
  }

  function sortTable(table, col, dir) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows).map(function (row, i) {
      var cell = row.cells[col];
      return {row: row, i: i, key: sortKey(cell ? cell.textContent : "")};
    });
    rows.sort(function (a, b) { return compare(a.key, b.key, dir) || a.i - b.i; });
    rows.forEach(function (r) { body.appendChild(r.row); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, j) {
      if (j === col) th.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    });
    table.setAttribute("data-sorted-by", col + (dir > 0 ? " asc" : " desc"));
  }

  function wire(table) {
    if (!table.tHead || !table.tBodies.length || !table.tHead.rows.length) return false;
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.setAttribute("data-sort-key", String(col));
      th.setAttribute("title", "Sort by this column (click again: the other way)");
      th.addEventListener("click", function () {
        var dir = th.getAttribute("aria-sort") === "ascending" ? -1 : 1;
        sortTable(table, col, dir);
      });
    });
    table.setAttribute("data-sortable", "1");
    return true;
  }

  var tables = document.querySelectorAll("table");
  var wired = 0;
  Array.prototype.forEach.call(tables, function (t) { if (wire(t)) wired += 1; });
  document.documentElement.setAttribute("data-tables", String(wired));

  var images = document.querySelectorAll("img");
  var decoded = 0;
  function mark(img) {
    if (img.complete && img.naturalWidth > 0 && !img.hasAttribute("data-decoded")) {
      img.setAttribute("data-decoded", "1");
      img.setAttribute("data-natural-width", String(img.naturalWidth));
      decoded += 1;
      document.documentElement.setAttribute("data-images", String(decoded));
    }
  }
  document.documentElement.setAttribute("data-images", "0");
  Array.prototype.forEach.call(images, function (img) {
    mark(img);
    img.addEventListener("load", function () { mark(img); });
  });

  var asked = /[?&]sort=(\d+),(\d+)(?:,(asc|desc))?/.exec(location.search);
  if (asked) {
    var table = tables[+asked[1]];
    var th = table && table.getAttribute("data-sortable") && table.tHead.rows[0].cells[+asked[2]];
    if (th) { th.click(); if (asked[3] === "desc") th.click(); }
  }
  document.documentElement.setAttribute("data-ready", "1");
})();
"""


def github_slug(text: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` for
    repeats (``seen`` counts them across one document)."""
    text = unicodedata.normalize("NFC", text).strip().lower()
    base = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    n = seen.get(base, 0)
    seen[base] = n + 1
    return base if n == 0 else f"{base}-{n}"


def html_path(md_path: Path) -> Path:
    """Where :func:`write_html` puts the page of ``md_path``: beside it, ``.html`` for ``.md``."""
    return Path(md_path).with_suffix(".html")


def _data_uri(path: Path) -> str | None:
    mime = _MIME.get(path.suffix.lower())
    if mime is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _is_local(src: str) -> bool:
    return bool(src) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//|^#", src)


def _figure_id(src: str) -> str:
    return "fig-" + re.sub(r"[^A-Za-z0-9_-]+", "-", src).strip("-").lower()


def _rule(method):  # type: ignore[no-untyped-def]
    """A render rule markdown-it binds to its renderer (it passes the renderer first) calling ``method``."""
    def rule(renderer, tokens, idx, options, env):  # type: ignore[no-untyped-def]
        return method(renderer, tokens, idx, options, env)
    return rule


class _Page:
    """One rendering: the parser with the report's rules, the images embedded so far and the headings."""

    def __init__(self, base_dir: Path) -> None:
        from markdown_it import MarkdownIt

        self.base_dir = base_dir
        self.md = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
        self.headings: list[tuple[int, str, str]] = []  # (level, id, text)
        self.figures: set[str] = set()  # the ids of the images shown so far
        for name in ("image", "html_block", "html_inline", "heading_close", "table_open", "table_close",
                     "link_open", "link_close", "strong_open"):
            self.md.add_render_rule(name, _rule(getattr(self, f"_{name}")))

    def render(self, text: str) -> str:
        tokens = self.md.parse(text)
        seen: dict[str, int] = {}
        self.embedded = {t.attrGet("src") for t in self._walk(tokens) if t.type == "image"}
        for i, tok in enumerate(tokens):
            if tok.type == "heading_open":
                words = tokens[i + 1].children or []
                title = "".join(c.content for c in words if c.type in ("text", "code_inline"))
                slug = github_slug(title, seen)
                tok.attrSet("id", slug)
                tokens[i + 2].meta["slug"] = slug
                self.headings.append((int(tok.tag[1]), slug, title))
        return self.md.renderer.render(tokens, self.md.options, {})

    @staticmethod
    def _walk(tokens):  # type: ignore[no-untyped-def]
        for t in tokens:
            yield t
            if t.children:
                yield from _Page._walk(t.children)

    def _image(self, renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        tok = tokens[idx]
        src = str(tok.attrGet("src") or "")
        alt = renderer.renderInlineAsText(tok.children or [], options, env)
        return self._img(src, alt)

    def _img(self, src: str, alt: str) -> str:
        uri = _data_uri(self.base_dir / src) if _is_local(src) else None
        if uri is None:
            what = f"{html.escape(alt or src)} ({html.escape(src)})"
            return f'<span class="missing">[image not embedded: {what}]</span>'
        fid = _figure_id(src)
        ident = "" if fid in self.figures else f' id="{fid}"'  # a plot shown twice: the link goes to the first
        self.figures.add(fid)
        return f'<img{ident} src="{uri}" alt="{html.escape(alt)}" title="{html.escape(src)}">'

    def _link_open(self, renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        tok = tokens[idx]
        href = str(tok.attrGet("href") or "")
        if _is_local(href) and Path(href).suffix.lower() in _MIME:
            if href in self.embedded:
                tok.attrSet("href", "#" + _figure_id(href))
            else:  # a plot only linked: shown here, since the page carries no folder beside it
                close = next(j for j in range(idx, len(tokens)) if tokens[j].type == "link_close")
                tokens[close].meta["after"] = self._img(href, href)
                tok.attrSet("href", "#" + _figure_id(href))
        return renderer.renderToken(tokens, idx, options, env)

    @staticmethod
    def _link_close(renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        after = tokens[idx].meta.get("after")
        return "</a>" + (f"<br>{after}" if after else "")

    def _strong_open(self, renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        nxt = tokens[idx + 1] if idx + 1 < len(tokens) else None
        if nxt is not None and nxt.type == "text" and nxt.content.startswith("Gate: "):
            tokens[idx].attrSet("class", "verdict " + ("pass" if nxt.content == "Gate: PASS" else "fail"))
        return renderer.renderToken(tokens, idx, options, env)

    @staticmethod
    def _html_block(renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        return _ALLOWED_TAG.sub(r"<\1\2>", html.escape(tokens[idx].content, quote=False))

    _html_inline = _html_block

    def _heading_close(self, renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        slug = tokens[idx].meta.get("slug")
        link = (f'<a class="anchor" href="#{html.escape(slug)}" aria-label="Link to this section">#</a>'
                if slug else "")
        return f"{link}</{tokens[idx].tag}>\n"

    @staticmethod
    def _table_open(renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        return '<div class="table-wrap">' + renderer.renderToken(tokens, idx, options, env)

    @staticmethod
    def _table_close(renderer, tokens, idx, options, env) -> str:  # type: ignore[no-untyped-def]
        return renderer.renderToken(tokens, idx, options, env) + "</div>\n"


def render_html(markdown: str, base_dir: Path, title: str | None = None) -> str:
    """The HTML page of the Markdown ``markdown``, whose relative image paths are under ``base_dir``.
    ``title``: the page's title; default the first heading's text."""
    page = _Page(Path(base_dir))
    body = page.render(markdown)
    if title is None:
        title = page.headings[0][2] if page.headings else "abbench report"
    sections = [(slug, text) for level, slug, text in page.headings if level == 2]
    if sections:
        nav = ('<nav class="toc" aria-label="Sections">'
               + " ".join(f'<a href="#{html.escape(s)}">{html.escape(t)}</a>' for s, t in sections) + "</nav>\n")
        at = body.find("<h2")
        body = body[:at] + nav + body[at:]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n{body}</main>\n"
            f"<script>{SCRIPT}</script>\n</body>\n</html>\n")


def write_html(md_path: Path, out_html: Path | None = None) -> Path:
    """Write the page of the Markdown report ``md_path`` (its images resolved against its folder) to
    ``out_html`` (default :func:`html_path`), atomically; returns the path written."""
    md_path = Path(md_path)
    out = Path(out_html) if out_html is not None else html_path(md_path)
    text = render_html(md_path.read_text(encoding="utf-8"), md_path.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out
