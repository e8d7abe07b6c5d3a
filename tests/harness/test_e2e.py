"""End to end: the default cpu-tiny profile against the vendored engine, through the real CLI.

`abbench run` (a process of its own, as the README runs it) -> results directory -> `abbench report` ->
`abbench gate` passes; then one changed output id makes the gate fail, naming the prompt, the arm and the
position. Report and gate go through the same CLI in this process (tests/support/cli.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cli

pytestmark = pytest.mark.slow


def abbench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "abbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`abbench run`'s own example from its --help (the default profile), into a directory of its own, one round
    (its properties below hold per round; the default's two rounds run after the suite in .ci/run, as the README's
    main job, with their gate)."""
    from tests.harness.test_help_examples import examples

    (argv, code, _), *load = examples("run")  # the others run the load profile (tests/harness/test_load_run_engine.py)
    assert argv == ["run"] and code == 0 and all("cpu-tiny-load" in a for a, _, _ in load)
    work = tmp_path_factory.mktemp("e2e")
    run_dir = work / "run"
    res = abbench(*argv, "--rounds", "1", "--out", str(run_dir), "--quiet", "--no-report", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


def test_run_writes_complete_results(tiny_run: Path) -> None:
    record = json.loads((tiny_run / "run.json").read_text())
    assert record["status"] == "complete"
    assert record["profile"]["name"] == "cpu-tiny"
    lines = (tiny_run / "requests.jsonl").read_text().splitlines()
    assert len(lines) == len(record["plan"]) == len(record["samples"])
    samples = [json.loads(x) for x in lines]
    assert all(s["ok"] for s in samples), [s["error"] for s in samples if not s["ok"]]
    # Exact-length prompts: the server counted exactly the target for every prompt.
    targets = {p["id"]: p["target_tokens"] for p in record["prompts"]}
    assert all(s["prompt_tokens"] == targets[s["prompt_id"]] for s in samples)
    # Native ids from the engine, and the path each arm asked for actually ran on multi-chunk prompts.
    assert all(s["ids_source"] == "native" and len(s["output_ids"]) == 16 for s in samples)
    for s in samples:
        if s["kind"] == "fresh":
            assert s["engine"]["prefill_path"] == s["arm"]
    # One log per service (3 arms x 1 round).
    assert len(list((tiny_run / "logs").glob("*.log"))) == 3


def test_report_and_gate_pass(tiny_run: Path, tmp_path: Path) -> None:
    res = cli.abbench("report", str(tiny_run), "--out", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "run.md").read_text()
    for section in ("## Verdict", "## TTFT per arm and prompt length", "## Paired ratios", "## Parity",
                    "## Host-to-device transfers"):
        assert section in md
    assert (tmp_path / "run" / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gate = cli.abbench("gate", str(tiny_run), "--parity-tokens", "8", cwd=tmp_path)
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "gate: PASS" in gate.stdout


def test_gate_fails_on_a_changed_id(tiny_run: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    record = json.loads((tiny_run / "run.json").read_text())
    victim = next(s for s in record["samples"] if s["arm"] == "layer-major" and s["kind"] == "fresh")
    victim["output_ids"][5] += 1
    (broken / "run.json").write_text(json.dumps(record))
    with open(broken / "requests.jsonl", "w") as f:
        for s in record["samples"]:
            f.write(json.dumps(s) + "\n")
    gate = cli.abbench("gate", str(broken), cwd=tmp_path)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert "gate: FAIL" in gate.stdout
    assert victim["prompt_id"] in gate.stdout and "layer-major" in gate.stdout
    assert "token 5 differs" in gate.stdout


def test_gate_usage_error_is_exit_2(tmp_path: Path) -> None:
    res = cli.abbench("gate", str(tmp_path / "nothing-here"), cwd=tmp_path)
    assert res.returncode == 2
    assert "no run at" in res.stderr
