"""Engines behind an API key or on another host: the key comes from the environment variable the profile names,
goes out as ``Authorization: Bearer``, and never lands in anything the run writes; a refused key is one clear,
immediate error naming the variable; https servers are checked against a custom CA bundle.

The keyed engine is tests/support/fakeserver.py with ``--api-key-env`` (every route but /health needs the key)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from abbench import runner
from abbench.auth import Credentials, resolve_keys, tls_verify
from abbench.client import EngineClient
from abbench.errors import AuthError, ConfigError, RequestError
from abbench.profile import RequestSpec, load_profile, profile_from_dict
from abbench.results import load_run

from tests.support import cli
from tests.support import faultkit as fk
from tests.support.fakeserver import FakeConfig, FakeServer

SECRET = "sk-test-7f3a9c1e5b2d4a8f-DO-NOT-LEAK"
SERVER_SECRET = "sk-server-only-91b7e2c4d6f8a0b3"


def _keyed_profile(mark: str, *, client_var: str | None, server_var: str = "ABB_TEST_SERVER_KEY") -> dict:
    prof = fk.fake_profile(mark, args=("--api-key-env", server_var), arms=[{"name": "a"}, {"name": "b"}],
                           run={"rounds": 1, "on_request_failure": "continue"})
    if client_var is not None:
        prof["engine"]["api_key_env"] = client_var
    return prof


def _abbench(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", **env}
    return subprocess.run([sys.executable, "-m", "abbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env=full)


def _files_holding(root: Path, needle: str) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and needle.encode() in p.read_bytes():
            hits.append(str(p.relative_to(root)))
    return hits


def test_key_from_the_environment_is_sent_and_in_no_file_the_run_writes(tmp_path: Path) -> None:
    mark = fk.new_mark()
    toml = fk.write_profile(tmp_path / "keyed.toml", _keyed_profile(mark, client_var="ABB_TEST_KEY"))
    env = {"ABB_TEST_KEY": SECRET, "ABB_TEST_SERVER_KEY": SECRET}
    res = _abbench(["run", "-p", str(toml), "--out", "results/keyed"], tmp_path, env)
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "results" / "keyed"
    record, _ = load_run(run_dir)
    # The fake server answers 401 to any request without the key: every sample ok means it was sent.
    assert record.status == "complete" and record.samples and all(s.ok for s in record.samples)
    assert record.environment["auth"] == {"api_key_used": True, "api_key_env": ["ABB_TEST_KEY"], "ca_bundle": None}
    assert record.profile["engine"]["api_key_env"] == "ABB_TEST_KEY"
    # Not in run.json, requests.jsonl, the service logs, the report or its plots; not on the terminal.
    assert (run_dir / "logs").is_dir() and list((run_dir / "logs").iterdir())
    assert _files_holding(tmp_path, SECRET) == []
    assert SECRET not in res.stdout + res.stderr
    assert (tmp_path / "reports" / "keyed.md").is_file()
    # The gate and the report read it back without a key in sight.
    gate = cli.abbench("gate", cwd=tmp_path)  # in this process, whose environment holds no key
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "results/keyed" in gate.stderr
    fk.assert_no_leftovers(mark)


@pytest.mark.parametrize("client_var", ["ABB_TEST_KEY", None], ids=["wrong-key", "no-key"])
def test_a_refused_key_is_one_immediate_error_naming_the_variable(tmp_path: Path, client_var: str | None) -> None:
    mark = fk.new_mark()
    toml = fk.write_profile(tmp_path / "keyed.toml", _keyed_profile(mark, client_var=client_var))
    env = {"ABB_TEST_KEY": SECRET, "ABB_TEST_SERVER_KEY": SERVER_SECRET}
    t0 = time.monotonic()
    res = _abbench(["run", "-p", str(toml), "--out", "run", "--no-report"], tmp_path, env)
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stdout + res.stderr
    err = fk.flat(res.stderr)
    assert "HTTP 401" in err
    if client_var:
        assert "refused the API key from $ABB_TEST_KEY (engine.api_key_env)" in err
    else:
        assert "requires an API key" in err and "engine.api_key_env" in err
    for text in (res.stdout, res.stderr):
        assert SECRET not in text and SERVER_SECRET not in text
    assert not (tmp_path / "run" / "run.json").exists()  # nothing was measured: no run (nor failed samples)
    assert _files_holding(tmp_path / "run", SECRET) == [] and _files_holding(tmp_path / "run", SERVER_SECRET) == []
    assert took < 60
    fk.assert_no_leftovers(mark)


def test_an_unset_key_variable_stops_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ABB_TEST_UNSET_KEY", raising=False)
    mark = fk.new_mark()
    prof = _keyed_profile(mark, client_var="ABB_TEST_UNSET_KEY")
    with pytest.raises(AuthError, match=r"engine.api_key_env names the environment variable ABB_TEST_UNSET_KEY, "
                                        r"which is not set"):
        runner.execute(profile_from_dict(prof), tmp_path / "run")
    assert not (tmp_path / "run" / "run.json").exists()
    assert fk.marked_processes(mark) == []
    # An arm's own variable wins over the engine's, and its field is the one named.
    prof["arms"][1]["api_key_env"] = "ABB_TEST_UNSET_KEY"
    prof["engine"]["api_key_env"] = "ABB_TEST_KEY"
    monkeypatch.setenv("ABB_TEST_KEY", SECRET)
    with pytest.raises(AuthError, match=r"arms\[1\].api_key_env names"):
        runner.execute(profile_from_dict(prof), tmp_path / "run2")


def test_credentials_never_show_the_key() -> None:
    creds = resolve_keys([("engine.api_key_env", "K")], {"K": f"  {SECRET}\n"})
    assert creds.headers("K") == {"Authorization": f"Bearer {SECRET}"}
    assert creds.headers(None) == {}
    assert SECRET not in repr(creds) and creds.names == ["K"]
    assert creds.redact(f"server said: bad token {SECRET}!") == "server said: bad token ***!"
    with pytest.raises(AuthError, match="K, which is empty"):
        resolve_keys([("engine.api_key_env", "K")], {"K": " "})
    with pytest.raises(ConfigError):
        profile_from_dict({"name": "x", "engine": {"base_url": "http://h", "api_key_env": "not a name"},
                           "arms": [{"name": "a"}]})


# ------------------------------------------------------------------------------------------------- https


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A private CA and a certificate for 127.0.0.1 signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=abbench test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1",
             cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "srv.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return {"ca": d / "ca.pem", "cert": d / "srv.pem", "key": d / "srv.key"}


def _https_fake(tls_files: dict[str, Path], api_key: str | None = None, tokenizer: object = None) -> FakeServer:
    srv = FakeServer(FakeConfig(api_key=api_key), tokenizer=tokenizer)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_files["cert"], tls_files["key"])
    srv._httpd.socket = ctx.wrap_socket(srv._httpd.socket, server_side=True)
    return srv


def test_https_with_a_custom_ca_bundle_and_a_key(tls_files: dict[str, Path], tmp_path: Path) -> None:
    request = RequestSpec(max_tokens=3, logprobs=None, timeout_s=10)
    prompt = "one two three four"
    with _https_fake(tls_files, api_key=SECRET) as srv:
        url = srv.base_url.replace("http://", "https://")
        headers = Credentials({"K": SECRET}).headers("K")
        with EngineClient(verify=tls_verify(tls_files["ca"])) as client:
            assert client.health(url)
            c = client.complete(url, prompt, request=request, extra={}, target_prompt_tokens=4, headers=headers)
            assert len(c.output_ids) == 3
            with pytest.raises(RequestError) as e:
                client.complete(url, prompt, request=request, extra={}, target_prompt_tokens=4)
            assert e.value.status == 401
        with EngineClient() as client:  # the public CAs do not know the private one
            with pytest.raises(RequestError, match="TLS handshake failed.*engine.ca_bundle") as e:
                client.complete(url, prompt, request=request, extra={}, target_prompt_tokens=4, headers=headers)
            with pytest.raises(RequestError, match="engine.ca_bundle"):
                client.health(url)
        assert srv.stats()["authorized"] == 1 and srv.stats()["unauthorized"] == 1


def test_the_default_cas_are_one_context_per_process() -> None:
    """Without a CA bundle every client of the process shares one context with the public CAs and full checks
    (httpx would load the certificates again for each client: a health check makes one per poll)."""
    ctx = tls_verify(None)
    assert isinstance(ctx, ssl.SSLContext) and tls_verify(None) is ctx
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname and ctx.cert_store_stats()["x509_ca"] > 0


def test_ca_bundle_is_relative_to_the_profile(tls_files: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(tls_files["ca"], tmp_path / "my-ca.pem")
    (tmp_path / "remote.toml").write_text(
        'name = "remote"\n[engine]\nbase_url = "https://example.invalid:8443"\napi_key_env = "ABB_TEST_KEY"\n'
        'ca_bundle = "my-ca.pem"\n[[arms]]\nname = "a"\n')
    prof = load_profile(str(tmp_path / "remote.toml"))
    assert prof.ca_bundle_path() == tmp_path / "my-ca.pem"
    assert isinstance(tls_verify(prof.ca_bundle_path()), ssl.SSLContext)
    (tmp_path / "remote.toml").write_text((tmp_path / "remote.toml").read_text().replace("my-ca.pem", "nope.pem"))
    with pytest.raises(ConfigError, match="engine.ca_bundle: .*nope.pem is not a file"):
        load_profile(str(tmp_path / "remote.toml")).ca_bundle_path()


def test_run_against_an_https_server_with_a_key(tls_files: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole run path (health, reset, metrics, completions) over https with the key and the CA bundle."""
    from abbench.engine.serve.tokenizer import load_tokenizer

    monkeypatch.setenv("ABB_TEST_KEY", SECRET)
    with _https_fake(tls_files, api_key=SECRET, tokenizer=load_tokenizer("qwen3")) as srv:
        prof = fk.fake_profile("unused", engine={"base_url": srv.base_url.replace("http://", "https://"),
                                                 "command": [], "api_key_env": "ABB_TEST_KEY",
                                                 "ca_bundle": str(tls_files["ca"])})
        record = runner.execute(profile_from_dict(prof), tmp_path / "run")
    assert record.status == "complete" and all(s.ok for s in record.samples), [s.error for s in record.samples]
    assert record.environment["auth"]["api_key_used"] is True
    assert _files_holding(tmp_path / "run", SECRET) == []
    assert srv.stats()["unauthorized"] == 0 and srv.stats()["authorized"] > len(record.samples)
