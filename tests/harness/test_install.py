"""Working from any directory: profile lookup (a path, ./profiles, then the bundled ones), what the wheel
carries, and the latest-run default of report, gate, diff and probe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from abbench.cli import app
from abbench.errors import ConfigError, ResultsError
from abbench.profile import BUNDLED_PROFILES_DIR, available_profiles, load_profile, resolve_profile_path
from abbench.results import latest_run

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "support" / "fixtures" / "cpu-tiny-3-rounds"

LOCAL = """
name = "{name}"
description = "the ./profiles copy"
[engine]
command = ["{{python}}", "-m", "abbench.engine", "--port", "{{port}}"]
[[arms]]
name = "only-local"
"""


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "abbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


# ------------------------------------------------------------------------------------------ profile lookup


def test_lookup_order_path_then_local_profiles_then_bundled(tmp_path: Path) -> None:
    assert (BUNDLED_PROFILES_DIR / "cpu-tiny.toml").is_file()
    # Nothing local: the bundled profile, from any directory.
    assert resolve_profile_path("cpu-tiny", cwd=tmp_path) == BUNDLED_PROFILES_DIR / "cpu-tiny.toml"
    # ./profiles/cpu-tiny.toml hides the bundled one of the same name.
    (tmp_path / "profiles").mkdir()
    local = tmp_path / "profiles" / "cpu-tiny.toml"
    local.write_text(LOCAL.format(name="cpu-tiny"))
    assert resolve_profile_path("cpu-tiny", cwd=tmp_path) == local
    # A bundled name not in ./profiles still resolves to the bundled one.
    assert resolve_profile_path("cpu-tiny-shared", cwd=tmp_path) == BUNDLED_PROFILES_DIR / "cpu-tiny-shared.toml"
    # A path given on the command line wins over both.
    other = tmp_path / "elsewhere.toml"
    other.write_text(LOCAL.format(name="elsewhere"))
    assert resolve_profile_path(str(other), cwd=tmp_path) == other
    entries = {(e.name, e.source): e for e in available_profiles(tmp_path)}
    assert entries[("cpu-tiny", "./profiles")].shadowed_by is None
    assert entries[("cpu-tiny", "bundled")].shadowed_by == local
    assert entries[("cpu-tiny-shared", "bundled")].shadowed_by is None
    with pytest.raises(ConfigError, match="no profile named 'nope'.*cpu-tiny"):
        resolve_profile_path("nope", cwd=tmp_path)
    with pytest.raises(ConfigError, match="did you mean 'cpu-tiny'"):  # a misspelling gets the nearest names
        resolve_profile_path("cpu-tiyn", cwd=tmp_path)


def test_cli_profiles_and_run_profile_from_another_directory(tmp_path: Path) -> None:
    res = _cli(["profiles"], tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if "cpu-tiny " in line or "│ cpu-tiny " in line]
    assert rows and "bundled" in rows[0]
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "cpu-tiny.toml").write_text(LOCAL.format(name="cpu-tiny"))
    res = _cli(["profiles"], tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any("cpu-tiny " in ln and "./profiles" in ln and "only-local" in ln for ln in lines), res.stdout
    assert any("cpu-tiny " in ln and "hidden by" in ln for ln in lines), res.stdout
    # `abbench prompts -p NAME` loads the profile the same way (no service is started).
    res = _cli(["prompts", "-p", "cpu-tiny-shared", "--lengths", "64"], tmp_path)
    assert res.returncode == 0, res.stderr


def test_bundled_profiles_are_self_contained() -> None:
    """What a bundled profile needs ships with the package: built-in corpora and tokenizers, files beside it
    ({profile_dir}), nothing from the checkout."""
    corpora_dir = REPO / "abbench" / "corpora"
    for p in sorted(BUNDLED_PROFILES_DIR.glob("*.toml")):
        prof = load_profile(str(p))
        for c in prof.prompts.corpora:
            assert (corpora_dir / f"{c}.txt").is_file() or (p.parent / c).is_file(), (p.name, c)
        for spec in prof.launch_specs():
            for arg in spec.argv or []:
                if "{profile_dir}" in arg:
                    rel = arg.split("{profile_dir}", 1)[1].lstrip("/").split()[0]
                    assert (p.parent / rel).exists(), (p.name, arg)


def test_the_package_list_covers_every_subpackage_and_profiles_ship() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {".".join(d.relative_to(REPO).parts) for d in (REPO / "abbench").rglob("*")
               if d.is_dir() and (d / "__init__.py").exists()}
    on_disk.add("abbench")
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert cfg["package-dir"]["abbench.bundled_profiles"] == "profiles"
    data = cfg.get("package-data", {})
    assert "*.toml" in data["abbench.bundled_profiles"]


@pytest.mark.slow
def test_wheel_carries_profiles_and_corpora(tmp_path: Path) -> None:
    """pip wheel builds offline from the cached build backend; the wheel holds every profile and corpus."""
    import zipfile

    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if res.returncode != 0:
        pytest.skip(f"pip wheel failed here (no build backend available?): {res.stderr[-500:]}")
    (whl,) = tmp_path.glob("abbench-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for p in BUNDLED_PROFILES_DIR.glob("*.toml"):
        assert f"abbench/bundled_profiles/{p.name}" in names
    for c in (REPO / "abbench" / "corpora").glob("*.txt"):
        assert f"abbench/corpora/{c.name}" in names


# -------------------------------------------------------------------------------------- the latest run


def _copy_run(dst: Path, mtime: float) -> Path:
    shutil.copytree(FIXTURE, dst)
    os.utime(dst / "run.json", (mtime, mtime))
    return dst


def test_latest_run_is_the_most_recently_written(tmp_path: Path) -> None:
    results = tmp_path / "results"
    with pytest.raises(ResultsError, match="no run given and no run under"):
        latest_run(results)
    results.mkdir()
    (results / "not-a-run").mkdir()
    with pytest.raises(ResultsError, match="no run"):
        latest_run(results)
    now = time.time()
    _copy_run(results / "zzz-older", now - 100)
    newer = _copy_run(results / "aaa-newer", now)
    assert latest_run(results) == newer


def test_latest_run_leaves_out_the_runs_git_tracks(tmp_path: Path) -> None:
    """A fresh clone's committed runs all carry the checkout's time: none of them is the user's latest run, so
    ``abbench report`` with no argument must not rewrite a committed report."""
    import subprocess

    results = tmp_path / "results"
    results.mkdir()
    now = time.time()
    committed = _copy_run(results / "zzz-committed", now)
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "results"], check=True)
    subprocess.run([*git, "commit", "-qm", "runs"], check=True)
    with pytest.raises(ResultsError, match="committed ones"):
        latest_run(results)
    mine = _copy_run(results / "aaa-mine", now - 100)  # older by mtime, yet the only one of the user's
    assert latest_run(results) == mine and committed.is_dir()


def test_report_gate_diff_take_the_latest_run_and_say_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for args in (["report"], ["gate"], ["diff", "--prompt", "p"], ["probe", "--prompt", "p", "--arm", "a"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "no run given and no run under" in res.output, (args, res.output)
    now = time.time()
    _copy_run(tmp_path / "results" / "older", now - 100)
    _copy_run(tmp_path / "results" / "newer", now)
    res = runner.invoke(app, ["gate"])
    assert res.exit_code in (0, 1), res.output
    assert "using the latest under results/: results/newer" in res.output
    res = runner.invoke(app, ["report"])
    assert res.exit_code == 0, res.output
    assert "results/newer" in res.output
    run_id = json.loads((FIXTURE / "run.json").read_text())["run_id"]
    report = tmp_path / "reports" / "newer.md"  # a copied run is reported under its directory's name
    assert report.is_file() and f"run recorded as '{run_id}'" in report.read_text()
    res = runner.invoke(app, ["diff", "--prompt", "no-such-prompt"])
    assert "using the latest under results/: results/newer" in res.output and res.exit_code == 2
