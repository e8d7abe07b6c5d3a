"""The crossover arithmetic of a sweep (abbench.analysis.sweep) on runs built here, whose crossover is known: the
per-point ratios and intervals, the interpolated crossover and its bootstrap interval, the cases without one
crossing, where refinement bisects, and the declared checks crossover[A, B] and ttft_ratio[..., vs A|B]
judged on them. No timings are measured: every TTFT is constructed."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from abbench import analysis as an
from abbench.analysis.declared import judge, parse_check
from abbench.analysis.sweep import (analyze_sweep, crossover, judge_crossover, locate, point_table, points,
                                    refinement_point, sweep_summary)
from abbench.checkexpr import check_arms, checks_within
from abbench.errors import ConfigError
from abbench.results import PromptRecord, RunRecord, Sample, Step

GRID = [64, 256, 1024, 4096]
NOISE = (1.03, 0.97, 1.01, 0.99)
"""Per (prompt, round) multipliers of A's TTFT: their median is 1, so every point's median ratio is exact."""


def power_law(x_star: float, k: float = 0.5) -> Callable[[int], float]:
    """ratio(x) = (x / x_star)^k: log-ratio is linear in log x, so interpolation finds x_star exactly."""
    return lambda x: (x / x_star) ** k


def synthetic(ratio: Callable[[int], float], xs: list[int] = GRID, *, vary: str = "suffix", per_point: int = 2,
              rounds: int = 2, arms: dict[str, Callable[[int], float]] | None = None,
              checks: list[str] | None = None) -> RunRecord:
    """A sweep run of arms A and B (plus ``arms``: name -> TTFT(x) in seconds): B takes 1 s at every point,
    A takes ratio(x) seconds times a NOISE factor, in ABBA rounds, one sample per arm, prompt and round."""
    ttft = {"B": lambda x: 1.0, **(arms or {})}
    names = ["A", *ttft]
    prefix = 1024
    prompts, plan, samples = [], [], []
    measured: list[tuple[str, int]] = []
    for x in xs:
        for i in range(per_point):
            if vary == "suffix":
                cold = PromptRecord(id=f"sweep-{x}-{i}-cold", kind="cold", target_tokens=prefix, token_count=prefix,
                                    sha256="0" * 64, corpus="essays")
                cont = PromptRecord(id=f"sweep-{x}-{i}-cont", kind="continuation", target_tokens=prefix + x,
                                    token_count=prefix + x, sha256="1" * 64, corpus="essays", parent=cold.id)
                prompts += [cold, cont]
                measured.append((cont.id, x))
            else:
                p = PromptRecord(id=f"sweep-{x}-{i}", kind="fresh", target_tokens=x, token_count=x, sha256="2" * 64,
                                 corpus="essays")
                prompts.append(p)
                measured.append((p.id, x))
    for r in range(1, rounds + 1):
        order = names if r % 2 else names[::-1]
        for j, (pid, x) in enumerate(measured):
            kind = "continuation" if vary == "suffix" else "fresh"
            for pos, arm in enumerate(order):
                noise = NOISE[((r - 1) * per_point + j % per_point) % len(NOISE)]
                t = ratio(x) * noise if arm == "A" else ttft[arm](x)
                st = Step(index=len(plan), round=r, arm=arm, position=pos, prompt_id=pid, kind=kind, group=pid,
                          service="shared", reset_before=True, excluded=False)
                plan.append(st)
                samples.append(Sample(step=st.index, arm=arm, round=r, position=pos, prompt_id=pid, kind=kind,
                                      excluded=False, service="shared", ok=True, started_at=0.0, ttft_s=t,
                                      total_s=t + 0.1))
    sweep = {"vary": vary, "points": xs, "per_point": per_point, "crossovers": [["A", "B"]],
             **({"prefix_tokens": prefix} if vary == "suffix" else {})}
    profile = {"name": "synthetic-sweep", "arms": [{"name": n} for n in names], "run": {"reference": "B"},
               "sweep": sweep, "gate": {"checks": checks or []}}
    return RunRecord(run_id="synthetic-sweep", status="complete", created_at=0.0, abbench_version="test",
                     profile=profile, prompts=prompts, plan=plan, samples=samples)


# ----------------------------------------------------------------------------------------- points


def test_points_are_the_uncached_suffix_or_the_fresh_length() -> None:
    rec = synthetic(power_law(700))
    assert sorted(set(points(rec).values())) == GRID
    assert points(rec)["sweep-256-1-cont"] == 256  # 1280 tokens after a 1024-token cold prompt
    assert "sweep-256-1-cold" not in points(rec)
    fresh = synthetic(power_law(700), vary="length")
    assert points(fresh)["sweep-1024-0"] == 1024


def test_each_point_has_its_median_ratio_and_interval() -> None:
    rec = synthetic(power_law(700))
    table = point_table(rec, "A", "B")
    assert table["x"].tolist() == GRID and table["n"].tolist() == [4] * 4  # 2 prompts x 2 rounds
    for row in table.itertuples():
        exact = (row.x / 700) ** 0.5
        assert row.median_ratio == pytest.approx(exact)
        assert row.ci_low < exact < row.ci_high and row.ci_low >= exact * 0.97 and row.ci_high <= exact * 1.03
    assert table["verdict"].tolist() == ["faster", "faster", "slower", "slower"]


# -------------------------------------------------------------------------------------- crossover


@pytest.mark.parametrize("x_star, bracket", [(700, (256, 1024)), (100, (64, 256)), (3000, (1024, 4096))])
def test_the_crossover_is_where_the_ratio_crosses_one(x_star: float, bracket: tuple[int, int]) -> None:
    c = crossover(synthetic(power_law(x_star)), "A", "B")
    assert c.status == "crossing" and c.estimate == pytest.approx(x_star, rel=1e-9)
    (k,) = c.crossings
    assert (k.lo, k.hi, k.a_faster_below, k.n) == (*bracket, True, 4)
    # the interval: medians of resampled pairs at the two bracketing points, each within 3% of the truth, so
    # the crossing within 3% / 0.5 (the log-log slope) = 6% of it
    assert c.low < x_star < c.high
    assert c.low > x_star / 1.07 and c.high < x_star * 1.07
    assert "cross at" in c.summary and f"{x_star:.0f}" in c.summary
    assert "n=4 pairs at a bracketing point" in (c.note or "")  # fewer than 5: said plainly


def test_a_steeper_ratio_narrows_the_crossover() -> None:
    gentle = crossover(synthetic(power_law(700, 0.25)), "A", "B")
    steep = crossover(synthetic(power_law(700, 1.0)), "A", "B")
    assert gentle.estimate == pytest.approx(700) == steep.estimate
    assert (steep.high - steep.low) < (gentle.high - gentle.low)


def test_log_linear_interpolation_between_the_bracketing_points() -> None:
    # y = log ratio: -0.2 at 256 and +0.6 at 1024: a quarter of the way in log x
    c = locate([256, 1024], [np.array([math.exp(-0.2)]), np.array([math.exp(0.6)])])
    assert c.estimate == pytest.approx(256 * 4 ** 0.25)
    assert c.low is None and c.high is None and not c.has_interval  # one pair per point: no interval
    assert judge_crossover(c, ">=", 100)[0] == "inconclusive"


def test_no_crossing_puts_the_crossover_beyond_the_swept_range() -> None:
    above = crossover(synthetic(lambda x: 0.5), "A", "B")  # A faster everywhere: it crosses above the grid
    assert (above.status, above.low, above.high) == ("above", 4096.0, math.inf)
    assert judge_crossover(above, ">=", 512) == ("pass", "")
    assert judge_crossover(above, "<=", 1000)[0] == "fail"
    assert judge_crossover(above, ">=", 5000)[0] == "inconclusive"
    below = crossover(synthetic(lambda x: 2.0), "A", "B")  # A slower everywhere: it crosses below the grid
    assert (below.status, below.low, below.high) == ("below", 0.0, 64.0)
    assert judge_crossover(below, ">=", 512)[0] == "fail" and judge_crossover(below, "<=", 64)[0] == "pass"
    assert refinement_point(above, 0.25) is None and refinement_point(below, 0.25) is None


def test_a_crossing_the_other_way_and_several_crossings() -> None:
    rev = crossover(synthetic(power_law(700, -0.5)), "A", "B")  # A slower below, faster above
    assert rev.status == "crossing" and rev.estimate == pytest.approx(700) and not rev.crossings[0].a_faster_below
    assert "faster above" in rev.summary
    wander = {64: 0.9, 256: 1.1, 1024: 0.9, 4096: 1.2}
    several = crossover(synthetic(lambda x: wander[x]), "A", "B")
    assert several.status == "several" and several.estimate is None and len(several.crossings) == 3
    assert several.low <= several.crossings[0].low and several.high >= several.crossings[-1].high
    assert judge_crossover(several, ">=", several.low)[0] == "pass"
    assert judge_crossover(several, ">=", several.high)[0] == "inconclusive"


def test_refinement_bisects_the_bracket_until_interval_and_bracket_are_narrow() -> None:
    c = crossover(synthetic(power_law(700)), "A", "B")
    assert refinement_point(c, 0.25) == 512  # sqrt(256 * 1024): the bracket is 1.1x the crossover wide
    # after that point the bracket is 512-1024 (0.73x wide); then 724, whose bracket 512-724 is 0.30x wide
    c2 = crossover(synthetic(power_law(700), [64, 256, 512, 1024, 4096]), "A", "B")
    assert (c2.crossings[0].lo, c2.crossings[0].hi) == (512, 1024) and refinement_point(c2, 0.25) == 724
    c3 = crossover(synthetic(power_law(700), [64, 256, 512, 724, 1024, 4096]), "A", "B")
    assert refinement_point(c3, 0.25) == 609 and refinement_point(c3, 0.35) is None
    assert c3.estimate == pytest.approx(700)
    # adjacent token counts: nothing lies between them
    tight = locate([700, 701], [np.array([0.99, 0.98]), np.array([1.01, 1.02])])
    assert refinement_point(tight, 1e-9) is None


def test_few_pairs_at_a_bracketing_point_carry_a_note() -> None:
    c = crossover(synthetic(power_law(700), per_point=1), "A", "B")  # 2 pairs a point
    assert c.has_interval and c.crossings[0].n == 2 and "too few" in (c.note or "")


# ------------------------------------------------------------------------------------------ checks


def test_crossover_checks_are_judged_on_the_interval() -> None:
    rec = synthetic(power_law(700), checks=["crossover[A, B] >= 512", "crossover[A, B] >= 800",
                                            "crossover[A, B] >= 700", "crossover[A, B] <= 1000"])
    verdict = {c.name: c for c in an.gate(rec).checks}
    assert verdict["crossover[A, B] >= 512"].result == "pass"
    assert verdict["crossover[A, B] >= 800"].result == "FAIL"
    assert verdict["crossover[A, B] >= 700"].result == "inconclusive"
    assert verdict["crossover[A, B] <= 1000"].result == "pass"
    assert "suffix: 700 (95% CI" in verdict["crossover[A, B] >= 512"].detail
    (cell,) = judge(rec, parse_check("crossover[A, B] >= 512"))
    assert (cell.kind, cell.tokens, cell.n, cell.rounds) == ("suffix", None, 16, 2)


def test_a_crossover_check_without_a_sweep_or_pairs_fails() -> None:
    rec = synthetic(power_law(700))
    rec.profile.pop("sweep")
    assert judge(rec, parse_check("crossover[A, B] >= 1")) == []
    rec = synthetic(power_law(700))
    assert judge(rec, parse_check("crossover[B, A] >= 1"))  # the other order has pairs too (ratio B / A)
    assert judge(synthetic(power_law(700), arms={"C": lambda x: 2.0}), parse_check("crossover[C, A] >= 1"))


def test_vs_the_fastest_of_several_arms_pairs_per_cell() -> None:
    # B takes 1 s everywhere, C 1 ms per token: C is the faster at 64 and 256, B at 1024 and 4096
    fast = {"C": lambda x: x / 1000}
    near = synthetic(lambda x: 1.02 * min(1.0, x / 1000), vary="length", arms=fast)  # 2% above the faster
    cells = judge(near, parse_check("ttft_ratio[A, fresh, vs B|C] <= 1.1"))
    assert [c.tokens for c in cells] == GRID and all(c.status == "pass" for c in cells)
    assert [c.value for c in cells] == pytest.approx([1.02] * 4)
    assert [c.value for c in judge(near, parse_check("ttft_ratio[A, fresh, vs B] <= 1.05"))] == \
        pytest.approx([0.06528, 0.26112, 1.02, 1.02])
    assert [c.value for c in judge(near, parse_check("ttft_ratio[A, fresh, vs C] <= 1.05"))] == \
        pytest.approx([1.02, 1.02, 1.02 / 1.024, 1.02 / 4.096])
    far = synthetic(lambda x: 1.25 * min(1.0, x / 1000), vary="length", arms=fast)  # 25% above the faster
    assert [c.status for c in judge(far, parse_check("ttft_ratio[A, fresh, vs B|C] <= 1.1"))] == ["fail"] * 4
    assert [c.status for c in judge(far, parse_check("ttft_ratio[A, fresh, vs B] <= 1.1"))] == \
        ["pass", "pass", "fail", "fail"]


def test_the_grammar_of_two_arm_and_fastest_of_checks() -> None:
    c = parse_check("crossover[demand, chunked] >= 512")
    assert (c.metric, c.arm, c.vs, c.vs_arms, c.name) == ("crossover", "demand", "chunked", ("chunked",),
                                                          "crossover[demand, chunked] >= 512")
    f = parse_check("ttft_ratio[auto, continuation, vs demand|chunked | layer-major] <= 1.05")
    assert f.vs_arms == ("demand", "chunked", "layer-major")
    assert f.name == "ttft_ratio[auto, continuation, vs demand|chunked|layer-major] <= 1.05"
    for bad, words in [("crossover[demand] >= 1", "two arms and nothing else"),
                       ("crossover[a, b, fresh] >= 1", "two arms and nothing else"),
                       ("crossover[a, a] >= 1", "named twice"),
                       ("crossover[a, b] == 1", "judged on an interval"),
                       ("peak_vram_ratio[a, vs b|c] <= 1", "for ttft_ratio only"),
                       ("ttft_ratio[a, vs b|b] <= 1", "distinct arms")]:
        with pytest.raises(ConfigError, match=words):
            parse_check(bad)
    with pytest.raises(ConfigError, match="unknown arm 'x'"):
        check_arms([parse_check("ttft_ratio[a, vs b|x] <= 1")], ["a", "b"], "b", "test")
    with pytest.raises(ConfigError, match="the arm it is compared with"):
        check_arms([parse_check("ttft_ratio[a, vs b|a] <= 1")], ["a", "b"], "b", "test")
    kept = checks_within(["crossover[a, b] >= 1", "crossover[a, c] >= 1", "ttft_ratio[a, vs b|c] <= 1"],
                         ["a", "b"], "b")
    assert kept == ["crossover[a, b] >= 1"]


# -------------------------------------------------------------------------------------------- JSON


def test_the_summary_is_json_with_every_point_and_the_crossover() -> None:
    import json

    rec = synthetic(power_law(700))
    s = json.loads(json.dumps(sweep_summary(rec)))
    assert s["vary"] == "suffix" and s["quantity"] == "uncached suffix tokens"
    (pair,) = s["pairs"]
    assert (pair["a"], pair["b"]) == ("A", "B") and [p["x"] for p in pair["points"]] == GRID
    assert pair["crossover"]["status"] == "crossing" and pair["crossover"]["estimate"] == pytest.approx(700)
    above = json.loads(json.dumps(sweep_summary(synthetic(lambda x: 0.5))))
    assert above["pairs"][0]["crossover"]["high"] is None and above["pairs"][0]["crossover"]["status"] == "above"
    assert len(analyze_sweep(rec)) == 1
    plain = synthetic(power_law(700))
    plain.profile.pop("sweep")
    assert sweep_summary(plain) == {} and analyze_sweep(plain) == []


def test_a_resample_crossing_outside_the_bracket_widens_the_interval() -> None:
    """Noisy pairs at the two bracketing points (1024: median 0.98; 4096: median 1.02, each spread over
    0.90-1.10): many resamples put both medians on one side of 1, so their crossing lies elsewhere in the swept
    range (below 1024 or above 4096). Those must widen the interval, clipped only to the swept range
    [64, 65536], never into the bracket [1024, 4096] of the point estimate."""
    xs = [64, 1024, 4096, 65536]
    ratios = [np.array([0.5, 0.52, 0.48, 0.5, 0.51]), np.array([0.90, 0.95, 0.98, 1.02, 1.05]),
              np.array([0.95, 0.98, 1.02, 1.05, 1.10]), np.array([2.0, 2.1, 1.9, 2.0, 2.05])]
    c = locate(xs, ratios)
    assert c.status == "crossing" and c.has_interval
    (k,) = c.crossings
    assert (k.lo, k.hi) == (1024, 4096) and 1024 < c.estimate < 4096
    assert c.low < 1024 or c.high > 4096, (c.low, c.high)  # resamples outside the bracket count
    assert c.low < 1024 * 0.8 and c.high > 4096 * 1.25, (c.low, c.high)  # here, on both sides
    assert c.low == pytest.approx(64) and c.high == pytest.approx(65536)  # clipped to the swept range, no further
