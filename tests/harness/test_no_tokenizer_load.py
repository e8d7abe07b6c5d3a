"""Commands that need no tokenizer do not load one (nor import transformers: seconds a command on a busy
machine); the one that builds prompts loads it once, from the converted cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "results" / "readme-cpu-tiny"


def test_report_gate_compare_export_and_profiles_load_no_tokenizer(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        from typer.testing import CliRunner
        from abbench.cli import app
        r = CliRunner()
        for args in (["report", {str(RUN)!r}, "--out", {str(tmp_path / "r.md")!r}], ["gate", {str(RUN)!r}],
                     ["compare", {str(RUN)!r}, {str(RUN)!r}], ["export", {str(RUN)!r}, "--csv"], ["profiles"]):
            res = r.invoke(app, args)
            assert res.exit_code in (0, 1), (args, res.output)
            loaded = sorted(m for m in ("transformers", "tokenizers", "abbench.tokenizers") if m in sys.modules)
            assert not loaded, (args, loaded)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_prompts_loads_the_tokenizer_once_from_the_cache(monkeypatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from abbench import tokenizers
    from abbench.cli import app

    tokenizers.load_tokenizer("qwen3")  # the converted cache exists (written on first use)
    calls: list[str] = []
    real_from_cache, real_write = tokenizers._from_cache, tokenizers._write_cache
    monkeypatch.setattr(tokenizers, "_from_cache", lambda t, n: calls.append(n) or real_from_cache(t, n))
    monkeypatch.setattr(tokenizers, "_write_cache", lambda *a: (_ for _ in ()).throw(AssertionError("converted")))
    res = CliRunner().invoke(app, ["prompts", "--json"])
    assert res.exit_code == 0, res.output
    assert calls == ["qwen3"]
    del real_write
