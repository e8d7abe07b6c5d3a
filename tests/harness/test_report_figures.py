"""Every figure of the report, recomputed here from the run's own files.

The committed runs ``results/readme-cpu-tiny`` (separate services, three streamed arms, CPU),
``results/20261129b-h200-qwen3-30b-a3b`` (one shared service, a resident arm, NVML, a compute-bound floor)
and ``tests/support/fixtures/cpu-tiny-3-rounds`` (``abbench run --rounds 3 --lengths 384``: three samples per cell,
so a mean is not a median and the bootstrap interval is not just the two values) are rendered through the CLI (``python -m abbench report RUN --out DIR``); the Markdown is parsed back by
column header (tests/support/mdtables.py) and each cell is compared, to the precision printed, with a value this
file computes from ``requests.jsonl`` and ``run.json`` with pandas/numpy/scipy alone: nothing from
abbench's analysis or report code is called. A wrong median, a swapped column, an interval printed low-low,
"faster" for a slower arm or a section that stops rendering makes one of these fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.support import cli
from tests.support import mdtables as mt

REPO = Path(__file__).resolve().parents[2]
RUNS = ["readme-cpu-tiny", "20261129b-h200-qwen3-30b-a3b", "readme-cpu-tiny+skewed-counters", "cpu-tiny-3-rounds"]
FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures"  # cpu-tiny-3-rounds: n = 3 per cell (mean != median)
FLOOR_KINDS = ("fresh", "cold")  # prompts that start from an empty cache
SEED, RESAMPLES = 0, 4000  # the bootstrap the report says it used (checked against its text below)


# ------------------------------------------------------------------------------ the run, read raw


class Run:
    """A run directory read with json and pandas only."""

    def __init__(self, run_dir: Path) -> None:
        self.raw = json.loads((run_dir / "run.json").read_text())
        lines = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines() if x.strip()]
        # the durable copy and run.json agree (the report reads either)
        assert [x["step"] for x in lines] == [s["step"] for s in self.raw["samples"]]
        self.samples = lines
        prof = self.raw["profile"]
        self.profile = prof
        self.arms = [a["name"] for a in prof["arms"]]
        self.reference = (prof.get("run") or {}).get("reference") or self.arms[0]
        self.expect = {a["name"]: a.get("expect_path") for a in prof["arms"]}
        self.k = int((prof.get("gate") or {}).get("parity_tokens") or 8)
        self.allow_fallback = set((prof.get("gate") or {}).get("allow_fallback") or [])
        targets = {p["id"]: p["target_tokens"] for p in self.raw["prompts"]}
        last: dict[int, dict] = {}
        for s in lines:
            if s["ok"] and not s["excluded"]:
                last[s["step"]] = s  # one per planned step: the last ok one
        rows = []
        for s in sorted(last.values(), key=lambda s: s["step"]):
            e = s.get("engine") or {}
            t = e.get("timings") or {}
            tel = s.get("telemetry") or {}

            def delta(name: str) -> float | None:
                before, after = tel.get("metrics_before"), tel.get("metrics_after")
                if not after or name not in after:
                    return None
                return after[name] - (before or {}).get(name, 0.0)

            rows.append({
                "step": s["step"], "arm": s["arm"], "kind": s["kind"], "tokens": targets[s["prompt_id"]],
                "prompt": s["prompt_id"], "round": s["round"], "position": s["position"], "ttft": s["ttft_s"],
                "tok_s": (s["completion_tokens"] - 1) / (s["total_s"] - s["ttft_s"]),
                "ids": s["output_ids"], "ids_source": s["ids_source"],
                "h2d": e.get("h2d_bytes"), "prefill": e.get("prefill_h2d_bytes"),
                "decode": e.get("decode_h2d_bytes"), "bank": e.get("bank_bytes"), "windows": e.get("n_windows"),
                "gbps": e.get("measured_h2d_gbps"), "nvml": tel.get("nvml_pcie_rx_bytes"),
                "path": e.get("prefill_path"), "fallback": e.get("fallback_reason"), "n_chunks": e.get("n_chunks"),
                "server_prompt": e.get("engine_prompt_tokens", s["prompt_tokens"]),
                "cached": e.get("cached_prompt_tokens"),
                "m_prompt": delta("abbench_engine_prompt_tokens_total"),
                "m_cached": delta("abbench_engine_cached_prompt_tokens_total"),
                "overhead": s["ttft_s"] - (t["first_token"] - t.get("received", 0.0)),
                "after_write": s["ttft_s"] - t["first_event"], "queue": e.get("queue_wait_s"),
            })
        self.ok = pd.DataFrame(rows)
        self.planned = [st for st in self.raw["plan"] if not st["excluded"]]


def med(values: Any) -> float | None:
    v = pd.Series(values, dtype=float).dropna()
    return float(np.median(v)) if len(v) else None


def bootstrap_ci(xs: list[float]) -> tuple[float, float]:
    from scipy import stats

    kw: dict[str, Any] = {}
    import inspect
    if "rng" in inspect.signature(stats.bootstrap).parameters:
        kw["rng"] = np.random.default_rng(SEED)
    else:
        kw["random_state"] = np.random.default_rng(SEED)
    res = stats.bootstrap((np.asarray(xs, dtype=float),), np.median, n_resamples=RESAMPLES, confidence_level=0.95,
                          method="percentile", vectorized=True, axis=-1, **kw)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


# ----------------------------------------------------------------------------- the rendered report


def _skew(sample: dict) -> dict:
    """Counters that differ column from column (in the real runs the response's and /metrics' cached counts
    are equal, so a column showing the other's numbers would pass): the server counts a BOS, /metrics
    counts 2 more prompt tokens and 1-3 more cached ones, varying by step; and each request's RSS peak is
    64 MiB above the background sampler's, so the memory table must take the per-request peaks."""
    e, t = sample.get("engine"), sample.get("telemetry") or {}
    if e is not None and sample.get("prompt_tokens") is not None:
        e["engine_prompt_tokens"] = sample["prompt_tokens"] + 1
    if t.get("host_rss_peak"):  # a request's own peak above every background point: it must count
        t["host_rss_peak"] += 64 * 2**20 + sample["step"]
    after = t.get("metrics_after")
    if after:
        after["abbench_engine_prompt_tokens_total"] += 2
        after["abbench_engine_cached_prompt_tokens_total"] += 1 + sample["step"] % 3
    return sample


def _variant(name: str, tmp: Path) -> Path:
    """``results/<run>``, or for ``<run>+skewed-counters`` a copy with :func:`_skew` applied to every sample
    of both files."""
    base, _, variant = name.partition("+")
    src = REPO / "results" / base if (REPO / "results" / base).is_dir() else FIXTURES / base
    if not variant:
        return src
    dst = tmp / base
    dst.mkdir()
    raw = json.loads((src / "run.json").read_text())
    raw["samples"] = [_skew(s) for s in raw["samples"]]
    (dst / "run.json").write_text(json.dumps(raw))
    lines = [json.dumps(_skew(json.loads(x))) for x in (src / "requests.jsonl").read_text().splitlines() if x.strip()]
    (dst / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return dst


@pytest.fixture(scope="module", params=RUNS)
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, str]]:
    run_dir = _variant(request.param, tmp_path_factory.mktemp("run"))
    out = tmp_path_factory.mktemp("reports")
    res = cli.abbench("report", str(run_dir), "--out", str(out), cwd=REPO)
    assert res.returncode == 0, res.stderr
    md = (out / f"{run_dir.name}.md").read_text()
    return Run(run_dir), mt.sections(md)


def by_key(rows: list[dict[str, str]], *cols: str) -> dict[tuple, dict[str, str]]:
    out = {}
    for r in rows:
        key = tuple(int(r[c]) if c == "Prompt tokens" else r[c] for c in cols)
        assert key not in out, f"row {key} twice"
        out[key] = r
    return out


def groups(df: pd.DataFrame, *cols: str) -> dict[tuple, pd.DataFrame]:
    return {k if isinstance(k, tuple) else (k,): g for k, g in df.groupby(list(cols), sort=False)}


def test_every_section_renders(rendered) -> None:
    run, sec = rendered
    expected = ["Verdict", "TTFT per arm and prompt length", "Paired ratios", "Host-to-device transfers",
                "Distance to the floor", "Engine counters", "Memory", "Parity", "Active path", "Client overhead",
                "Environment"]
    missing = [s for s in expected if s not in sec]
    assert not missing, f"sections not rendered: {missing}"
    assert list(sec).index("Distance to the floor") > list(sec).index("Host-to-device transfers")


def test_ttft_table(rendered) -> None:
    run, sec = rendered
    (rows,) = mt.tables(sec["TTFT per arm and prompt length"])
    got = by_key(rows, "Arm", "Kind", "Prompt tokens")
    want = groups(run.ok, "arm", "kind", "tokens")
    assert set(got) == set(want)
    for key, g in want.items():
        r = got[key]
        assert int(r["n"]) == len(g), key
        mt.assert_figure(r["Median"], float(np.median(g["ttft"])), f"{key} median")
        mt.assert_figure(r["Min"], float(g["ttft"].min()), f"{key} min")
        mt.assert_figure(r["Max"], float(g["ttft"].max()), f"{key} max")
        mt.assert_figure(r["Decode tok/s"], med(g["tok_s"]), f"{key} decode tok/s")


def _pairs(run: Run) -> pd.DataFrame:
    ok = run.ok
    ref = ok[ok["arm"] == run.reference].set_index(["prompt", "round"])
    rows = []
    for s in ok[ok["arm"] != run.reference].itertuples():
        r = ref.loc[(s.prompt, s.round)]
        rows.append({"arm": s.arm, "kind": s.kind, "tokens": s.tokens, "prompt": s.prompt, "round": s.round,
                     "pos": s.position, "ref_pos": r["position"], "ttft": s.ttft, "ref_ttft": r["ttft"],
                     "ratio": s.ttft / r["ttft"]})
    return pd.DataFrame(rows)


def test_paired_ratios_intervals_and_verdict_words(rendered) -> None:
    run, sec = rendered
    text = sec["Paired ratios"]
    assert f"TTFT(arm) / TTFT({run.reference})" in text and f"seed {SEED}, {RESAMPLES} resamples" in text
    summary, every = mt.tables(text)
    pairs = _pairs(run)

    got = by_key(every, "Arm", "Prompt", "Round")
    assert set(got) == {(p.arm, p.prompt, str(p.round)) for p in pairs.itertuples()}
    for p in pairs.itertuples():
        r = got[(p.arm, p.prompt, str(p.round))]
        assert int(r["Arm position"]) == p.pos and int(r["Ref position"]) == p.ref_pos, (p, r)
        mt.assert_figure(r["Arm TTFT"], p.ttft, f"{p} arm TTFT")
        mt.assert_figure(r["Ref TTFT"], p.ref_ttft, f"{p} ref TTFT")
        mt.assert_figure(r["Ratio"], p.ratio, f"{p} ratio")

    got = by_key(summary, "Arm", "Kind", "Prompt tokens")
    want = groups(pairs, "arm", "kind", "tokens")
    assert set(got) == set(want)
    words_seen = set()
    for key, g in want.items():
        r = got[key]
        assert r["vs"] == run.reference and int(r["Pairs"]) == len(g)
        ratios = sorted(g["ratio"])
        median = float(np.median(ratios))
        mt.assert_figure(r["Median ratio"], median, f"{key} median ratio")
        low, high = bootstrap_ci(ratios)
        if len(ratios) == 2:  # the percentile interval of a 2-sample median spans the two values
            assert (low, high) == pytest.approx((ratios[0], ratios[1]), rel=1e-12)  # percentile's arithmetic
        lo_cell, hi_cell = (c.strip() for c in r["95% CI"].split("–"))
        mt.assert_figure(lo_cell, low, f"{key} CI low")
        mt.assert_figure(hi_cell, high, f"{key} CI high")
        words = r["Verdict"]
        if high < 1.0:
            m = re.fullmatch(r"(\d+\.\d\d)x faster", words)
            assert m, (key, words)
            mt.assert_figure(m.group(1), 1 / median, f"{key} times faster")
            assert float(m.group(1)) > 1
        elif low > 1.0:
            m = re.fullmatch(r"(\d+\.\d\d)x slower", words)
            assert m, (key, words)
            mt.assert_figure(m.group(1), median, f"{key} times slower")
            assert float(m.group(1)) > 1
        else:
            assert words == "not significant", (key, words)
        words_seen.add(words.split()[-1])
        if len(g) < 3:
            assert r["Note"] == f"n={len(g)}: too few pairs for a reliable interval"
    if run.raw["run_id"] == "20261129b-h200-qwen3-30b-a3b":  # this run has all three verdicts
        assert words_seen == {"faster", "slower", "significant"}


def test_h2d_table(rendered) -> None:
    run, sec = rendered
    text = sec["Host-to-device transfers"]
    (rows,) = mt.tables(text)
    got = by_key(rows, "Arm", "Kind", "Prompt tokens")
    want = groups(run.ok, "arm", "kind", "tokens")
    assert set(got) == set(want)
    for key, g in want.items():
        r = got[key]
        kind = key[1]
        assert int(r["n"]) == len(g)
        mt.assert_figure(r["Engine H2D"], med(g["h2d"]), f"{key} engine H2D")
        mt.assert_figure(r["Prefill"], med(g["prefill"]), f"{key} prefill H2D")
        mt.assert_figure(r["Decode"], med(g["decode"]), f"{key} decode H2D")
        mt.assert_figure(r["Bank"], med(g["bank"]), f"{key} bank")
        mt.assert_figure(r["Banks"], med(g["prefill"] / g["bank"]), f"{key} banks")
        nvml = g["nvml"].astype(float)
        mt.assert_figure(r["NVML PCIe RX"], med(nvml), f"{key} NVML")
        mt.assert_figure(r["Engine/NVML"], med((g["h2d"] / nvml.where(nvml > 0)).dropna()), f"{key} engine/NVML")
        mt.assert_figure(r["Windows"], med(g["windows"]), f"{key} windows")
        mt.assert_figure(r["H2D GB/s"], med(g["gbps"]), f"{key} GB/s")
        # one bank per window (a one-pass path has no windows: one bank); none where the probes disagree
        floor = (med(g["bank"] * g["windows"].clip(lower=1) / (g["gbps"] * 1e9))
                 if kind in FLOOR_KINDS and not _probes_disagree(run) else None)
        mt.assert_figure(r["Floor"], floor, f"{key} floor")
        ttft = float(np.median(g["ttft"]))
        mt.assert_figure(r["TTFT"], ttft, f"{key} TTFT")
        mt.assert_figure(r["TTFT/floor"], ttft / floor if floor else None, f"{key} TTFT/floor")
    if run.ok["nvml"].isna().all():
        assert "NVML gave no PCIe RX estimate" in text
    assert ("No copy floor: the services' H2D bandwidth probes disagree" in text) == _probes_disagree(run)
    # the bank accounting the README states: chunked copies a bank per chunk, layer-major one per window
    for (arm, kind, tokens), r in got.items():
        if arm == "layer-major" and kind in FLOOR_KINDS:
            assert r["Banks"] == "1"


def _probes_disagree(run: Run) -> bool:
    """The services' measured H2D bandwidths more than 3x apart (every CPU run here; no GPU run): no copy
    floor is given."""
    g = run.ok["gbps"].astype(float)
    g = g[g > 0]
    return bool(len(g)) and float(g.max()) > 3 * float(g.min())


def test_distance_to_the_floor(rendered) -> None:
    run, sec = rendered
    resident = [a for a, p in run.expect.items() if p == "resident"]
    if _probes_disagree(run) and not resident:  # no copy floor, no compute floor: the section says so
        assert not mt.tables(sec["Distance to the floor"]) and "No resident arm sets a compute floor" in (
            sec["Distance to the floor"]) and "No copy floor" in sec["Distance to the floor"]
        return
    (rows,) = mt.tables(sec["Distance to the floor"])
    got = by_key(rows, "Arm", "Kind", "Prompt tokens")
    fresh = run.ok[run.ok["kind"].isin(FLOOR_KINDS)]
    assert set(got) == {(a, k, t) for (a, k, t) in groups(fresh, "arm", "kind", "tokens")}
    bounds = set()
    for (kind, tokens), g in groups(fresh, "kind", "tokens").items():
        copy = med(g["bank"] / (g["gbps"] * 1e9))  # one bank over the measured bandwidth
        assert not _probes_disagree(run)  # (else: copy = None, and a resident arm sets the floor)
        compute = med(g[g["arm"].isin(resident)]["ttft"]) if resident else None
        floor = max(v for v in (copy, compute) if v is not None)
        bound = "copy" if floor == copy else "compute"
        bounds.add(bound)
        for arm, ga in g.groupby("arm"):
            r = got[(arm, kind, tokens)]
            what = f"{arm} {kind} {tokens}"
            ttft = float(np.median(ga["ttft"]))
            assert int(r["n"]) == len(ga)
            mt.assert_figure(r["TTFT"], ttft, f"{what} TTFT")
            mt.assert_figure(r["Compute floor"], compute, f"{what} compute floor")
            mt.assert_figure(r["Copy floor"], copy, f"{what} copy floor")
            mt.assert_figure(r["Floor"], floor, f"{what} floor")
            assert r["Bound by"] == bound, what
            mt.assert_figure(r["x floor"], ttft / floor, f"{what} x floor")
    if resident:  # the H200 run: 32K is compute-bound, the others copy-bound
        assert bounds == {"copy", "compute"}


def test_engine_counters(rendered) -> None:
    run, sec = rendered
    (rows,) = mt.tables(sec["Engine counters"])
    got = by_key(rows, "Arm", "Kind", "Prompt tokens")
    want = groups(run.ok, "arm", "kind", "tokens")
    assert set(got) == set(want)
    for key, g in want.items():
        r = got[key]
        assert int(r["n"]) == len(g)
        mt.assert_figure(r["Server prompt tokens"], med(g["server_prompt"]), f"{key} server prompt tokens")
        mt.assert_figure(r["Cached (response)"], med(g["cached"]), f"{key} cached (response)")
        mt.assert_figure(r["Prompt tokens (/metrics)"], med(g["m_prompt"]), f"{key} prompt tokens (/metrics)")
        mt.assert_figure(r["Cached (/metrics)"], med(g["m_cached"]), f"{key} cached (/metrics)")
        if key[1] == "continuation":  # the cache served the cold prompt's tokens: the columns must differ
            assert r["Cached (response)"] != "0" and r["Cached (response)"] != r["Server prompt tokens"]


def test_memory(rendered) -> None:
    run, sec = rendered
    (rows,) = mt.tables(sec["Memory"])
    got = by_key(rows, "Arms")
    label = {s["key"]: ", ".join(s["arms"]) for s in run.raw["services"]}
    peaks: dict[str, dict[str, list]] = {}
    points: dict[str, int] = {}
    services: dict[str, set] = {}
    for m in run.raw["memory"]:
        d = peaks.setdefault(label[m["service"]], {"gpu": [], "proc": [], "rss": []})
        d["gpu"].append(m["gpu_mem_used"])
        d["proc"].append(m["proc_gpu_mem"])
        d["rss"].append(m["host_rss"])
        points[label[m["service"]]] = points.get(label[m["service"]], 0) + 1
        services.setdefault(label[m["service"]], set()).add(m["service"])
    for s in run.samples:  # every sample's peaks, warm-ups included
        t = s["telemetry"]
        d = peaks.setdefault(label[s["service"]], {"gpu": [], "proc": [], "rss": []})
        d["gpu"].append(t["gpu_mem_used_peak"])
        d["proc"].append(t["proc_gpu_mem_peak"])
        d["rss"].append(t["host_rss_peak"])
    assert set(got) == {(k,) for k in peaks}
    for lab, d in peaks.items():
        r = got[(lab,)]
        assert int(r["Services"]) == len(services[lab]) and int(r["Samples"]) == points[lab]
        for col, k in (("GPU used peak", "gpu"), ("Process GPU peak", "proc"), ("Host RSS peak", "rss")):
            vals = [v for v in d[k] if v is not None]
            mt.assert_figure(r[col], max(vals) if vals else None, f"{lab} {col}")


def test_client_overhead(rendered) -> None:
    run, sec = rendered
    (rows,) = mt.tables(sec["Client overhead"])
    got = by_key(rows, "Arm")
    want = groups(run.ok, "arm")
    assert set(got) == set(want)
    for key, g in want.items():
        r = got[key]
        assert int(r["n"]) == len(g)
        harness = pd.Series(g["after_write"], dtype=float).dropna()
        mt.assert_figure(r["Median"], med(harness), f"{key} harness overhead median")
        mt.assert_figure(r["p90"], float(np.percentile(harness, 90)) if len(harness) else None, f"{key} p90")
        mt.assert_figure(r["Max"], float(harness.max()) if len(harness) else None, f"{key} max")
        mt.assert_figure(r["With the server's write"], med(g["overhead"]), f"{key} with the server's write")
        mt.assert_figure(r["Engine queue wait"], med(g["queue"]), f"{key} queue wait")


def _parity(run: Run) -> tuple[pd.DataFrame, list[tuple[str, bool, bool]]]:
    """(non-reference samples with their reference match, stability rows (arm, match, identical))."""
    ok = run.ok
    ref = ok[ok["arm"] == run.reference]
    ref_by = {(r.prompt, r.round): r.ids for r in ref.itertuples()}
    rows = []
    for s in ok[ok["arm"] != run.reference].itertuples():
        r = ref_by[(s.prompt, s.round)]
        rows.append({"arm": s.arm, "match": list(s.ids[:run.k]) == list(r[:run.k]), "identical": list(s.ids) == list(r)})
    stab = []
    for prompt, g in ref.groupby("prompt"):
        base = g[g["round"] == g["round"].min()].iloc[0]
        for r in g[g["round"] != g["round"].min()].itertuples():
            stab.append((run.reference, list(r.ids[:run.k]) == list(base["ids"][:run.k]), list(r.ids) == list(base["ids"])))
    return pd.DataFrame(rows), stab


def test_verdict_and_parity(rendered) -> None:
    run, sec = rendered
    ok = run.ok
    text = sec["Verdict"]
    (rows,) = mt.tables(text)
    checks = by_key(rows, "Check")
    pairs, stab = _parity(run)
    n_ok = len(ok)
    failed = sum(1 for s in run.samples if not s["ok"] and not s["excluded"])
    on_path = int(sum(ok["path"] == ok["arm"].map(run.expect)))
    fallbacks = int(sum((ok["path"] != ok["arm"].map(run.expect)) & ok["fallback"].notna()))
    silent = len(ok) - on_path - fallbacks
    assert checks[("samples",)]["Detail"] == (f"{n_ok}/{len(run.planned)} measured steps ok, "
                                              f"{len(run.planned) - n_ok} missing, {failed} failed (tolerated: 0)")
    assert checks[("reference",)]["Detail"] == f"{run.reference}: {int(sum(ok['arm'] == run.reference))} ok measured samples"
    assert checks[("token-ids",)]["Detail"] == f"{int(sum(ok['ids_source'] == 'none'))} sample(s) without token ids"
    assert checks[("parity",)]["Detail"] == f"{int(pairs['match'].sum())}/{len(pairs)} equal over the first {run.k} ids"
    assert checks[("reference-stable",)]["Detail"] == \
        f"{sum(m for _, m, _ in stab)}/{len(stab)} equal over the first {run.k} ids"
    assert checks[("active-path",)]["Detail"].startswith(
        f"{on_path}/{len(ok)} on the expected path, {fallbacks} allowed fallback(s), {silent} not allowed")
    passed = (n_ok == len(run.planned) and pairs["match"].all() and all(m for _, m, _ in stab) and silent == 0)
    assert all(r["Result"] == ("pass" if passed else "FAIL") for r in rows)
    assert f"**Gate: {'PASS' if passed else 'FAIL'}** — parity over the first {run.k} token ids." in text

    summary = mt.tables(sec["Parity"])[0]
    got = by_key(summary, "Check", "Arm")
    for arm, g in pairs.groupby("arm"):
        r = got[("parity", arm)]
        assert (int(r["Compared"]), int(r[f"Match (first {run.k})"]), int(r["Identical (all ids)"])) == \
            (len(g), int(g["match"].sum()), int(g["identical"].sum()))
    r = got[("stability", run.reference)]
    assert (int(r["Compared"]), int(r[f"Match (first {run.k})"]), int(r["Identical (all ids)"])) == \
        (len(stab), sum(m for _, m, _ in stab), sum(i for _, _, i in stab))

    (paths,) = mt.tables(sec["Active path"])
    got = by_key(paths, "Arm")
    for arm, g in groups(ok, "arm").items():
        r = got[arm]
        exp = run.expect[arm[0]]
        assert r["Expected"] == exp and int(r["n"]) == len(g)
        assert int(r["Active"]) == int(sum(g["path"] == exp))
        assert int(r["Fallback"].split()[0]) == int(sum((g["path"] != exp) & g["fallback"].notna()))
