"""The report as one HTML file (abbench/report/html.py), read back as written and as a real browser shows it.

The committed run ``results/readme-cpu-tiny`` is rendered through the CLI (``abbench report RUN --out DIR``, in
this process), once with the page and once with ``--no-html``. Without a browser: the Markdown and the PNGs are
the same bytes either way; the page holds every ``## `` section of the Markdown with GitHub's anchor, every plot
as a ``data:`` URI of exactly the PNG beside the Markdown, every table, and nothing that names another
file or host. With Debian's Chromium (headless, its network pointed at a closed port, a fresh profile): the
page's script ran (``data-ready``), made every table sortable, every image decoded (naturalWidth > 0), and a
``?sort=`` query clicks a header as a reader would: the TTFT table's rows come back in the order of their
medians (read with tests/support/mdtables.py, not the page's code), and a page of mixed units, signs,
thousands separators and dashes sorts numerically both ways with the dashes last. Without Chromium
(``chromium`` on PATH, or ``ABBENCH_CHROMIUM``) the browser tests skip and say so; .ci/run installs it.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from abbench.report.html import github_slug, render_html
from tests.support import cli
from tests.support import mdtables as mt

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "results" / "readme-cpu-tiny"


class Page(HTMLParser):
    """What a test reads from an HTML document: headings (level, id, text), images (attrs), tables (a list of
    rows, each the cells' text; the header row first), the <html> element's attributes, every tag's attrs."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.headings: list[tuple[int, str, str]] = []
        self.images: list[dict[str, str]] = []
        self.tables: list[dict] = []
        self.root: dict[str, str] = {}
        self.tags: list[tuple[str, dict[str, str]]] = []
        self._heading: list | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "html":
            self.root = a
        elif re.fullmatch(r"h[1-6]", tag):
            self._heading = [int(tag[1]), a.get("id", ""), ""]
        elif tag == "img":
            self.images.append(a)
        elif tag == "table":
            self.tables.append({"attrs": a, "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if re.fullmatch(r"h[1-6]", tag) and self._heading is not None:
            self._heading[2] = self._heading[2].strip().removesuffix("#").strip()
            self.headings.append(tuple(self._heading))  # type: ignore[arg-type]
            self._heading = None
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1]["rows"][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading[2] += data
        if self._cell is not None:
            self._cell.append(data)


def chromium() -> str | None:
    return os.environ.get("ABBENCH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(page: Path, query: str, tmp: Path) -> Page:
    """The DOM of ``page`` after its scripts ran, in headless Chromium with no network (a proxy on a closed
    port, every host name unresolvable) and a fresh profile."""
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install -y chromium, or set ABBENCH_CHROMIUM): the "
                    "page is checked without a browser only")
    profile = tmp / f"chromium-profile-{len(list(tmp.glob('chromium-profile-*')))}"
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage",
            "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}",
            "--dump-dom", page.resolve().as_uri() + query]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "<html" in res.stdout, \
        f"chromium failed ({res.returncode}): {res.stderr[-2000:]}"
    return Page(res.stdout)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The committed run's report written twice through the CLI: with the page (default) and --no-html."""
    if not (RUN / "run.json").is_file():
        pytest.skip("the committed run results/readme-cpu-tiny is not in this checkout")
    out = {}
    for name, extra in (("html", []), ("plain", ["--no-html"])):
        d = tmp_path_factory.mktemp(name)
        res = cli.abbench("report", str(RUN), "--out", str(d), *extra, cwd=REPO)
        assert res.returncode == 0, res.stderr
        out[name] = d
    return out


def test_the_page_is_written_beside_the_markdown_and_changes_nothing_else(rendered) -> None:
    with_html, plain = rendered["html"], rendered["plain"]
    assert (with_html / "readme-cpu-tiny.html").is_file()
    assert not (plain / "readme-cpu-tiny.html").exists()
    files = sorted(p.relative_to(plain).as_posix() for p in plain.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(with_html).as_posix() for p in with_html.rglob("*")
                           if p.is_file() and p.suffix != ".html")
    for f in files:
        assert (with_html / f).read_bytes() == (plain / f).read_bytes(), f"{f} differs with the page written"


def test_the_page_holds_every_section_plot_and_table_of_the_markdown(rendered) -> None:
    d = rendered["html"]
    md = (d / "readme-cpu-tiny.md").read_text()
    page = Page((d / "readme-cpu-tiny.html").read_text())
    wanted = list(mt.sections(md))
    assert len(wanted) >= 10 and "Verdict" in wanted
    got = [(i, text) for level, i, text in page.headings if level == 2]
    assert [t for _, t in got] == wanted
    assert [i for i, _ in got] == [github_slug(t, {}) for t in wanted]  # 'Paired ratios' -> #paired-ratios
    assert page.headings[0][:1] == (1,) and page.headings[0][2] == "abbench report: readme-cpu-tiny"
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(shown) == 4 and len(page.images) == len(shown)
    for img, src in zip(page.images, shown):
        prefix = "data:image/png;base64,"
        assert img["src"].startswith(prefix), img["src"][:40]
        assert base64.b64decode(img["src"][len(prefix):]) == (d / src).read_bytes(), src
    assert len(page.tables) == sum(1 for line in md.splitlines() if re.fullmatch(r"\|(-+:?\|)+", line))
    assert "Gate: PASS" in (d / "readme-cpu-tiny.html").read_text()


def test_the_page_fetches_nothing(rendered) -> None:
    text = (rendered["html"] / "readme-cpu-tiny.html").read_text()
    page = Page(text)
    for tag, attrs in page.tags:
        assert tag not in ("link", "iframe", "object", "embed"), tag
        for key in ("src", "href", "srcset", "action", "data"):
            v = attrs.get(key)
            assert v is None or v.startswith(("data:image/", "#")), f"<{tag} {key}={v[:60]!r}>"
    csp = next(a["content"] for t, a in page.tags
               if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in csp and "img-src data:" in csp
    assert "url(" not in text and "@import" not in text and "@font-face" not in text


def test_raw_html_is_escaped_but_the_reports_details_blocks_stay(tmp_path: Path) -> None:
    md = ("# t\n\n<script>alert(1)</script>\n\ntext <img src=x onerror=alert(2)> and <b>b</b>\n\n"
          "<details><summary>More <i>x</i></summary>\n\n- inside\n\n</details>\n\n![gone](nowhere.png)\n")
    out = render_html(md, tmp_path)
    body = out.split("<main>", 1)[1].split("</main>", 1)[0]
    assert "<script" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "<img src=x" not in body and "<b>" not in body and "<i>" not in body
    assert "<details><summary>More &lt;i&gt;x&lt;/i&gt;</summary>" in body and "</details>" in body
    assert "<img" not in body and "image not embedded: gone (nowhere.png)" in body


def test_in_chromium_every_table_is_sortable_and_every_image_decoded(rendered, tmp_path: Path) -> None:
    d = rendered["html"]
    static = Page((d / "readme-cpu-tiny.html").read_text())
    live = dump_dom(d / "readme-cpu-tiny.html", "", tmp_path)
    assert live.root.get("data-ready") == "1", "the page's script did not run to its end"
    assert [h[:2] for h in live.headings] == [h[:2] for h in static.headings]
    assert len(live.tables) == len(static.tables) >= 10
    assert live.root["data-tables"] == str(len(static.tables))
    assert all(t["attrs"].get("data-sortable") == "1" for t in live.tables)
    assert len(live.images) == len(static.images) == 4 and live.root["data-images"] == "4"
    for img in live.images:
        assert img.get("data-decoded") == "1" and int(img["data-natural-width"]) > 0, img.get("title")


def test_in_chromium_a_click_sorts_the_ttft_table_by_its_medians(rendered, tmp_path: Path) -> None:
    d = rendered["html"]
    md = (d / "readme-cpu-tiny.md").read_text()
    (rows,) = mt.tables(mt.sections(md)["TTFT per arm and prompt length"])
    static = Page((d / "readme-cpu-tiny.html").read_text())
    t = next(i for i, tab in enumerate(static.tables) if tab["rows"][0][:3] == ["Arm", "Kind", "Prompt tokens"])
    col = static.tables[t]["rows"][0].index("Median")
    for direction, sign in (("", 1), (",desc", -1)):
        live = dump_dom(d / "readme-cpu-tiny.html", f"?sort={t},{col}{direction}", tmp_path)
        table = live.tables[t]
        assert table["attrs"].get("data-sorted-by") == f"{col} {'asc' if sign > 0 else 'desc'}"
        got = [r[col] for r in table["rows"][1:]]
        order = sorted(range(len(rows)), key=lambda i: (sign * mt.quantity(rows[i]["Median"]).value, i))
        assert got == [rows[i]["Median"] for i in order]
        if sign > 0:
            assert got != sorted(got)  # as text "100.2 ms" < "29.65 ms": a numeric sort differs
        assert sorted(map(tuple, table["rows"][1:])) == sorted(map(tuple, static.tables[t]["rows"][1:]))


MIXED = """# mixed

| Name | Time | Change | Count |
|---|---:|---:|---:|
| chunk 10 | 1.23 s | +5.0% | 12,345 |
| chunk 9 | — | -1.5% | 999 |
| a | 523.4 ms | — | 1,000,000 |
| B | 12,345 ms | 12% | — |
| c | -2 ms | +0.5% | 7 |
"""


@pytest.mark.parametrize(("col", "asc"), [
    (0, ["a", "B", "c", "chunk 9", "chunk 10"]),
    (1, ["-2 ms", "523.4 ms", "1.23 s", "12,345 ms", "—"]),
    (2, ["-1.5%", "+0.5%", "+5.0%", "12%", "—"]),
    (3, ["7", "999", "12,345", "1,000,000", "—"]),
])
def test_in_chromium_the_sort_reads_units_signs_and_separators_and_puts_dashes_last(
        tmp_path: Path, col: int, asc: list[str]) -> None:
    page = tmp_path / "mixed.html"
    page.write_text(render_html(MIXED, tmp_path), encoding="utf-8")
    dashes = [v for v in asc if v == "—"]
    desc = [v for v in reversed(asc) if v != "—"] + dashes
    for direction, want in (("", asc), (",desc", desc)):
        live = dump_dom(page, f"?sort=0,{col}{direction}", tmp_path)
        assert [r[col] for r in live.tables[0]["rows"][1:]] == want, direction or "asc"
