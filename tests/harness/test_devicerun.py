"""The recipe for a GPU run (``abbench.devicerun``), run for real on this CPU as far as it goes: its chain
with the CPU engine tests' subset, the engine's gpucheck on the tiny preset, and a one-arm ``cpu-tiny`` run,
with no ``nvidia-smi`` on the PATH; what comes back is the layout a result directory holds. A failing step
is reported (in the output, ``status.json`` and the exit code) and stops the chain before the runs. And
results/ holds results: no script there, nothing there that imports the package."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support import cli

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "abbench" / "devicerun.py"
FAST_TEST = "tests/engine/test_decode_kernels.py -k test_sdpa_attention_equals_the_engines_over_the_bucket"
TINY_CHECK = "--preset tiny --device cpu --layers 2 --prompt-tokens 64 --decode-tokens 2"
NO_WHEELS = ("--wheels", "tests/no-such-wheel-folder")


def devicerun(*argv: str, path: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m abbench.devicerun ARGV`` in the repository. A chain started without ``--wheels`` installs
    none (``NO_WHEELS``): wheels a developer left in the repository's ``.whl`` for a GPU machine would not
    install here."""
    if argv and argv[0] == "start" and "--wheels" not in argv and "--dry-run" not in argv:
        argv = (*argv, *NO_WHEELS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "abbench.devicerun", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def no_nvidia_smi_path(tmp_path: Path) -> str:
    """A PATH holding free and nproc (linked) and no nvidia-smi, whatever this machine has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("free", "nproc"):
        found = next((Path(d) / tool for d in os.environ["PATH"].split(os.pathsep) if (Path(d) / tool).is_file()),
                     None)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_the_recipe_uses_the_standard_library_alone() -> None:
    """It runs on the bare machine before the carried wheels are installed: no import outside the standard
    library, none of the package (the engine included)."""
    names = set()
    for node in ast.walk(ast.parse(MODULE.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            names.add((node.module or "").split(".")[0])
    assert names and names <= set(sys.stdlib_module_names) | {"__future__"}, names - set(sys.stdlib_module_names)


def test_dry_run_prints_the_chain_in_order() -> None:
    r = devicerun("start", "--tests", "tests/engine/test_decode_kernels.py", "--tests",
                  "tests/engine/test_engine_decode.py", "--gpucheck", "--preset qwen3-30b-a3b-half --layers 8",
                  "--step", "gguf: python3 -m abbench export-gguf --model tiny", "--run", "h200-decode-offload-4k",
                  "--run", "h200-hybrid-decode-offload-4k --rounds 1", "--after-gpucheck",
                  "-m abbench.engine.tools.gpucheck_hybrid --model qwen3.5-35b-a3b --layers 8 --out {json}",
                  "--commit", "abc1234", "--work", "/tmp/w", "--out", "/tmp/o", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("# python3 -m abbench.devicerun start --tests tests/engine/test_decode_kernels.py --tests "
                        "tests/engine/test_engine_decode.py --gpucheck '--preset qwen3-30b-a3b-half --layers 8' --step "
                        "'gguf: python3 -m abbench export-gguf --model tiny' --run "
                        "h200-decode-offload-4k --run 'h200-hybrid-decode-offload-4k --rounds 1' --after-gpucheck "
                        "'-m abbench.engine.tools.gpucheck_hybrid --model qwen3.5-35b-a3b --layers 8 --out {json}' "
                        "--commit abc1234 --work /tmp/w --dry-run")  # --out: where it goes, not what is made
    assert "export ABBENCH_GIT_COMMIT=abc1234" in lines and "export ABBENCH_GIT_DIRTY=0" in lines
    assert f"export PYTHONPATH=/tmp/site:{REPO}" in lines and "export ABBENCH_CACHE_DIR=/tmp/w/cache" in lines
    steps = [line.rpartition("   # ")[2] for line in lines if "   # " in line]
    carried = ["install"] if any((REPO / ".whl").glob("*.whl")) else []  # a checkout that holds wheels to carry
    assert steps == [*carried, "versions-python", "versions-gpu", "versions-memory", "versions-cpus", "nvidia-smi",
                     "dry-run-h200-decode-offload-4k", "dry-run-h200-hybrid-decode-offload-4k", "tests",
                     "gpucheck-qwen3-30b-a3b-half", "gguf", "run-h200-decode-offload-4k",
                     "run-h200-hybrid-decode-offload-4k", "gpucheck_hybrid-qwen3.5-35b-a3b"]
    text = r.stdout
    assert ("ABBENCH_ENGINE_TEST_DEVICE=cuda timeout 480 " in text and "-m pytest -o addopts= -p no:cacheprovider "
            "-q tests/engine/test_decode_kernels.py tests/engine/test_engine_decode.py > "
            "/tmp/w/gpucheck/pytest-cuda.log 2>&1 || exit 1" in text)
    assert ("-m abbench.engine.tools.gpucheck --preset qwen3-30b-a3b-half --layers 8 --out "
            "/tmp/w/gpucheck/gpucheck-qwen3-30b-a3b-half.json > /tmp/w/gpucheck/gpucheck-qwen3-30b-a3b-half.log"
            in text)
    assert ("-m abbench run -p h200-hybrid-decode-offload-4k --dry-run --rounds 1 > "
            "/tmp/w/gpucheck/dry-run-h200-hybrid-decode-offload-4k.log 2>&1 || exit 1" in text)  # stops the chain
    # (what such a dry run refuses, and how: test_run_preflight.py's tests of --dry-run and the plan check)
    assert ("-m abbench run -p h200-decode-offload-4k --out /tmp/w/runs/h200-decode-offload-4k --no-report -q > "
            "/tmp/w/gpucheck/run-h200-decode-offload-4k.log 2>&1   #" in text)  # a failed run: the next runs
    assert ("-m abbench run -p h200-hybrid-decode-offload-4k --out /tmp/w/runs/h200-hybrid-decode-offload-4k "
            "--no-report -q --rounds 1 > /tmp/w/gpucheck/run-h200-hybrid-decode-offload-4k.log" in text)  # its own
    assert (f"timeout 1800 {sys.executable} -m abbench export-gguf --model tiny > /tmp/w/gpucheck/gguf.log 2>&1 "
            "|| exit 1" in text)
    assert "--model qwen3.5-35b-a3b --layers 8 --out /tmp/w/gpucheck/gpucheck_hybrid-qwen3.5-35b-a3b.json >" in text
    moved = devicerun("start", "--gpucheck", "--layers 8", "--gpucheck-module", "abbench.engine.tools.gpucheck",
                      "--commit", "abc", "--dry-run")
    assert "-m abbench.engine.tools.gpucheck --layers 8 --out /tmp/ab/gpucheck/gpucheck.json >" in moved.stdout


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to do"),
    (["--run", "cpu-tiny", "--run", "cpu-tiny"], "named twice"),
    (["--run", "cpu-tiny", "--run", "cpu-tiny --rounds 1"], "named twice"),
    (["--run", " "], "names no profile"),
    ([f"--run=p{i}" for i in range(7)], "at most 6"),
    (["--gpucheck=-m"], "-m needs a module"),
    (["--step", "python3 -m abbench export-gguf"], "give NAME: COMMAND"),
    (["--early-step", "b: python3 -c pass", "--step", "b: python3 -c pass"], "NAME is given twice"),
])
def test_bad_arguments_are_refused_with_what_to_do(argv: list[str], message: str) -> None:
    r = devicerun("start", *argv, "--commit", "abc", "--dry-run")
    assert r.returncode == 2 and message in r.stderr and not r.stdout


def test_the_chain_on_cpu_comes_back_as_a_result_directory(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    path = no_nvidia_smi_path(tmp_path)
    argv = ["start", "--work", str(work), "--test-device", "cpu", "--tests", FAST_TEST, "--gpucheck", TINY_CHECK,
            "--run", "cpu-tiny", "--run-args", "--arms chunked --rounds 1 --lengths 384", "--commit", "0123abc",
            *NO_WHEELS]
    first = devicerun(*argv, "--out", str(out), "--wait", "0", path=path)
    assert first.returncode == 3 and "RUNNING" in first.stdout, first.stdout + first.stderr  # it outlives the call
    again = devicerun(*argv, "--out", str(out), path=path)
    assert again.returncode == 2 and "already holds a chain" in again.stderr
    r = devicerun("poll", "--work", str(work), "--out", str(out), "--wait", "540", path=path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DONE: every step passed" in r.stdout
    status = json.loads((out / "status.json").read_text())
    states = {s["name"]: s["state"] for s in status["steps"]}
    assert states.pop("versions-python") in ("passed", "noted")  # triton: absent on some CPU machines
    assert states == {"versions-gpu": "noted", "versions-memory": "passed", "versions-cpus": "passed",
                      "nvidia-smi": "noted", "dry-run-cpu-tiny": "passed", "tests": "passed", "gpucheck-tiny": "passed",
                      "run-cpu-tiny": "passed"}
    assert sorted(p.name for p in out.iterdir()) == ["chain.log", "cpu-tiny.tgz", "status.json"]
    with tarfile.open(out / "cpu-tiny.tgz") as tar:
        tar.extractall(tmp_path / "results", filter="data")
    result = tmp_path / "results" / "cpu-tiny"
    assert {"run.json", "requests.jsonl", "logs", "gpucheck"} <= {p.name for p in result.iterdir()}
    g = result / "gpucheck"
    assert re.search(r"\d+ passed", (g / "pytest-cuda.log").read_text())
    assert json.loads((g / "gpucheck-tiny.json").read_text())["device"] == "cpu"
    assert "gpucheck: PASS" in (g / "gpucheck-tiny.log").read_text()
    versions = (g / "versions.txt").read_text()
    assert "$ nvidia-smi" in versions and "nvidia-smi: not run" in versions  # absent, written down
    assert re.search(r"^\$ nproc\n\d+$", versions, re.M)
    command = (g / "command.txt").read_text().strip()
    assert command == "python3 -m abbench.devicerun " + " ".join(
        a if " " not in a else f"'{a}'" for a in argv)
    run = json.loads((result / "run.json").read_text())
    git = run["environment"]["git"]  # the commit given to the chain, not this checkout's
    assert (git["commit"], git["dirty"], git["source"]) == ("0123abc", False, "ABBENCH_GIT_COMMIT")
    assert run["profile"]["name"] == "cpu-tiny" and {s["arm"] for s in run["samples"]} == {"chunked"}
    assert "run-cpu-tiny rc=0" in (g / "chain.log").read_text()
    # committing it is copying it: `abbench report` reads what came back as a run directory
    rep = cli.abbench("report", str(result), "--out", str(tmp_path / "r.md"), cwd=REPO)
    assert rep.returncode == 0, rep.stdout + rep.stderr


def test_a_failing_step_is_reported_and_stops_the_chain_before_the_runs(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    r = devicerun("start", "--work", str(work), "--out", str(out), "--test-device", "cpu", "--gpucheck",
                  "-m abbench.no_such_check --preset tiny", "--run", "cpu-tiny", "--after-gpucheck",
                  "-m abbench.no_such_check_either", "--commit", "abc1234", "--wait", "300", "--no-dry-run",
                  path=no_nvidia_smi_path(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED: no_such_check-tiny (exit 1)" in r.stdout and "No module named abbench.no_such_check" in r.stdout
    assert "CHAIN STOPPED after no_such_check-tiny" in r.stdout
    assert ("DONE WITH FAILURES: no_such_check-tiny failed, run-cpu-tiny skipped, no_such_check_either failed"
            in r.stdout)
    status = json.loads((out / "status.json").read_text())
    assert status["done"] is True and status["ok"] is False
    assert not (work / "runs").exists()  # the run never started
    with tarfile.open(out / "cpu-tiny.tgz") as tar:  # what there is still comes back, in the same layout
        names = tar.getnames()
    assert "cpu-tiny/gpucheck/no_such_check-tiny.log" in names and "cpu-tiny/run.json" not in names


def test_an_early_step_runs_beside_the_checks_and_the_steps_wait_for_it(tmp_path: Path) -> None:
    """An --early-step starts with the chain and runs while the gpuchecks do: here it waits for a file that the
    gpucheck after it writes (run one after the other, it would give up after 60 s and fail); the --step after
    them starts only once it has ended. A failing early step stops the chain before the runs."""
    work, out, go = tmp_path / "work", tmp_path / "out", tmp_path / "go.zip"
    waits = ("bg: python3 -c 'import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); end = time.time() + 60; "
             "any(p.exists() or time.sleep(0.05) or time.time() > end for _ in iter(int, 1)); "
             f"sys.exit(0 if p.exists() else 1)' {go}")
    argv = ["start", "--work", str(work), "--out", str(out), "--early-step", waits, "--gpucheck",
            f"-m zipfile -c {go} {MODULE}", "--step", "after: python3 -c pass", "--commit", "abc", "--wait", "120"]
    dry = devicerun(*argv, "--dry-run")
    lines = [line.rpartition("   # ")[2] for line in dry.stdout.splitlines() if "   # " in line]
    assert lines[-4:] == ["bg", "zipfile", "the early steps", "after"], dry.stdout
    path = no_nvidia_smi_path(tmp_path)
    r = devicerun(*argv, path=path)
    assert r.returncode == 0, r.stdout + r.stderr
    chain = (out / "chain.log").read_text()
    assert "bg started beside the next steps" in chain
    assert chain.index("zipfile rc=0") < chain.index("bg rc=0") < chain.index("after rc=0")
    states = {s["name"]: s["state"] for s in json.loads((out / "status.json").read_text())["steps"]}
    assert (states["bg"], states["zipfile"], states["after"]) == ("passed", "passed", "passed")
    failing = devicerun("start", "--work", str(tmp_path / "w2"), "--out", str(tmp_path / "o2"), "--early-step",
                        "bad: python3 -c 'raise SystemExit(3)'", "--run", "cpu-tiny", "--commit", "abc1234",
                        "--no-dry-run", "--wait", "120", path=path)
    assert failing.returncode == 1 and "CHAIN STOPPED after bad" in failing.stdout
    assert not (tmp_path / "w2" / "runs").exists()


def test_a_step_past_its_limit_is_killed_and_reported(tmp_path: Path) -> None:
    work = tmp_path / "work"
    r = devicerun("start", "--work", str(work), "--gpucheck", "-m http.server 0", "--gpucheck-timeout", "3",
                  "--commit", "abc", "--wait", "120", path=no_nvidia_smi_path(tmp_path))
    assert r.returncode == 1 and "FAILED: server (exit 124)" in r.stdout and "killed past its limit of 3 s" in r.stdout


def test_poll_without_a_chain_says_how_to_start_one(tmp_path: Path) -> None:
    r = devicerun("poll", "--work", str(tmp_path / "none"))
    assert r.returncode == 2 and "no chain in" in r.stderr and "devicerun start" in r.stderr


def test_results_hold_results_not_scripts() -> None:
    """No per-run script under results/: the recipe made every run; and nothing there imports the package."""
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "results").rglob("*")
                     if p.is_file() and p.suffix in (".py", ".sh"))
    assert not scripts, f"scripts under results/ (the recipe is abbench.devicerun): {scripts}"
    importing = [str(p.relative_to(REPO)) for p in (REPO / "results").rglob("*")
                 if p.is_file() and p.suffix not in (".json", ".jsonl", ".log", ".txt", ".md", ".tgz", ".png", ".csv")
                 and p.stat().st_size < 2**20
                 and re.search(r"^\s*(import abbench|from abbench[ .])", p.read_text(errors="replace"), re.M)]
    assert not importing, f"files under results/ that import the package: {importing}"


# ------------------------------------------------------------------------------ committed reports, regenerated

REPORTS = REPO / "reports"
RENDERED = sorted(p.stem for p in REPORTS.glob("*.md") if (REPO / "results" / p.stem / "run.json").is_file())
# Rendered by an earlier version of the report (a section or a note added since) and not re-rendered: today's
# Markdown differs from the committed file. Listed so that a report that starts to match again is noticed (and
# moved off the list, so that its plots are compared too).
OLDER_RENDERING = {
    "20261129-h200-qwen3-30b-a3b", "20261129b-h200-qwen3-30b-a3b", "20261130-cpu-tiny-llamacpp-bf16",
    "20261130-cpu-tiny-llamacpp", "20261130-cpu-tiny-reference", "20261130-h200-qwen3-30b-a3b",
    "20261130-h200-qwen3.5-35b-a3b", "20261130b-cpu-tiny-llamacpp", "20261201-cpu-tiny-vllm",
    "20261201-h200-qwen3-30b-a3b-giant-chunk-128k", "20261201-h200-qwen4-exp-half", "20261201b-h200-qwen4-exp-half",
    "20261201c-h200-qwen4-exp-half", "20261201d-h200-qwen4-exp-half", "20261201e-h200-peer-llamacpp",
    "20261201f-h200-peer-llamacpp", "20261201g-h200-qwen3.5-35b-a3b-long", "20261201j-h200-qwen3-30b-a3b-sweep-skewed",
    "20261201j-h200-qwen3-30b-a3b-sweep", "20261201l-h200-qwen3-30b-a3b-sweep-skewed",
    "20261201l-h200-qwen3-30b-a3b-sweep", "20261201n-h200-decode-kernels", "chunk-sizes-bf16", "cpu-tiny-auto",
    "cpu-tiny-sweep",
}


CURRENT = [n for n in RENDERED if n not in OLDER_RENDERING]


def _plots_to_compare(names: list[str], newest: int = 5) -> set[str]:
    """The reports whose plots are drawn again and compared: the ``newest`` (by name) and, going back in time,
    each first report with a set of plots not seen yet, so every kind of plot is drawn; the other reports'
    Markdown alone is compared (drawing is most of a report's time, and the Markdown is the same drawn or not,
    ``test_the_markdown_is_the_same_whether_or_not_the_plots_are_drawn``)."""
    chosen, seen = set(), set()
    for i, name in enumerate(sorted(names, reverse=True)):
        plots = frozenset(p.name for p in (REPORTS / name).iterdir()) if (REPORTS / name).is_dir() else frozenset()
        if i < newest or not plots <= seen:
            chosen.add(name)
            seen |= plots
    return chosen


PLOTTED = _plots_to_compare(CURRENT)


@pytest.mark.parametrize("name", CURRENT)
def test_a_committed_report_regenerates_byte_for_byte_from_its_run(name: str, tmp_path: Path) -> None:
    """``abbench report results/NAME`` writes ``reports/NAME.md`` again, byte for byte, and its plots where they
    are compared (``PLOTTED``): removing the scripts and editing the READMEs of results/ changed nothing a report
    reads."""
    if name not in PLOTTED:
        from abbench.report import write_report
        from abbench.results import load_run

        record, problems = load_run(REPO / "results" / name, REPO / "results")
        md = write_report(record, problems, tmp_path / f"{name}.md", tmp_path / name, draw_plots=False)
        assert md.read_bytes() == (REPORTS / f"{name}.md").read_bytes()
        return
    from typer.testing import CliRunner

    from abbench.cli import app

    r = CliRunner().invoke(app, ["report", str(REPO / "results" / name), "--out", str(tmp_path / f"{name}.md")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / f"{name}.md").read_bytes() == (REPORTS / f"{name}.md").read_bytes()
    if (REPORTS / name).is_dir():
        for plot in sorted((REPORTS / name).iterdir()):
            assert_same_plot(tmp_path / name / plot.name, plot)


def test_every_kind_of_plot_is_drawn_again() -> None:
    drawn = {p.name for n in PLOTTED if (REPORTS / n).is_dir() for p in (REPORTS / n).iterdir()}
    every = {p.name for n in CURRENT if (REPORTS / n).is_dir() for p in (REPORTS / n).iterdir()}
    assert drawn == every and len(PLOTTED) < len(CURRENT)


def _png_software(png: bytes) -> bytes:
    """The tEXt 'Software' value matplotlib writes into a PNG ('Matplotlib version3.11.2, https://...')."""
    at = png.find(b"tEXtSoftware\x00")
    return png[at:png.find(b"\x00\x00", at + 13)] if at >= 0 else b""


def assert_same_plot(made: Path, committed: Path) -> None:
    """Byte for byte when the installed matplotlib wrote the committed plot; with another matplotlib (a newer
    release draws text a pixel apart) the same picture size, as PIL decodes both."""
    new, old = made.read_bytes(), committed.read_bytes()
    if _png_software(new) == _png_software(old):
        assert new == old, committed.name
        return
    from PIL import Image

    with Image.open(made) as a, Image.open(committed) as b:
        assert a.size == b.size, (committed.name, a.size, b.size)


def test_the_older_renderings_are_committed_runs() -> None:
    assert OLDER_RENDERING <= set(RENDERED) and len(RENDERED) - len(OLDER_RENDERING) >= 7


@pytest.mark.parametrize("name", sorted(OLDER_RENDERING))
def test_an_older_rendering_differs_from_todays_markdown(name: str, tmp_path: Path) -> None:
    """Today's Markdown of the run (what ``abbench report`` writes, its plots linked but not drawn: an older
    rendering's plots are never compared) is not the committed one."""
    from abbench.report import write_report
    from abbench.results import load_run

    record, problems = load_run(REPO / "results" / name, REPO / "results")
    md = write_report(record, problems, tmp_path / f"{name}.md", tmp_path / name, draw_plots=False)
    assert md.read_bytes() != (REPORTS / f"{name}.md").read_bytes(), \
        f"{name} renders as committed again: take it off OLDER_RENDERING"
    assert not (tmp_path / name).exists()


def test_the_markdown_is_the_same_whether_or_not_the_plots_are_drawn(tmp_path: Path) -> None:
    """What the test above relies on: ``draw_plots=False`` changes no byte of the Markdown, and draws nothing."""
    from abbench.report import write_report
    from abbench.results import load_run

    record, problems = load_run(REPO / "results" / "readme-cpu-tiny")
    drawn = write_report(record, problems, tmp_path / "a" / "r.md", tmp_path / "a" / "r")
    linked = write_report(record, problems, tmp_path / "b" / "r.md", tmp_path / "b" / "r", draw_plots=False)
    assert drawn.read_bytes() == linked.read_bytes() and "](r/ttft.png)" in linked.read_text()
    assert sorted(p.name for p in (tmp_path / "a" / "r").iterdir()) == ["h2d.png", "memory.png", "ratios.png",
                                                                        "ttft.png"]
    assert not (tmp_path / "b" / "r").exists()


def test_a_chain_that_dies_is_reported_not_waited_on(tmp_path: Path) -> None:
    """The chain's process killed (as by the machine's release of a call's processes): poll says so at once."""
    import signal
    import time

    work = tmp_path / "work"
    first = devicerun("start", "--work", str(work), "--step", "nap: python3 -c 'import time; time.sleep(4)'",
                      "--commit", "abc", "--wait", "0", path=no_nvidia_smi_path(tmp_path))
    assert first.returncode == 3, first.stdout + first.stderr
    os.kill(int((work / "chain.pid").read_text()), signal.SIGKILL)
    t0 = time.monotonic()
    r = devicerun("poll", "--work", str(work), "--out", str(tmp_path / "out"), "--wait", "120")
    assert r.returncode == 1 and "CHAIN DIED before its end" in r.stdout, r.stdout + r.stderr
    assert time.monotonic() - t0 < 60 and (tmp_path / "out" / "checks.tgz").is_file()
