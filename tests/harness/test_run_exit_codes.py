"""``abbench run``'s exit code and last line: 1 when a measured sample failed, 0 when none did, and the gate's
verdict line (``gate: PASS`` / ``gate: FAIL``, as ``abbench gate`` prints it) at the end either way; a parity
row with no sample of another arm to compare is "not checked" and fails the gate, while a run of one arm has
nothing to compare and passes. The engine is tests/support/fakeserver.py, launched by the real command line."""

from __future__ import annotations

from pathlib import Path

from abbench import analysis, runner
from abbench.profile import profile_from_dict
from abbench.results import load_run

from tests.support import cli
from tests.support import faultkit as fk


def _run(tmp_path: Path, arms: list[dict]) -> tuple[int, str, str, Path]:
    mark = fk.new_mark()
    toml = fk.write_profile(tmp_path / "p.toml", fk.fake_profile(mark, arms=arms, prompts={"warmup": 0}))
    out = tmp_path / "run"
    res = cli.abbench("run", "-p", str(toml), "--out", str(out), "-q", "--no-report", cwd=tmp_path)  # in this process
    fk.assert_no_leftovers(mark)
    return res.returncode, res.stdout, fk.flat(res.stderr), out


def test_a_failed_measured_sample_exits_1_and_the_gate_says_parity_was_not_checked(tmp_path: Path) -> None:
    code, stdout, err, out = _run(tmp_path, [{"name": "a"}, {"name": "b", "request": {"fake_mode": "http-500"}}])
    assert code == 1, err
    assert "run complete: 2 samples (1 ok)" in err and "1 measured sample(s) failed" in err
    assert f"resume it with `abbench run --resume {out}` to run their steps again" in err
    lines = stdout.strip().splitlines()
    assert lines[-1] == "gate: FAIL"
    assert "not checked parity: not checked: no sample of b to compare with the reference a" in lines
    record, _ = load_run(out)
    parity = next(c for c in analysis.gate(record).checks if c.name == "parity")
    assert parity.result == "not checked" and not parity.passed


def test_every_sample_ok_exits_0_and_ends_with_the_verdict(tmp_path: Path) -> None:
    code, stdout, err, _ = _run(tmp_path, [{"name": "a"}, {"name": "b"}])
    assert code == 0, err
    assert stdout.strip().splitlines()[-1] == "gate: PASS"


def test_one_arm_has_nothing_to_compare_and_passes(tmp_path: Path) -> None:
    mark = fk.new_mark()
    record = runner.execute(profile_from_dict(fk.fake_profile(mark, prompts={"warmup": 0})), tmp_path / "run")
    fk.assert_no_leftovers(mark)
    verdict = analysis.gate(record)
    parity = next(c for c in verdict.checks if c.name == "parity")
    assert verdict.passed and parity.result == "pass" and parity.detail == "no non-reference sample to compare"
