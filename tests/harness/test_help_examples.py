"""Help that is true: every command's --help shows examples, and every example runs as shown, against the
committed runs, with the exit code its comment states (``# exit N``; 0 otherwise). Commands that launch
services (run, probe) or write a GGUF run in the slow test. And one meaning per option name: an option two
commands share means the same thing in both."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from abbench.cli import app

REPO = Path(__file__).resolve().parents[2]
SLOW = {"probe", "export-gguf"}
E2E = {"run", "sweep"}  # their examples are what tests/harness/test_e2e.py and test_sweep_e2e.py run (with --out,
# --quiet and --no-report added)
NO_EXAMPLES = {"serve"}  # its options are the engine's own (`abbench serve --help` is the engine's help)
cli = CliRunner()


def commands() -> dict:
    return dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def examples(name: str) -> list[tuple[list[str], int, str]]:
    """(argv after `abbench`, expected exit code, the line) of every example in ``abbench NAME --help``."""
    r = cli.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    block = r.stdout.split("Examples:", 1)[1].split("\n\n", 2)[1] if "Examples:" in r.stdout else ""
    out = []
    for line in block.splitlines():
        line = line.strip()
        if not line.startswith("abbench "):
            continue
        command, _, comment = line.partition("#")
        m = re.match(r"\s*exit (\d+)", comment)
        out.append((shlex.split(command)[1:], int(m.group(1)) if m else 0, line))
    return out


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory whose results/ holds the committed runs (linked, never written) and whose
    profiles/ is the repository's."""
    (tmp_path / "results").mkdir()
    for run in (REPO / "results").iterdir():
        if run.is_dir():
            (tmp_path / "results" / run.name).symlink_to(run)
    (tmp_path / "profiles").symlink_to(REPO / "profiles")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_command_shows_examples() -> None:
    for name in commands():
        if name in NO_EXAMPLES:
            continue
        assert examples(name), f"abbench {name} --help shows no example"


def run_examples(names: set[str]) -> dict[str, str]:
    outputs = {}
    for name in sorted(names):
        for argv, code, line in examples(name):
            r = cli.invoke(app, argv)
            assert r.exit_code == code, f"{line}: exit {r.exit_code}\n{r.output}"
            outputs[line] = r.output
    return outputs


def test_the_examples_run(workdir: Path) -> None:
    out = run_examples(set(commands()) - SLOW - E2E - NO_EXAMPLES)
    first = next(v for k, v in out.items() if k == "abbench diff results/chunk-sizes-bf16")
    assert "first divergence: prompt fresh-1024-1, arm chunk96, round 1, output position 7" in first
    assert (workdir / "chunk-sizes.md").is_file() and (workdir / "chunk-sizes").is_dir()  # report --out FILE.md
    assert (workdir / "compare.md").is_file() and (workdir / "samples.csv").is_file()
    assert (workdir / "reports" / "readme-cpu-tiny.html").is_file() and (workdir / "chunk-sizes.html").is_file()
    assert (workdir / "md-only" / "readme-cpu-tiny.md").is_file()  # report --no-html: the Markdown alone
    assert not (workdir / "md-only" / "readme-cpu-tiny.html").exists()


@pytest.mark.slow
def test_the_examples_that_launch_services_run(workdir: Path) -> None:
    out = run_examples(SLOW)
    layers = next(v for k, v in out.items() if "--layers" in k)
    # no --prompt, --arm or --position: the run's first divergence, at output position 7 (whether this CPU's
    # bf16 sums differ there too depends on its GEMM blocking: reports/chunk-sizes-bf16-layers-pos7.md is one)
    assert "first divergence: prompt fresh-1024-1, arm chunk96, round 1, output position 7" in layers
    assert "--position 7: where the arm first diverged in the run" in layers
    assert (workdir / "layers.md").is_file() and (workdir / "tiny-bf16.gguf").stat().st_size > 10**7


SHARED = {  # an option two commands share, and the words every one of its help texts holds
    "--out": "write",
    "--profile": "profile name",
    "--lengths": "prompt lengths",
    "--prompt": "prompt id",
    "--arm": "arm",
    "--round": "round",
    "--json": "JSON document",
    "--model": "preset",
    "--dtype": "the engine's --dtype",
    "--arms": "arms to run",
    "--rounds": "round",
    "--report": "Markdown report",
    "--quiet": "progress display",
}


def test_one_meaning_per_option_name() -> None:
    """Every option name two commands share is listed above with what it means, and each command's help for
    it says so; `--threshold` (a fraction, compare) is no longer also nats (probe: `--logprob-delta`)."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for name, cmd in commands().items():
        for p in cmd.params:
            if p.param_type_name == "option":
                for opt in p.opts:
                    if opt.startswith("--") and opt != "--help":
                        seen.setdefault(opt, []).append((name, (p.help or "").replace("\n", " ")))
    shared = {o for o, uses in seen.items() if len(uses) > 1}
    assert shared <= set(SHARED), f"shared options without a stated meaning: {shared - set(SHARED)}"
    for opt in shared:
        for name, help_ in seen[opt]:
            assert SHARED[opt].lower() in help_.lower(), f"abbench {name} {opt}: {help_!r}"
    assert [n for n, _ in seen["--threshold"]] == ["compare"] and [n for n, _ in seen["--logprob-delta"]] == ["probe"]
