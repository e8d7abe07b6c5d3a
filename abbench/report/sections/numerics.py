"""The report's *Numerics* section (runs with an arm of ``parity = "numerics"``): per such arm, how far its
next-token distributions move from the parity reference's, from the top-k logprobs both return
(:mod:`abbench.analysis.numerics`): pairs, compared positions, mean and p99 KL, same-top rate and RMS delta-p with
their intervals, and the plot (``numerics.png``: the distribution of the per-position KL). Nothing for other runs.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from abbench import analysis as an
from abbench.analysis.numerics import compared_arms
from abbench.report.format import DASH, Col, fmt_int, fmt_num, fmt_pct, is_na, table
from abbench.report.sections.base import ReportInput, plot_link
from abbench.results import RunRecord

LISTED_MASS_LOW = 0.5
"""Below this median mass of the reference's top-k lists the section says the KL bound saw little of the
distribution."""
RANDOM_WEIGHTS = ("random:", "tiny-qwen3-moe:")
"""A launch argument starting so names random weights (the vendored engine's presets)."""


def _interval(low: Any, high: Any, fmt: Any) -> str:
    return DASH if is_na(low) or is_na(high) else f"{fmt(low)} – {fmt(high)}"


def _nats(v: Any) -> str:
    return DASH if is_na(v) else f"{float(v):.3g}"


def random_weights(record: RunRecord) -> bool:
    """Whether a launched service of the run loads random weights (a ``random:SEED`` or tiny-preset argument)."""
    engine = record.profile.get("engine") or {}
    argvs = [engine.get("command") or []] + [[*(a.get("command") or []), *(a.get("args") or [])]
                                             for a in record.profile.get("arms") or [] if isinstance(a, dict)]
    return any(str(x).startswith(RANDOM_WEIGHTS) for argv in argvs for x in argv)


def numerics_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    t: pd.DataFrame = a.numerics
    if t.empty:
        return []
    rows = t.copy()
    rows["kl_ci"] = [_interval(lo, hi, _nats) for lo, hi in zip(rows["kl_mean_low"], rows["kl_mean_high"])]
    rows["same_ci"] = [_interval(lo, hi, lambda v: fmt_pct(v, 1)) for lo, hi in
                       zip(rows["same_top_low"], rows["same_top_high"])]
    whole = bool((rows["kl_vocab_pairs"].fillna(0) > 0).any())
    rows["vocab_ci"] = [_interval(lo, hi, _nats) for lo, hi in
                        zip(rows["kl_vocab_mean_low"], rows["kl_vocab_mean_high"])]
    vocab_cols = [Col("kl_vocab_mean", "Whole-vocabulary KL, first position (nats)", _nats),
                  Col("vocab_ci", "95% CI  "), Col("kl_vocab_pairs", "Pairs with whole rows", fmt_int)] if whole else []
    lines = [
        "## Numerics", "",
        f"Arms with `parity = \"numerics\"` change arithmetic on purpose: the gate judges them by their declared "
        f"numerics checks against **{a.parity_reference}**, not by bitwise ids. Each sample is paired with the "
        "reference's sample of the same prompt and round; a pair is compared at every position up to and including "
        "its first differing token (both sides saw the same context there) where both captured top-k logprobs. "
        "KL(reference || arm) is taken over the ids both lists hold plus one bucket for the rest of the vocabulary, "
        "a lower bound of the full-vocabulary KL (more logprobs tighten it; `abbench probe RUN --arm ARM --numerics` "
        "measures the whole vocabulary's, where the engine can return it); same top: both sides' most likely token "
        "agrees; Δp: p_arm − p_reference of the reference's most likely token. Intervals: 95%, resampling whole "
        "pairs." + (" The run asked for whole rows (`request.full_logprobs`): at the first output position the "
                    "whole-vocabulary KL is the KL itself, one value a pair." if whole else "")
        + _own_references(ri), "",
        table(rows, [Col("arm", "Arm", right=False), Col("pairs", "Pairs", fmt_int),
                     Col("positions", "Positions", fmt_int), Col("diverged", "Pairs that diverged", fmt_int),
                     Col("kl_mean", "Mean KL (nats)", _nats), Col("kl_ci", "95% CI"),
                     Col("kl_p99", "KL p99 (nats)", _nats), Col("same_top", "Same top", lambda v: fmt_pct(v, 1)),
                     Col("same_ci", "95% CI "), Col("delta_p_rms", "RMS Δp", lambda v: fmt_num(v, 4)),
                     Col("listed_median", "Ids in both lists (median)", lambda v: fmt_num(v, 0)),
                     Col("ref_mass_median", "Reference's listed mass (median)", lambda v: fmt_pct(v, 1)),
                     *vocab_cols],
              drop_constant=False),
    ]
    thin = [str(r.arm) for r in t.itertuples()
            if not is_na(r.ref_mass_median) and float(r.ref_mass_median) < LISTED_MASS_LOW]
    if thin:
        lines += ["", f"The reference's top-k lists held under {LISTED_MASS_LOW:.0%} of its probability mass at the "
                      f"median position for {', '.join(thin)}: the mean KL above leaves the rest to one bucket and "
                      "can be far below the whole vocabulary's. " + (
                          "The whole-vocabulary column is the KL itself at the first position; `abbench probe RUN "
                          "--arm ARM --numerics` measures it at every compared position." if whole else
                          "`abbench probe RUN --arm ARM --numerics` measures the whole vocabulary's where the engine "
                          "can return it; `request.full_logprobs = true` records it at the first position of every "
                          "request of a run.")]
    if random_weights(ri.record):
        lines += ["", "The services load random weights: these figures check the machinery (the logprobs, the "
                      "pairing, the statistics), not a trained model's quality."]
    lines += plot_link(ri.plots, "numerics", "Per-position KL divergence from the parity reference")
    return lines


def _own_references(ri: ReportInput) -> str:
    """A sentence for the arms whose ids are judged against their own parity reference (empty when none)."""
    own = {arm: ref for arm, ref in an.arm_parity_references(ri.record).items()
           if arm in compared_arms(ri.record)}
    if not own:
        return ""
    return (" Shown too: " + "; ".join(f"{arm}, whose ids are judged against {ref} (its own parity_reference)"
                                       for arm, ref in own.items())
            + ", measured here against the run's parity reference and judged by its declared numerics checks.")
