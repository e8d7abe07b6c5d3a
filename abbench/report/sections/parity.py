"""Greedy parity against the reference (per prompt, with near-tie flips and logprob agreement), the active
prefill path against ``expect_path``, and attention batching in layer-major prefill.
"""

from __future__ import annotations

import pandas as pd

from abbench import analysis as an
from abbench.report.format import DASH, Col, fmt_bool, fmt_counts, fmt_int, is_na, table
from abbench.report.sections.base import ReportInput


def _parity_detail_cols(k: int) -> list[Col]:
    return [
        Col("check", "Check", descriptive=True, right=False),
        Col("prompt_id", "Prompt", descriptive=True, right=False),
        Col("arm", "Arm", descriptive=True, right=False), Col("round", "Round", fmt_int, descriptive=True),
        Col("against", "Against", descriptive=True, right=False), Col("match", f"Match (first {k})", fmt_bool),
        Col("first_diverging", "First diverging", fmt_int), Col("agree_of", "Agree"),
        Col("margin", "Margin arm", lambda v: DASH if is_na(v) else f"{float(v):.3f}"),
        Col("margin_against", "Margin ref", lambda v: DASH if is_na(v) else f"{float(v):.3f}"),
        Col("classification", "Class", right=False), Col("verdict", f"Verdict (first {k})", right=False),
        Col("verdict_why", "Why", descriptive=True, right=False),
        Col("note", "Note", descriptive=True, right=False),
    ]


_VERDICT_RANK = {"equal": 0, "near-tie flip": 1, "unchecked": 2, "broken": 3}


def _verdicts_per_prompt(p: pd.DataFrame) -> list[str]:
    """One line per prompt and arm of the parity rows: the worst verdict over its rounds."""
    rows = p[p["check"] == "parity"]
    if rows.empty:
        return []
    out = []
    for (prompt, arm), g in rows.groupby(["prompt_id", "arm"], sort=False):
        worst = max(g["verdict"].fillna("unchecked"), key=lambda v: _VERDICT_RANK.get(v, 3))
        margins = g["flip_margin"].dropna()
        out.append({"prompt_id": prompt, "arm": arm, "rounds": len(g), "verdict": worst,
                    "flip_margin": float(margins.max()) if not margins.empty else None})
    return ["Verdict per prompt (the worst over its rounds):", "", table(pd.DataFrame(out), [
        Col("prompt_id", "Prompt", right=False), Col("arm", "Arm", right=False), Col("rounds", "Rounds", fmt_int),
        Col("verdict", "Verdict", right=False),
        Col("flip_margin", "Flip margin", lambda v: DASH if is_na(v) else f"{float(v):.4f}")], drop_constant=False)]


def _logprob_agreement(p: pd.DataFrame, ref: str | None) -> list[str]:
    """Per arm: how closely its logprobs agree with the parity reference's where their ids agree (the spread
    its arithmetic alone makes), beside its tolerance and its largest flip margin."""
    rows = p[(p["check"] == "parity") & (p["lp_positions"].fillna(0) > 0)]
    if rows.empty:
        return []
    out = []
    for arm, g in rows.groupby("arm", sort=False):
        flips = g["flip_margin"].dropna()
        out.append({"arm": arm, "positions": int(g["lp_positions"].sum()),
                    "median": float(g["lp_delta_median"].median()), "max": float(g["lp_delta_max"].max()),
                    "margin": None if g["margin_delta_max"].isna().all() else float(g["margin_delta_max"].max()),
                    "tolerance": float(g["tolerance"].iloc[0]), "accepts": bool(g["accepts"].fillna(False).any()),
                    "flip": float(flips.max()) if not flips.empty else None})
    nats = lambda v: DASH if is_na(v) else f"{float(v):.4f}"  # noqa: E731
    return ["", f"Logprob agreement with {ref} where the ids agree (the positions before each row's first "
            "divergence): |Δ| of the chosen token's logprob (median of the rows' medians, and the largest) and "
            "the largest |Δ| of the top-2 margin. An engine that computes the same model differs from the "
            "reference by its arithmetic alone; a flip whose margin lies within that spread is such noise.", "",
            table(pd.DataFrame(out), [
                Col("arm", "Arm", right=False), Col("positions", "Positions", fmt_int),
                Col("median", "Median |Δ logprob|", nats), Col("max", "Max |Δ logprob|", nats),
                Col("margin", "Max |Δ margin|", nats),
                Col("tolerance", "Tolerance", lambda v: f"{float(v):g}"),
                Col("accepts", "Accepted by the gate", fmt_bool),
                Col("flip", "Largest flip margin", nats)], drop_constant=False)]


def parity_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    k = a.parity_tokens
    lines = ["## Parity", ""]
    p = a.parity
    if p.empty:
        return lines + ["No parity rows: there is no measured ok sample to compare."]
    accept = an.gate_spec(ri.record).accept_near_ties
    own = {arm: t for arm, t in an.arm_tolerances(ri.record).items() if arm != a.parity_reference}
    tolerances = ([f"{accept:g} nats (gate.accept_near_ties)"] if accept else
                  [f"{an.NEAR_TIE_NATS:g} nats (the default; reported, not accepted)"])
    tolerances += [f"arm {arm}: {t:g} nats (its own accept_near_ties)" for arm, t in own.items()]
    if accept:
        accepts = "The gate accepts the near-tie flips of parity rows."
    elif own:
        accepts = f"The gate accepts near-tie flips of {', '.join(own)} only."
    else:
        accepts = "The gate accepts no mismatch (gate.accept_near_ties is not set)."
    against = (f"the parity reference ({a.parity_reference}, gate.parity_reference)"
               if a.parity_reference != a.reference else f"the reference ({a.reference})")
    own_refs = an.arm_parity_references(ri.record)
    stability = "the reference with its own lowest round"
    if own_refs:
        against = against[:-1] + "; " + "; ".join(f"arm {arm}'s against {ref}, its own parity_reference"
                                                  for arm, ref in own_refs.items()) + ")"
        stability = "each arm that is a parity reference with its own lowest round"
    lines += [(f"Each measured sample's first {k} greedy ids against {against} in the same "
              f"round; 'stability' rows compare {stability}. Margin = top-2 "
              f"logprob gap (nats) at the first divergence; below {an.NEAR_TIE_NATS} in either arm: near-tie. "
              f"Verdict over the first {k} ids: equal; near-tie flip (on each side its own choice is its best "
              "and the other's choice is among its top logprobs, less than the row's tolerance below: with "
              "top-2 logprobs, each side's choice is the other's runner-up); broken (anything else). Tolerance: "
              + "; ".join(tolerances) + ". " + accepts),
              ""]
    summary = []
    for (check, arm), g in p.groupby(["check", "arm"], sort=False):
        summary.append({
            "check": check, "arm": arm, "rows": len(g), "match": int((g["match"] == True).sum()),
            "identical": int((g["classification"] == "identical").sum()),
            "min_agree": None if g["agree"].isna().all() else int(g["agree"].min()),
            "near": int((g["classification"] == "near-tie").sum()),
            "div": int(g["classification"].isin(["divergence", "margin unknown"]).sum()),
            "unchecked": int(g["match"].isna().sum()),
            "v_equal": int((g["verdict"] == "equal").sum()),
            "v_flip": int((g["verdict"] == "near-tie flip").sum()),
            "v_broken": int((g["verdict"] == "broken").sum()),
        })
    n_max = p["max_tokens"].dropna()
    of = f"/{int(n_max.max())}" if not n_max.empty else ""
    lines.append(table(pd.DataFrame(summary), [
        Col("check", "Check", right=False), Col("arm", "Arm", right=False), Col("rows", "Compared", fmt_int),
        Col("match", f"Match (first {k})", fmt_int), Col("identical", "Identical (all ids)", fmt_int),
        Col("min_agree", "Min agree", lambda v: DASH if is_na(v) else f"{int(v)}{of}"),
        Col("near", "Near-ties", fmt_int), Col("div", "Divergences", fmt_int),
        Col("unchecked", "Unchecked", fmt_int), Col("v_equal", "Verdict: equal", fmt_int),
        Col("v_flip", "near-tie flip", fmt_int), Col("v_broken", "broken", fmt_int)], drop_constant=False))
    lines += ["", *_verdicts_per_prompt(p), *_logprob_agreement(p, a.parity_reference)]
    rows = p.copy()
    rows["against"] = [DASH if is_na(ar) else (f"{ar} r{int(rr)}" if not is_na(rr) else str(ar))
                       for ar, rr in zip(rows["against_arm"], rows["against_round"])]
    rows["agree_of"] = [DASH if is_na(ag) else f"{int(ag)}/{int(mt)}" for ag, mt in zip(rows["agree"], rows["max_tokens"])]
    diverged = rows[(rows["classification"] != "identical").to_numpy(dtype=bool)]
    if diverged.empty:
        lines += ["", "Every compared output is identical over all its ids."]
    else:
        lines += ["", "Rows that diverge anywhere or could not be checked:", "",
                  table(diverged, _parity_detail_cols(k))]
    lines += ["", "<details><summary>Every parity row</summary>", "", table(rows, _parity_detail_cols(k)), "",
              "</details>"]
    return lines


def active_path_section(ri: ReportInput) -> list[str]:
    a, record = ri.analysis, ri.record
    lines = ["## Active path", ""]
    s = a.path_summary
    if s.empty:
        return lines + ["No measured ok samples: nothing to check."]
    if s["expect_path"].isna().all() and all(p == {"(not reported)": n} for p, n in zip(s["paths"], s["n"])):
        return lines + ["No arm sets expect_path and the engine reported no prefill path."]
    rows = s.copy()
    rows["fallback_text"] = [f"{fb} ({ine} one-chunk)" if ine else str(fb)
                             for fb, ine in zip(rows["fallback"], rows["fallback_ineligible"])]
    req = an.gate_spec(record).require_active_path
    rows["gate"] = [("pass" if ok else "FAIL") if req else "not gated" for ok in rows["passed"]]
    lines += [
        ("Prefill path the engine reported per measured request. A fallback with the engine's reason passes "
         "on a one-chunk prompt (n_chunks <= 1: nothing to reorder), and on longer prompts only for arms in "
         "gate.allow_fallback; a different path without a reason (silent), no reported path, or an arm that "
         "never shows its path fails.")
        + ("" if req else " gate.require_active_path is off: shown, not gated."), "",
        table(rows, [Col("arm", "Arm", right=False), Col("expect_path", "Expected", descriptive=True, right=False),
                     Col("n", "n", fmt_int, descriptive=True), Col("paths", "Reported paths", fmt_counts, right=False),
                     Col("fallback_reasons", "Fallback reasons", fmt_counts, descriptive=True, right=False),
                     Col("active", "Active", fmt_int), Col("fallback_text", "Fallback"),
                     Col("silent", "Silent", fmt_int), Col("unreported", "Unreported", fmt_int),
                     Col("allow_fallback", "Allowed to fall back", fmt_bool, descriptive=True),
                     Col("gate", "Gate", right=False)]),
    ]
    return lines


def attention_batching_section(ri: ReportInput) -> list[str]:
    t = ri.analysis.attention_batching
    if t.empty:
        return []
    return [
        "## Attention batching", "",
        ("Arms whose engine ran layer-major prefill with more than one chunk per attention call (the vendored "
         "engine's attention_batch, in full-attention layers). Medians per request: groups of that many adjacent "
         "chunks that ran as one call, and groups that ran one call per chunk instead, by the engine's reason "
         "(not-bit-identical: the joint call is not exact on this device; window-end: fewer chunks left in the "
         "window; short-chunk: a chunk shorter than the chunk length; long-context: the group ends past the "
         "batching limit)."), "",
        table(t, [Col("arm", "Arm", right=False), Col("kind", "Kind", descriptive=True, right=False),
                  Col("target_tokens", "Prompt tokens", fmt_int), Col("n", "n", fmt_int, descriptive=True),
                  Col("attention_batch", "Chunks per call", fmt_int, descriptive=True),
                  Col("batched", "Batched groups", fmt_int), Col("fallbacks", "Fallbacks", fmt_counts, right=False)]),
    ]
