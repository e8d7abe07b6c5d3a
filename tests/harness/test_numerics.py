"""Numerics (abbench.analysis.numerics): an arm that changes arithmetic on purpose declares ``parity =
"numerics"`` and is judged by KL divergence, same-top rate and delta-p from the top-k logprobs both sides return,
not by bitwise ids. On hand-computed positions, on small records built here with planted distributions, and on the
committed cpu-tiny-numerics run (float32 vs bfloat16 on the vendored engine)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from abbench import analysis as an
from abbench.analysis.declared import judge, parse_check
from abbench.analysis.numerics import estimate, numerics_positions, numerics_table, position_stats
from abbench.errors import ConfigError
from abbench.profile import load_profile, profile_from_dict
from abbench.report import write_report
from abbench.results import load_run
from tests.harness.test_analysis import make_run

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "results" / "20261204-cpu-tiny-numerics"


def lp(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(id, probability) as (id, logprob)."""
    return [(i, math.log(p)) for i, p in pairs]


# ------------------------------------------------------------------------------------------ one position


def test_one_position_by_hand() -> None:
    kl, same, delta, listed = position_stats(lp([(1, 0.5), (2, 0.3)]), lp([(1, 0.4), (2, 0.4)]))
    want = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert kl == pytest.approx(want) and same == 1 and delta == pytest.approx(-0.1) and listed == 2
    # ids only one side lists go into the rest bucket; a different top token counts 0 and delta-p is still known
    kl, same, delta, listed = position_stats(lp([(1, 0.6), (3, 0.1)]), lp([(2, 0.5), (1, 0.3)]))
    assert kl == pytest.approx(0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7))
    assert (same, listed) == (0, 1) and delta == pytest.approx(0.3 - 0.6)
    # the reference's top token missing from the arm's list: no delta-p
    assert position_stats(lp([(1, 0.6)]), lp([(2, 0.5)]))[2] is None
    assert position_stats(None, lp([(1, 0.5)])) is None and position_stats(lp([(1, 0.5)]), []) is None
    assert position_stats(lp([(1, 0.5), (2, 0.3)]), lp([(1, 0.5), (2, 0.3)]))[0] == pytest.approx(0.0, abs=1e-12)


def test_the_top_k_kl_never_exceeds_the_full_kl() -> None:
    """Merging the ids outside both lists into one bucket is a coarse-graining: a lower bound, tightening as k
    grows, and exact when the lists hold the whole vocabulary."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = int(rng.integers(3, 40))
        p, q = rng.dirichlet(np.full(v, 0.3)), rng.dirichlet(np.full(v, 0.3))
        q = 0.7 * p + 0.3 * q  # related, as two arithmetics of one model are
        full = float(np.sum(p * np.log(p / q)))
        bounds = []
        for k in (1, 2, 5, v):
            top = lambda d: lp([(int(i), float(d[i])) for i in np.argsort(-d)[:k]])  # noqa: E731
            bounds.append(position_stats(top(p), top(q))[0])
        assert all(b <= full + 1e-9 for b in bounds) and bounds[-1] == pytest.approx(full, rel=1e-6, abs=1e-12)


# ------------------------------------------------------------------------------------------ records


def numerics_run(shift: float, *, diverge_at: int | None = 3, rounds: int = 2):
    """A run whose arm B declares parity = "numerics": A's top-3 at every position is (id, 0.5), (id+1, 0.3),
    (id+2, 0.1); B's moves ``shift`` of probability from the first to the second; B's ids differ from A's at
    ``diverge_at``."""
    rec = make_run(arms=("A", "B"), rounds=rounds, gate={"checks": ["kl_mean[B] <= 0.01"]})
    for a in rec.profile["arms"]:
        if a["name"] == "B":
            a["parity"] = "numerics"
    for s in rec.samples:
        if s.kind in ("warmup", "jit"):
            continue
        p1 = 0.5 - (shift if s.arm == "B" else 0.0)
        p2 = 0.3 + (shift if s.arm == "B" else 0.0)
        s.logprobs = [lp([(t, p1), (t + 1, p2), (t + 2, 0.1)]) for t in s.output_ids]
        if s.arm == "B" and diverge_at is not None:
            s.output_ids = [*s.output_ids[:diverge_at], s.output_ids[diverge_at] + 1, *s.output_ids[diverge_at + 1:]]
    return rec


def test_positions_stop_at_the_first_divergence() -> None:
    rec = numerics_run(0.05, diverge_at=3)
    pos = numerics_positions(rec)
    assert set(pos["arm"]) == {"B"} and set(pos.groupby("pair")["position"].max()) == {3}
    assert len(pos) == 4 * pos["pair"].nunique()
    assert pos["kl"].to_numpy() == pytest.approx(np.full(len(pos), 0.5 * math.log(0.5 / 0.45)
                                                         + 0.3 * math.log(0.3 / 0.35)))
    full = numerics_positions(numerics_run(0.05, diverge_at=None))
    assert set(full.groupby("pair")["position"].max()) == {15}


def test_the_gate_judges_a_numerics_arm_by_its_checks_not_its_ids() -> None:
    small = an.gate(numerics_run(0.02))
    checks = {c.name: c for c in small.checks}
    assert small.passed, small.failures
    assert checks["parity"].passed and "numerics" in checks["parity"].detail
    assert any("parity = \"numerics\"" in n and "differ" in n for n in small.notes)
    assert checks["kl_mean[B] <= 0.01"].result == "pass"
    large = an.gate(numerics_run(0.3))
    assert not large.passed and {c.name: c for c in large.checks}["kl_mean[B] <= 0.01"].result == "FAIL"
    assert any(f.startswith("kl_mean[B] <= 0.01: all: fail") for f in large.failures), large.failures
    # the same arm without parity = "numerics" fails parity on its ids
    rec = numerics_run(0.02)
    for a in rec.profile["arms"]:
        a.pop("parity", None)
    assert not {c.name: c for c in an.gate(rec).checks}["parity"].passed


def test_same_top_and_delta_p() -> None:
    rec = numerics_run(0.25)  # B's second token (0.55) now beats its first (0.25): every top differs
    cells = judge(rec, parse_check("same_top[B] >= 0.5"))
    assert len(cells) == 1 and cells[0].value == 0.0 and cells[0].status == "fail"
    t = numerics_table(rec)
    assert t.loc[0, "delta_p_rms"] == pytest.approx(0.25) and t.loc[0, "same_top"] == 0.0
    assert judge(numerics_run(0.0, diverge_at=None), parse_check("same_top[B] >= 0.99"))[0].status == "pass"


def test_one_pair_is_inconclusive_and_intervals_resample_pairs() -> None:
    rec = numerics_run(0.05, rounds=1)
    rec.samples = [s for s in rec.samples if s.prompt_id != "fresh-4096-0"]
    rec.plan = [st for st in rec.plan if st.prompt_id != "fresh-4096-0"]
    cells = judge(rec, parse_check("kl_mean[B] <= 1"))
    assert cells[0].status == "inconclusive" and cells[0].low is None and "1 pair" in cells[0].why
    pos = numerics_positions(numerics_run(0.05, rounds=3))
    e = estimate(pos, "kl_mean")
    assert e.pairs == 6 and e.low == pytest.approx(e.value) and e.high == pytest.approx(e.value)  # all pairs alike
    assert estimate(pos, "kl_p99").note.startswith("24 positions: a p99 needs")


def test_a_numerics_arm_needs_a_check_and_cannot_be_the_reference() -> None:
    base = load_profile("cpu-tiny-numerics").model_dump()
    base["gate"]["checks"] = []
    with pytest.raises(ConfigError, match="gate.checks declares none for it"):
        profile_from_dict(base)
    base = load_profile("cpu-tiny-numerics").model_dump()
    base["run"]["reference"] = "bfloat16"
    with pytest.raises(ConfigError, match="is the parity reference"):
        profile_from_dict(base)
    with pytest.raises(ConfigError, match="parity"):
        profile_from_dict({**load_profile("cpu-tiny").model_dump(),
                           "arms": [{"name": "a", "parity": "bitwise"}]})


def own_reference_run(*, f_breaks_at: int | None = None):
    """Arms A (the run's reference, bf16), Q (parity = "numerics": a resident FP8 arm) and F (an FP8 streaming arm
    whose parity_reference is Q). Q and F move 0.05 of probability and diverge from A at position 3; F's ids are
    Q's, except one id at ``f_breaks_at``."""
    rec = make_run(arms=("A", "Q", "F"), rounds=2, gate={"checks": ["kl_mean[Q] <= 0.01", "kl_mean[F] <= 0.01"]})
    for a in rec.profile["arms"]:
        if a["name"] == "Q":
            a["parity"] = "numerics"
        if a["name"] == "F":
            a["parity_reference"] = "Q"
    for s in rec.samples:
        if s.kind in ("warmup", "jit"):
            continue
        shift = 0.0 if s.arm == "A" else 0.05
        s.logprobs = [lp([(t, 0.5 - shift), (t + 1, 0.3 + shift), (t + 2, 0.1)]) for t in s.output_ids]
        if s.arm != "A":
            s.output_ids = [*s.output_ids[:3], s.output_ids[3] + 1, *s.output_ids[4:]]
        if s.arm == "F" and f_breaks_at is not None:
            s.output_ids[f_breaks_at] += 7
    return rec


def test_an_arm_judged_against_its_own_parity_reference() -> None:
    """An FP8 streaming arm's ids against a resident FP8 arm (bitwise), its numerics against the run's bf16
    reference: the pairing of each is the one it names."""
    rec = own_reference_run()
    verdict = an.gate(rec)
    assert verdict.passed, verdict.failures
    p = an.parity_frame(rec)
    f_rows = p[(p["check"] == "parity") & (p["arm"] == "F")]
    assert set(f_rows["against_arm"]) == {"Q"} and f_rows["match"].all() and (f_rows["classification"] ==
                                                                                "identical").all()
    assert set(p[(p["check"] == "parity") & (p["arm"] == "Q")]["against_arm"]) == {"A"}
    assert set(p[p["check"] == "stability"]["arm"]) == {"A", "Q"}  # both yardsticks across rounds
    pos = numerics_positions(rec)  # F against A, not against Q (where every KL would be 0)
    assert set(pos["arm"]) == {"Q", "F"} and (pos[pos["arm"] == "F"]["kl"] > 0).all()
    assert set(pos.groupby("pair")["position"].max()) == {3}
    assert list(numerics_table(rec)["arm"]) == ["Q", "F"]
    # one id of F off Q's: parity fails, naming Q
    broken = an.gate(own_reference_run(f_breaks_at=2))
    parity = {c.name: c for c in broken.checks}["parity"]
    assert not parity.passed and any(f.startswith("parity: ") and "from Q round" in f for f in broken.failures), \
        broken.failures
    # and F without its own reference is judged against A's ids, which it does not have
    rec = own_reference_run()
    for a in rec.profile["arms"]:
        a.pop("parity_reference", None)
    assert not {c.name: c for c in an.gate(rec).checks}["parity"].passed


def test_an_own_parity_reference_is_another_arm_and_not_a_numerics_arms() -> None:
    """cpu-tiny-numerics has float32 (the reference) and bfloat16 (parity = "numerics")."""
    for arm, ref, match in (("bfloat16", "nope", "is not an arm"), ("float32", "float32", "names the arm itself"),
                            ("bfloat16", "float32", "choose one")):
        d = load_profile("cpu-tiny-numerics").model_dump()
        next(a for a in d["arms"] if a["name"] == arm)["parity_reference"] = ref
        with pytest.raises(ConfigError, match=match):
            profile_from_dict(d)


# ------------------------------------------------------------------------------------------ committed run


@pytest.mark.skipif(not COMMITTED.is_dir(), reason="the committed cpu-tiny-numerics run")
def test_the_reference_lists_mass_is_shown_and_a_thin_one_is_said(tmp_path: Path) -> None:
    """The median probability mass of the reference's top-k lists: 0.9 in numerics_run (the KL bound saw most of
    the distribution, nothing said); the committed float32/bfloat16 run's random-weight model lists 0.4% of it,
    and the report says the bound can be far below the whole vocabulary's and names the probe."""
    from abbench.analysis.numerics import listed_mass

    assert listed_mass(lp([(1, 0.5), (2, 0.3)])) == pytest.approx(0.8) and listed_mass(None) is None
    rec = numerics_run(0.05)
    assert numerics_table(rec)["ref_mass_median"].tolist() == [pytest.approx(0.9)]
    text = write_report(rec, [], tmp_path / "a.md", tmp_path / "a", draw_plots=False).read_text()
    assert "| 90.0% |" in text and "lists held under 50%" not in text
    record, _ = load_run(COMMITTED)
    assert numerics_table(record)["ref_mass_median"].iloc[0] < 0.01
    text = " ".join(write_report(record, [], tmp_path / "b.md", tmp_path / "b", draw_plots=False).read_text().split())
    assert ("The reference's top-k lists held under 50% of its probability mass at the median position for "
            "bfloat16") in text and "abbench probe RUN --arm ARM --numerics" in text


def test_the_committed_float32_bfloat16_run(tmp_path: Path) -> None:
    record, _ = load_run(COMMITTED)
    verdict = an.gate(record)
    assert verdict.passed, verdict.failures
    t = numerics_table(record)
    assert list(t["arm"]) == ["bfloat16"] and t.loc[0, "positions"] > 0 and t.loc[0, "listed_median"] == 20
    text = write_report(record, [], tmp_path / "r.md", tmp_path / "r").read_text()
    assert "## Numerics" in text and "random weights" in text and "(r/numerics.png)" in text
    assert (tmp_path / "r" / "numerics.png").is_file()


FP8_RUN = REPO / "results" / "20261204l-cpu-tiny-fp8"


@pytest.mark.skipif(not FP8_RUN.is_dir(), reason="the committed cpu-tiny-fp8 run")
def test_the_committed_fp8_run_is_judged_by_numerics_and_bytes_and_names_each_bank() -> None:
    """cpu-tiny-fp8: the FP8 arm's ids are not gated bitwise; its numerics and h2d_ratio checks are, and the
    transfer table says which arm's bank is FP8 (the bytes: 3HI + 4(2I + H) against 6HI at the tiny shape)."""
    from abbench.analysis.transfer import h2d_table

    record, _ = load_run(FP8_RUN)
    verdict = an.gate(record)
    results = {c.name: c for c in verdict.checks}
    assert verdict.passed and results["h2d_ratio[fp8] <= 0.521"].passed and results["kl_mean[fp8] <= 0.001"].passed
    h, i = 128, 64
    t = h2d_table(record)
    assert set(t[t["arm"] == "fp8"]["expert_format"]) == {"fp8-e4m3 (per-row scales)"}
    assert set(t[t["arm"] == "bf16"]["expert_format"]) == {"bfloat16"}
    ratio = (t[t["arm"] == "fp8"]["bank_bytes"].iloc[0] / t[t["arm"] == "bf16"]["bank_bytes"].iloc[0])
    assert ratio == pytest.approx((3 * h * i + 4 * (2 * i + h)) / (6 * h * i), rel=1e-12)


OWN_REF_RUN = REPO / "results" / "20261205r-cpu-tiny-fp8"


@pytest.mark.skipif(not OWN_REF_RUN.is_dir(), reason="the committed cpu-tiny-fp8 run with fp8-resident")
def test_the_committed_fp8_run_holds_streamed_fp8_to_resident_fp8s_ids() -> None:
    record, _ = load_run(OWN_REF_RUN)
    verdict = an.gate(record)
    assert verdict.passed, verdict.failures
    p = an.parity_frame(record)
    fp8 = p[(p["check"] == "parity") & (p["arm"] == "fp8")]
    assert len(fp8) == 8 and set(fp8["against_arm"]) == {"fp8-resident"} and fp8["match"].all()
    t = numerics_table(record).set_index("arm")
    assert list(t.index) == ["fp8-resident", "fp8"] and t.loc["fp8", "kl_mean"] == t.loc["fp8-resident", "kl_mean"]


def test_diff_compares_an_arm_with_its_own_parity_reference() -> None:
    """``abbench diff``: F (ids of Q's but one at position 5) against Q, its own reference, not against A (from
    which Q and F differ at position 3)."""
    from abbench.diagnostics.diff import diff_prompt, first_divergence

    rec = own_reference_run(f_breaks_at=5)
    d = first_divergence(rec, arm="F")
    assert d is not None and d.position == 5
    pd_ = diff_prompt(rec, d.prompt_id, arm="F", round=d.round)
    assert (pd_.reference, pd_.arm, pd_.first_diverging) == ("Q", "F", 5)
    q = diff_prompt(rec, d.prompt_id, arm="Q", round=d.round)
    assert (q.reference, q.first_diverging) == ("A", 3)


def test_arms_that_leave_out_an_arms_own_reference_leave_it_to_its_numerics() -> None:
    """``--arms`` without the arm an FP8 arm's ids are held to: that arm is judged by its numerics checks (against
    the run's reference), not by ids it cannot have; with it, nothing changes."""
    prof = load_profile("h200-fp8-16g")
    cut = {a.name: a for a in prof.with_overrides(arms=["resident", "bf16", "fp8"]).arms}
    assert (cut["fp8"].parity_reference, cut["fp8"].parity) == (None, "numerics")
    whole = {a.name: a for a in prof.with_overrides(arms=["resident", "resident-fp8", "fp8"]).arms}
    assert (whole["fp8"].parity_reference, whole["fp8"].parity) == ("resident-fp8", "ids")


def test_arms_that_would_make_a_numerics_arm_the_reference_are_refused_with_the_selection_to_use() -> None:
    """``--arms resident-fp8-w8a8,fp8-w8a8`` leaves out the run's reference, and the first arm that would take its
    place is judged by numerics against the reference: refused, naming the selection that works."""
    from abbench.errors import ConfigError

    prof = load_profile("h200-fp8-16g")
    with pytest.raises(ConfigError, match=r"--arms resident,resident-fp8-w8a8,fp8-w8a8$"):
        prof.with_overrides(arms=["resident-fp8-w8a8", "fp8-w8a8"])
    assert [a.name for a in prof.with_overrides(arms=["fp8-w8a8", "resident-fp8-w8a8"]).arms][0] == "fp8-w8a8"


def test_the_bootstraps_array_statistics_are_the_frame_statistics_bit_for_bit() -> None:
    """``ARRAY_STATISTICS`` (the resamples' arrays) give exactly ``STATISTICS`` (the frame), missing values
    included: the intervals do not move when the bootstrap stops building a frame per resample."""
    import numpy as np
    import pandas as pd

    from abbench.analysis.numerics import ARRAY_STATISTICS, STATISTIC_COLUMN, STATISTICS

    rng = np.random.default_rng(3)
    for n in (1, 7, 300, 4099):
        kl = rng.exponential(1e-4, n) * rng.choice([1.0, 1e-3, 10.0], n)
        kl[rng.random(n) < 0.05] = np.nan
        delta = rng.normal(0, 0.01, n)
        delta[rng.random(n) < 0.2] = np.nan
        whole = kl * 3.0
        whole[rng.random(n) < 0.5] = np.nan  # the first positions alone have one
        g = pd.DataFrame({"kl": kl, "same_top": pd.array(rng.integers(0, 2, n), dtype="Int64"), "delta_p": delta,
                          "kl_vocab": whole})
        for metric, stat in STATISTICS.items():
            col = g[STATISTIC_COLUMN[metric]].to_numpy(dtype=float, na_value=np.nan)
            want, got = stat(g), ARRAY_STATISTICS[metric](col)
            assert (want == got) or (np.isnan(want) and np.isnan(got)), (metric, n, want, got)


# ------------------------------------------------------------------------------------------ whole rows


def _b64(row: np.ndarray) -> str:
    import base64

    return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode()


def test_whole_rows_go_aside_and_their_kl_is_recorded_for_every_reference_sample(tmp_path: Path) -> None:
    """abbench.vocabrows: a measured ok sample's row leaves its ``engine`` object for ``rows/STEP.npy`` (an excluded
    or failed sample's is dropped); the KL of each sample's row against each reference sample's of its prompt is
    the float64 sum by hand, 0 against an equal row, None (infinite) where the arm gives an id no probability."""
    from abbench import vocabrows

    rec = numerics_run(0.05)
    ref_row = np.log(np.array([0.5, 0.3, 0.2]))
    arm_row = np.log(np.array([0.4, 0.4, 0.2]))
    dead = np.array([0.0, 0.0, -np.inf])
    for s in rec.samples:
        row = ref_row if s.arm == "A" else (dead if s.prompt_id == rec.samples[-1].prompt_id else arm_row)
        s.engine = {**(s.engine or {}), "full_logprobs": _b64(row)}
        vocabrows.take_row(tmp_path, s)
        assert "full_logprobs" not in s.engine
    kept = {int(p.stem) for p in (tmp_path / "rows").glob("*.npy")}
    assert kept == {s.step for s in rec.samples if s.ok and not s.excluded}
    got = vocabrows.vocab_kls(tmp_path, rec, "A")
    arm_of = {s.step: s for s in rec.samples}
    per_prompt = {}
    for s in rec.samples:
        if s.arm == "A" and s.step in kept:
            per_prompt[s.prompt_id] = per_prompt.get(s.prompt_id, 0) + 1
    want = sum(per_prompt[arm_of[k].prompt_id] - (arm_of[k].arm == "A") for k in kept)
    assert len(got) == want and all(v.vocab == 3 for v in got)
    by_hand = float(np.sum(np.exp(ref_row) * (ref_row - arm_row.astype(np.float32).astype(np.float64))))
    for v in got:
        s = arm_of[v.step]
        if s.arm == "A":
            assert v.kl == 0.0
        elif s.prompt_id == rec.samples[-1].prompt_id:
            assert v.kl is None
        else:
            assert v.kl == pytest.approx(by_hand, rel=1e-6)
    vocabrows.drop_rows(tmp_path)
    assert not vocabrows.has_rows(tmp_path)


def test_whole_rows_need_the_openai_adapter_no_load_and_a_kl_vocab_check_needs_them() -> None:
    base = load_profile("cpu-tiny-fp8").model_dump()
    assert base["request"]["full_logprobs"] and "kl_vocab_mean[fp8] <= 0.01" in base["gate"]["checks"]
    base["request"]["full_logprobs"] = False
    with pytest.raises(ConfigError, match="set request.full_logprobs = true"):
        profile_from_dict(base)
    base["request"]["full_logprobs"] = True
    assert profile_from_dict(base).request.full_logprobs
    with pytest.raises(ConfigError, match="arms fp8 use another adapter"):
        profile_from_dict({**base, "arms": [*base["arms"][:2], {**base["arms"][2], "adapter": "vllm"},
                                            *base["arms"][3:]]})
    load = load_profile("cpu-tiny-load").model_dump()
    load["request"]["full_logprobs"] = True
    with pytest.raises(ConfigError, match="runs of single requests"):
        profile_from_dict(load)


def test_a_kl_vocab_check_without_rows_says_what_is_missing() -> None:
    rec = numerics_run(0.05)
    rec.profile["request"] = {**(rec.profile.get("request") or {}), "full_logprobs": True}
    cells = judge(rec, parse_check("kl_vocab_mean[B] <= 0.01"))
    assert [c.status for c in cells] == ["inconclusive"] and "request.full_logprobs" in cells[0].why
