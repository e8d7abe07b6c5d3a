"""Mutation audit: would the test suite notice a plausible bug?

Each mutant in :data:`MUTANTS` is one small, plausible slip (a comparison the wrong way, a point estimate
where an interval belongs, a filter dropped, a rounding the wrong way) planted in one source file. The script
copies the project (the working tree's tracked and untracked, not ignored, files) into a temporary directory
(a git checkout of its own), checks that the copy imports and that the tests it will use pass unmutated,
then, one mutant at a time: plants it, runs the tests a developer would run for that module (``tests``,
stage 1, not the slow ones) and, for a mutant that survives them, the whole suite (stage 2, slow tests
included: what CI runs). With ``--map``, stage 2 runs only the suite's test files that run the mutated lines,
from a coverage map of the whole suite made once (:mod:`coverage_map`): a test that never runs a line cannot
notice a change to it, so this catches what the whole suite catches, in minutes instead of an hour a
mutant. The file is restored after every mutant. A mutant is *killed* when a test fails or errors (a hung
test fails after pytest-timeout's 300 s) and *survives* when every test passes; a kill by a test that fails
without the mutant too, or a stage that runs past ``--timeout``, is *inconclusive*. A mutant found to be
equivalent (no behaviour can tell it apart: e.g. a guard its only caller repeats) says why in its
``equivalent`` note; it is still planted, and its survival is reported as equivalent.

Not collected by pytest (the name does not start with ``test_``). Run from the repository root::

    python tests/audit/mutation_audit.py --map map.json --out audit.json   # every mutant
    python tests/audit/mutation_audit.py --only O1,A3 --map map.json      # some mutants
    python tests/audit/mutation_audit.py --resume --map map.json --out audit.json   # after an interruption
    python tests/audit/mutation_audit.py --tests-from REF --out before.json # the tests of an older commit
    python tests/audit/mutation_audit.py --check                          # every mutant still applies

``--tests-from REF`` replaces the copy's ``tests/`` with the one at git commit REF (the source stays the
working tree's), which measures how much an older suite would have caught. Results go to ``--out`` (JSON:
one object per mutant, and the tests deselected because they failed unmutated) and a Markdown table on
stdout. Subprocesses the tests start (``python -m abbench``, engine services) import the copy:
``PYTHONPATH`` points at it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coverage_map  # noqa: E402  (this folder's helper)

REPO = Path(__file__).resolve().parents[2]

# The tests a developer runs for each part (stage 1). Files missing from the suite under audit are skipped.
ANALYSIS = ["tests/harness/test_analysis.py", "tests/harness/test_declared.py", "tests/harness/test_latency.py",
            "tests/harness/test_verdict_properties.py", "tests/harness/test_figure_properties.py"]
REPORT = ["tests/harness/test_report.py", "tests/harness/test_report_decode.py",
          "tests/harness/test_verdict_properties.py", "tests/harness/test_figure_properties.py"]
COMPARE = ["tests/harness/test_compare.py", "tests/harness/test_verdict_properties.py"]
RUNNER = ["tests/harness/test_faults_harness.py", "tests/harness/test_resume_refusals.py",
          "tests/harness/test_auto_rounds.py", "tests/harness/test_verdict_properties.py"]
CLIENT = ["tests/harness/test_adapters.py", "tests/harness/test_verdict_properties.py"]
MEMORY = ["tests/engine/test_engine_decode.py", "tests/harness/test_memory_plan_cli.py",
          "tests/engine/test_window_budget.py"]
PREFILL = ["tests/engine/test_engine_prefill.py", "tests/engine/test_window_budget.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    find: str
    replace: str
    tests: list[str]
    what: str
    equivalent: str = ""
    """Why no test can catch it (the change cannot alter anything observable), for a mutant found to be
    equivalent: it is still planted and reported, its survival marked as expected."""


def m(id: str, file: str, find: str, replace: str, tests: list[str], what: str, equivalent: str = "") -> Mutant:
    return Mutant(id, f"abbench/{file}", find, replace, tests, what, equivalent)


MUTANTS: list[Mutant] = [
    # -- the seven behaviours of the issue that filed this audit (planted again to show they are caught)
    m("O1", "compare.py", "beyond = lo > threshold if m.higher_is_worse else hi < -threshold",
      "beyond = change > threshold if m.higher_is_worse else change < -threshold", COMPARE,
      "compare judges a regression on the point change, not its interval"),
    m("O2", "cli/results.py", "    if len(c.regressions):\n", "    if len(c.regressions) > 1:\n", COMPARE,
      "compare exits 0 with exactly one regression"),
    m("O3", "report/sections/parity.py", "worst = max(g[\"verdict\"]", "worst = min(g[\"verdict\"]", REPORT,
      "Verdict per prompt shows the best round, not the worst"),
    m("O4", "runner/run.py", "kind=step.kind, excluded=step.excluded, service=step.service)",
      "kind=step.kind, excluded=step.kind == \"warmup\", service=step.service)", RUNNER,
      "only warm-ups are excluded: the JIT warm-up (and any other excluded kind) is measured"),
    m("O5", "client.py", "    for i in short.streamed_ids:  # each streamed id, in order, among the repeat's\n",
      "    for i in short.streamed_ids:  # each streamed id, in order, among the repeat's\n        pos = 0\n",
      CLIENT, "the llama.cpp refetch checks that streamed ids are present, not that they are in order"),
    m("O6", "engine/prefill.py", "path, window_tokens // chunk_tokens,",
      "path, -(-window_tokens // chunk_tokens),", PREFILL,
      "layer-major windows take the budget rounded up to whole chunks (more tokens than the budget)"),
    m("O7", "engine/memory.py", "parked = min(config.layer_major_window_tokens, config.max_context) * w * item",
      "parked = chunk * w * item", MEMORY, "the memory plan parks one chunk's activations, not a window's"),
    # -- analysis/
    m("A1", "analysis/timing.py", "    if high < 1.0:\n        return \"faster\"",
      "    if low < 1.0:\n        return \"faster\"", ANALYSIS,
      "a ratio is 'faster' when its interval merely reaches below 1"),
    m("A2", "analysis/timing.py", "got = latest.get((ref, pid, rnd)) if ref else None",
      "got = latest.get((ref, pid, 1)) if ref else None", ANALYSIS,
      "pairs an arm's sample with the reference's first round instead of the same round"),
    m("A3", "analysis/timing.py", "\"ref_ttft_s\": rv, \"ratio\": v / rv}", "\"ref_ttft_s\": rv, \"ratio\": rv / v}",
      ANALYSIS, "the paired ratio is inverted (reference / arm)"),
    m("A4", "analysis/frames.py", "            by_step[(s.step, s.arm, s.round, s.prompt_id)] = s",
      "            by_step.setdefault((s.step, s.arm, s.round, s.prompt_id), s)", ANALYSIS,
      "a retried step counts its first ok sample, not the last"),
    m("A5", "analysis/frames.py", "if st.index in by_step and not any(s.ok for s in by_step[st.index])]",
      "if st.index in by_step and not all(s.ok for s in by_step[st.index])]", ANALYSIS,
      "a step retried after a failure (then ok) counts as failed"),
    m("A6", "analysis/checks.py", "if len(comp.failed) > spec.max_failed_samples:",
      "if len(comp.failed) >= spec.max_failed_samples:", ANALYSIS,
      "max_failed_samples tolerates one failure fewer than it says"),
    m("A7", "analysis/checks.py",
      "accepted = mismatch & (rows[\"verdict\"] == \"near-tie flip\").to_numpy(dtype=bool) & _flags(rows[\"accepts\"], True)",
      "accepted = mismatch & (rows[\"verdict\"] == \"near-tie flip\").to_numpy(dtype=bool)", ANALYSIS,
      "the gate accepts near-tie flips without accept_near_ties"),
    m("A8", "analysis/parity.py", "return (first is None or first >= k), first, agree",
      "return (first is None or first >= k - 1), first, agree", ANALYSIS,
      "a divergence at the K-th id (inside the first K) passes parity"),
    m("A9", "analysis/parity.py", "    margin = max(gaps)\n", "    margin = min(gaps)\n", ANALYSIS,
      "a flip is a near tie when either side's gap is small, not both"),
    m("A10", "analysis/paths.py", "eligible = None if n_chunks is None else n_chunks > 1",
      "eligible = None if n_chunks is None else n_chunks >= 1", ANALYSIS,
      "a one-chunk prompt counts as eligible: its legitimate fallback fails the gate"),
    m("A11", "analysis/paths.py", "status == \"fallback\" and (s.arm in allow or eligible is False)",
      "status == \"fallback\" and (s.arm in allow or eligible is not True)", ANALYSIS,
      "a fallback on a prompt of unknown eligibility passes"),
    m("A12", "analysis/declared.py", "ok = ci.high <= c.value if c.op == \"<=\" else ci.low >= c.value",
      "ok = ci.median <= c.value if c.op == \"<=\" else ci.median >= c.value", ANALYSIS,
      "a declared interval check passes on its median alone"),
    m("A13", "checkexpr.py", "\">=\": tokens >= self.tokens,", "\">=\": tokens > self.tokens,", ANALYSIS,
      "a '>=LENGTH' selector leaves out the length itself"),
    m("A14", "analysis/declared.py", "ok, why = hi <= c.value + tol, f\"largest sample",
      "ok, why = med <= c.value + tol, f\"largest sample", ANALYSIS,
      "a '<=' counter check looks at the median sample, not the largest"),
    m("A15", "analysis/declared.py", "    if not cells or any(x.status == \"fail\" for x in cells):",
      "    if any(x.status == \"fail\" for x in cells):", ANALYSIS,
      "a declared check that selects no cell passes (the gate passes on missing data)",
      equivalent="overall() is called only by checks.declared_check, which fails a check with no cell before "
                 "it reads overall's answer (tests/harness/test_declared.py::test_a_selector_with_no_data_fails)"),
    m("A16", "analysis/transfer.py", "floor = (bank * windows / (gbps.where(gbps > 0) * 1e9)).dropna()",
      "floor = (bank / (gbps.where(gbps > 0) * 1e9)).dropna()", ANALYSIS,
      "the copy floor is one bank whatever the number of layer-major windows"),
    m("A17", "analysis/decode.py", "steps = (df[\"completion_tokens\"] - 1).where(df[\"completion_tokens\"] > 1)",
      "steps = df[\"completion_tokens\"].where(df[\"completion_tokens\"] > 1)", ANALYSIS,
      "seconds per decode step divide by every output token, the first (prefill's) included"),
    m("L1", "analysis/latency.py", "    t = np.unique(np.asarray(s.token_times_s, dtype=float))",
      "    t = np.asarray(s.token_times_s, dtype=float)", ANALYSIS,
      "tokens that arrive in one network chunk count as zero inter-token latencies"),
    # -- report/
    m("R1", "report/sections/timing.py", "return f\"{1 / r.median_ratio:.2f}x faster\"",
      "return f\"{r.median_ratio:.2f}x faster\"", REPORT, "'2.00x faster' is printed as '0.50x faster'"),
    m("R2", "report/format.py", "        return f\"{x / 2**30:.2f} GiB\"", "        return f\"{x / 1e9:.2f} GiB\"",
      REPORT, "GiB printed from decimal GB"),
    m("R3", "report/sections/parity.py", "\"match\": int((g[\"match\"] == True).sum()),",
      "\"match\": int((g[\"match\"] != False).sum()),", REPORT,
      "parity summary counts unchecked rows as matches",
      equivalent="the parity frame's match column is pandas' nullable boolean (analysis.frames.frame): an "
                 "unchecked row's <NA> != False is <NA>, which sum() skips, so it counts as == True does "
                 "(tests/harness/test_figure_properties.py::test_an_unchecked_row_is_not_a_match pins the count)"),
    m("R4", "report/sections/summary.py", "    if record.status != \"complete\":\n        items.append(f\"run status is",
      "    if record.status == \"partial\":\n        items.append(f\"run status is", REPORT,
      "a run that never finished (status running) is not listed as a problem"),
    m("R5", "report/format.py", "if drop_constant and c.descriptive and len(df) > 1 and",
      "if drop_constant and c.descriptive and len(df) >= 1 and", REPORT,
      "a one-row table moves its descriptive columns above it"),
    # -- compare
    m("C1", "compare.py", "same = bool(vb.size == vc.size and np.array_equal(np.sort(vb), np.sort(vc))",
      "same = bool(np.median(vb) == np.median(vc)", COMPARE,
      "runs with equal medians are 'same' whatever their samples"),
    m("C2", "compare.py", "MetricSpec(\"decode_tok_s\", \"Decode tok/s\", False, ",
      "MetricSpec(\"decode_tok_s\", \"Decode tok/s\", True, ", COMPARE,
      "a higher decode rate is judged worse (a lower one never regresses)"),
    m("C3", "cli/results.py", "        c = compare_runs(rb, rc, threshold=threshold)\n", "        c = compare_runs(rb, rc)\n",
      COMPARE, "compare --threshold is ignored"),
    m("C4", "compare.py", "fields = sorted(k for k in tb.keys() | tc.keys() if tb.get(k) != tc.get(k))",
      "fields = sorted(k for k in tb.keys() & tc.keys() if tb.get(k) != tc.get(k))", COMPARE,
      "a tokenizer field recorded in one run only is not a difference"),
    m("C5", "compare.py", "            n = min(vb.size, vc.size)\n", "            n = max(vb.size, vc.size)\n", COMPARE,
      "a cell judged when only one run has enough samples"),
    # -- runner/
    m("U1", "runner/rounds.py", "widest = max(known) if known and len(known) == len(w) else None",
      "widest = max(known) if known else None", RUNNER,
      "auto rounds stop while a cell still has no interval"),
    m("U2", "runner/rounds.py", "    elif rounds_done >= int(r.max_rounds or 0):",
      "    elif rounds_done > int(r.max_rounds or 0):", RUNNER, "auto rounds run one round past max_rounds"),
    m("U3", "runner/run.py", "    warm = [s for s in before if s.kind in WARMUP_KINDS]", "    warm = []", RUNNER,
      "a service relaunched mid-block is not warmed up before its next measured step"),
    m("U4", "runner/run.py", "        elif policy == \"restart\":\n            self.slot.stop()",
      "        elif policy == \"restart\":\n            pass", RUNNER,
      "on_request_failure = restart does not restart the service"),
    m("U5", "runner/run.py", "if e.kind in (\"connect\", \"timeout\") and not self._healthy(svc, step.arm):",
      "if e.kind == \"connect\" and not self._healthy(svc, step.arm):", RUNNER,
      "a service that stops answering after a timeout is not relaunched"),
    m("U6", "runner/resume.py", "    if old != new:\n", "    if old.keys() != new.keys():\n", RUNNER,
      "a resume accepts prompts rebuilt with other text under the same ids"),
    m("U7", "runner/slot.py", "log_name = (f\"{key}.log\" if n == 0 else f\"{key}.restart{n}.log\")",
      "log_name = (f\"{key}.log\")", RUNNER, "a relaunched service overwrites the first launch's log"),
    m("U8", "runner/run.py", "        done = {s.step for s in self.record.samples}\n",
      "        done = {s.step for s in self.record.samples if s.ok}\n", RUNNER,
      "a resumed run repeats steps that failed (the contract: no step is repeated)"),
    # -- engine/memory.py and prefill.py
    m("M1", "engine/memory.py", "    if slots < k or slots > fit:\n", "    if slots < k:\n", MEMORY,
      "an explicit expert_slots_per_layer is not checked against the budget"),
    m("M2", "engine/memory.py", "fit = max(0, (int(budget_bytes) - fixed) // plan[\"slot_bytes\"])",
      "fit = max(0, -(-(int(budget_bytes) - fixed) // plan[\"slot_bytes\"]))", MEMORY,
      "slots per layer rounded up: the plan exceeds its budget"),
    m("P1", "engine/prefill.py", "if all(b - a > demand_max_tokens for a, b in chunks):",
      "if any(b - a > demand_max_tokens for a, b in chunks):", PREFILL,
      "demand falls back to chunked when any chunk is long, not when every chunk is"),
    m("P2", "engine/prefill.py", "        if b - a <= demand_max_tokens:\n", "        if b - a < demand_max_tokens:\n",
      PREFILL, "a chunk of exactly demand_max_tokens streams the whole bank"),
]


# ------------------------------------------------------------------------------------------- the copy


def project_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                         capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and (root / p).is_file()]


def make_copy(dest: Path, tests_from: str | None) -> None:
    for rel in project_files(REPO):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    if tests_from:
        shutil.rmtree(dest / "tests")
        archive = subprocess.run(["git", "-C", str(REPO), "archive", tests_from, "tests"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    # a checkout of its own, as the tests expect (the environment fingerprint reads its commit)
    ident = {"GIT_AUTHOR_NAME": "audit", "GIT_AUTHOR_EMAIL": "audit@localhost", "GIT_COMMITTER_NAME": "audit",
             "GIT_COMMITTER_EMAIL": "audit@localhost"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "audit copy"]):
        subprocess.run(["git", "-C", str(dest), *cmd], check=True, env={**os.environ, **ident})


def env_for(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200"}


def sanity(copy: Path) -> None:
    got = subprocess.run([sys.executable, "-c", "import abbench; print(abbench.__file__)"], cwd=copy,
                         env=env_for(copy), capture_output=True, text=True, check=True).stdout.strip()
    if not got.startswith(str(copy)):
        raise SystemExit(f"the copy does not import its own abbench ({got}); is PYTHONPATH honoured?")


# ------------------------------------------------------------------------------------------ the runs


@dataclass
class Outcome:
    id: str
    what: str
    file: str
    status: str = "survived"  # killed | survived | inconclusive | not applicable
    stage: str = ""  # where it was killed: targeted | suite
    detail: str = ""
    seconds: float = 0.0
    stages: list[dict] = field(default_factory=list)
    equivalent: str = ""  # the mutant's note: why it cannot be caught


def pytest_cmd(files: list[str] | None, *, slow: bool, workers: int, first_failure: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", *(["-x"] if first_failure else []), "-p", "no:cacheprovider",
           "-n", str(workers), "--timeout", "300"]
    if not slow:
        cmd += ["-m", "not slow"]
    cmd += [f"--deselect={node}" for node in DESELECTED]
    cmd += ["tests"] if files is None else files
    return cmd


CMAP: coverage_map.Map | None = None
"""The suite's coverage map (:mod:`coverage_map`), when stage 2 uses it."""
DESELECTED: list[str] = []
"""Tests that failed in the unmutated copy (:func:`baseline`): left out of every run, and listed."""


def run_tests(copy: Path, cmd: list[str], timeout: float) -> tuple[str, str, float]:
    """(killed | survived, the first failure's line (``FAILED node - message``), seconds)."""
    status, detail, secs, _ = run_tests_nodes(copy, cmd, timeout)
    return status, detail, secs


def run_tests_nodes(copy: Path, cmd: list[str], timeout: float) -> tuple[str, str, float, list[str]]:
    """:func:`run_tests` and the ids of every failing test; "inconclusive" when the run exceeds ``timeout``
    (every process it started is ended: the run is its own session)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "inconclusive", f"the run exceeded {timeout:.0f} s", time.monotonic() - t0, []
    res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    secs = time.monotonic() - t0
    out = res.stdout + res.stderr
    if res.returncode == 0:
        return "survived", "", secs, []
    lines = [x for x in out.splitlines() if x.startswith(("FAILED", "ERROR"))]
    first = "; ".join(x[:300] for x in lines[:5]) if lines else (out.strip().splitlines() or ["(no output)"])[-1]
    nodes = [n for n in (failing_node(x) for x in lines) if n]
    return "killed", f"rc {res.returncode}: {first}", secs, nodes


def present(copy: Path, files: list[str]) -> list[str]:
    return [f for f in dict.fromkeys(files) if (copy / f).is_file()]


def audit_one(copy: Path, mt: Mutant, args: argparse.Namespace) -> Outcome:
    """Plant ``mt``, run its stages until one fails, restore the file. A failing test must fail again with
    the mutant and pass without it to count as a kill: one that passes on a second run with the mutant
    (a timing test on a loaded machine) is set aside and the stage runs again without it; one that fails
    without the mutant makes the outcome inconclusive."""
    out = Outcome(mt.id, mt.what, mt.file, equivalent=mt.equivalent)
    path = copy / mt.file
    original = path.read_text(encoding="utf-8") if path.is_file() else ""
    if original.count(mt.find) != 1:
        out.status, out.detail = "not applicable", f"the code to mutate occurs {original.count(mt.find)} times"
        return out
    mutated = original.replace(mt.find, mt.replace)
    files = present(copy, mt.tests)
    stages: list[tuple[str, list[str] | None, bool, int]] = [("targeted", files, False, min(args.workers, len(files)))]
    if not args.targeted_only:
        if CMAP is None:  # the whole suite
            stages.append(("suite", None, True, args.workers))
        else:  # the whole suite's files that run the mutated lines
            first = original.count("\n", 0, original.index(mt.find)) + 1
            lines = range(first, first + mt.find.rstrip("\n").count("\n") + 1)
            running = present(copy, coverage_map.tests_for(CMAP, mt.file, lines))
            out.stages.append({"stage": "suite", "files": running})
            if not running:
                out.detail = "no test runs the mutated line"
                return out
            stages.append(("suite", running, True, min(args.workers, len(running))))
    flaky: list[str] = []
    try:
        for name, stage_files, slow, workers in stages:
            for _attempt in range(3):
                path.write_text(mutated, encoding="utf-8")
                cmd = pytest_cmd(stage_files, slow=slow, workers=workers) + [f"--deselect={n}" for n in flaky]
                status, detail, secs = run_tests(copy, cmd, args.timeout)
                out.seconds += secs
                out.stages.append({"stage": name, "status": status, "seconds": round(secs, 1), "detail": detail})
                node = failing_node(detail) if status == "killed" else None
                if node is None:
                    break
                again, _, secs = run_tests(copy, pytest_cmd([node], slow=True, workers=0), args.timeout)
                out.seconds += secs
                if again == "killed":  # it fails again with the mutant: now without it
                    path.write_text(original, encoding="utf-8")
                    clean, why, secs = run_tests(copy, pytest_cmd([node], slow=True, workers=0), args.timeout)
                    out.seconds += secs
                    if clean != "survived":
                        status, detail = "inconclusive", f"{detail} [fails unmutated too: {why}]"
                    break
                flaky.append(node)  # passed with the mutant on a second run: not evidence
                out.stages[-1]["detail"] += " [passed with the mutant on a second run: set aside]"
            else:
                status, detail = "inconclusive", f"three flaky failures: {', '.join(flaky)}"
            if status != "survived":
                out.status, out.stage, out.detail = status, name, detail
                break
    finally:
        path.write_text(original, encoding="utf-8")
    if flaky:
        out.detail = (out.detail + " " if out.detail else "") + f"(set aside as flaky: {', '.join(flaky)})"
    return out


def failing_node(detail: str) -> str | None:
    """The test id in a 'rc N: FAILED tests/x.py::test - message' line."""
    words = detail.split()
    return next((w for w in words if w.startswith("tests/") and "::" in w), None)


def baseline(copy: Path, mutants: list[Mutant], args: argparse.Namespace) -> None:
    """Run every targeted test before anything is planted: one that fails there (a kill would mean nothing)
    is deselected from every later run and listed; an error that is not a test's (the copy does not even
    collect) stops the audit."""
    files = sorted({f for mt in mutants for f in present(copy, mt.tests)})
    status, detail, secs, nodes = run_tests_nodes(
        copy, pytest_cmd(files, slow=False, workers=args.workers, first_failure=False), args.timeout * 3)
    print(f"baseline: {len(files)} targeted files {'pass' if status == 'survived' else 'FAIL'} in {secs:.0f} s "
          f"{detail}", flush=True)
    if status != "survived" and not nodes:
        raise SystemExit(f"the unmutated copy fails its targeted tests: {detail}")
    DESELECTED.extend(nodes)
    if nodes:
        print(f"deselected (they fail unmutated): {', '.join(nodes)}", flush=True)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| Mutant | File | Planted bug | Result | Stage | s |", "|---|---|---|---|---|---:|"]
    for o in outcomes:
        result = o.status + (" (equivalent)" if o.equivalent else "")
        lines.append(f"| {o.id} | {o.file} | {o.what} | {result} | {o.stage or '-'} | {o.seconds:.0f} |")
    applied = [o for o in outcomes if o.status != "not applicable"]
    survived = [o for o in applied if o.status == "survived"]
    rate = f"{len(survived)}/{len(applied)} survived ({100 * len(survived) / max(1, len(applied)):.0f}%)"
    equivalent = [o.id for o in survived if o.equivalent]
    if equivalent:
        rate += f", {len(equivalent)} of them equivalent ({', '.join(equivalent)})"
    return "\n".join(lines) + f"\n\n{rate}: {', '.join(o.id for o in survived) or 'none'}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--tests-from", metavar="REF", help="audit the tests/ of this git commit instead")
    ap.add_argument("--targeted-only", action="store_true", help="stage 1 only")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds a stage may run before the mutant is called inconclusive")
    ap.add_argument("--out", type=Path, help="write the outcomes here (JSON)")
    ap.add_argument("--map", type=Path, help="the suite's coverage map (JSON): read when it exists, else built "
                    "and written there; stage 2 then runs the test files that run the mutated lines")
    ap.add_argument("--resume", action="store_true",
                    help="keep the decided outcomes already in --out (and its deselected tests), run the rest")
    ap.add_argument("--check", action="store_true", help="only check that every mutant applies exactly once")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = ap.parse_args(argv)
    chosen = [mt for mt in MUTANTS if not args.only or mt.id in args.only.split(",")]
    if args.check:
        def count(mt: Mutant) -> int:
            path = REPO / mt.file
            return path.read_text(encoding="utf-8").count(mt.find) if path.is_file() else 0

        bad = [(mt.id, mt.file, count(mt)) for mt in chosen if count(mt) != 1]
        print("every mutant applies once" if not bad else f"not applicable: {bad}")
        return 1 if bad else 0
    outcomes: list[Outcome] = []
    if args.resume and args.out and args.out.is_file():
        previous = json.loads(args.out.read_text())
        if previous.get("tests_from") != args.tests_from:
            raise SystemExit(f"{args.out} audited the tests of {previous.get('tests_from')!r}, not {args.tests_from!r}")
        notes = {mt.id: mt.equivalent for mt in MUTANTS}
        outcomes = [Outcome(**{**o, "equivalent": notes.get(o["id"], "")}) for o in previous["outcomes"]
                    if o["status"] in ("killed", "survived")]
        DESELECTED.extend(previous.get("deselected") or [])
    done = {o.id for o in outcomes}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the copy is removed on a plain kill too
    copy = Path(tempfile.mkdtemp(prefix="abbench-audit-"))
    try:
        make_copy(copy, args.tests_from)
        sanity(copy)
        if not (args.resume and done):
            baseline(copy, chosen, args)
        if args.map and not args.targeted_only:
            global CMAP
            if args.map.is_file():
                CMAP = coverage_map.load(args.map)
            else:
                CMAP, line = coverage_map.build(copy, env_for(copy), pytest_cmd(None, slow=True, workers=args.workers,
                                                                                first_failure=False), args.timeout * 4)
                coverage_map.save(CMAP, args.map)
                print(line, flush=True)
        for mt in [x for x in chosen if x.id not in done]:
            o = audit_one(copy, mt, args)
            outcomes.append(o)
            print(f"{o.id}: {o.status} {o.stage} ({o.seconds:.0f} s) {o.detail}", flush=True)
            if args.out:
                args.out.write_text(json.dumps({"tests_from": args.tests_from, "deselected": DESELECTED,
                                                "outcomes": [asdict(x) for x in outcomes]}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(copy, ignore_errors=True)
    print()
    print(table(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
