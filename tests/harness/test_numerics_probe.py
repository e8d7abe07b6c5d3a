"""The numerics probe (``abbench probe RUN --numerics``) on a committed CPU run of ``cpu-tiny-fp8``
(``results/20261205t-cpu-tiny-fp8``): the vendored engine's bf16 arm (the run's parity reference) and its FP8 arm,
each served once from the run's recorded profile, asked for their whole distributions."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

pytest.importorskip("torch")

from abbench.client import EngineClient  # noqa: E402
from abbench.diagnostics.layers import serving  # noqa: E402
from abbench.diagnostics.numerics_probe import (  # noqa: E402
    format_numerics_summary,
    probe_numerics,
    probe_numerics_prompts,
)
from abbench.profile import profile_from_dict  # noqa: E402
from abbench.results import load_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "results" / "20261205t-cpu-tiny-fp8"


def test_the_full_kl_is_at_least_the_runs_bound_and_zero_against_itself(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from abbench.cli import app

    record, _ = load_run(RUN, REPO / "results")
    profile = profile_from_dict(record.profile)
    with EngineClient() as client, contextlib.ExitStack() as stack:
        urls = {arm: stack.enter_context(serving(profile, arm, client)) for arm in ("bf16", "fp8")}
        got = probe_numerics(record, "fresh-256-0", "fp8", base_urls=urls, positions=3)
        assert (got.reference, got.vocab, got.k, len(got.steps)) == ("bf16", 151936, 20, 3)
        # FP8's rounding moves every distribution; the run's top-20 bucket bound is a lower bound of it
        assert all(s.kl > 0 and 0 <= s.kl_topk <= s.kl + 1e-12 for s in got.steps), got.steps
        assert [s.ref_id for s in got.steps] == next(
            s.output_ids[:3] for s in record.samples if s.arm == "bf16" and s.prompt_id == "fresh-256-0")
        itself = probe_numerics(record, "fresh-256-0", "bf16", base_urls=urls, positions=2)
        assert [(s.kl, s.kl_topk, s.same_top, s.delta_p) for s in itself.steps] == [(0.0, 0.0, 1, 0.0)] * 2
        # several prompts on the same two services: each prompt's histories from its own reference output
        both = probe_numerics_prompts(record, ["fresh-256-0", "fresh-512-0"], "fp8", base_urls=urls, positions=2)
        assert [b.prompt_id for b in both] == ["fresh-256-0", "fresh-512-0"] and both[0].steps[:2] == got.steps[:2]
        summary = format_numerics_summary(both)
        assert "2 prompts" in summary and "every compared position (4): mean KL over the whole vocabulary" in summary
        monkeypatch.chdir(tmp_path)
        r = CliRunner().invoke(app, ["probe", str(RUN), "--arm", "fp8", "--numerics", "--positions", "1",
                                     "--base-url", urls["fp8"], "--ref-base-url", urls["bf16"]])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "--prompt fresh-256-0: arm fp8's first measured prompt" in out and "151,936 ids" in out
    assert f"mean KL over the whole vocabulary {got.steps[0].kl:.4e} nats" in out
