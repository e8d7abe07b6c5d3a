"""Profiles: the bundled ones load; bad input names the file, the field and the fix; overrides apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from abbench.errors import ConfigError
from abbench.profile import PROFILES_DIR, load_profile


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "p.toml"
    p.write_text(text)
    return p


MINIMAL = """
name = "x"
[engine]
command = ["{python}", "-m", "abbench.engine", "--port", "{port}"]
[[arms]]
name = "a"
[[arms]]
name = "b"
"""


@pytest.mark.parametrize("path", sorted(PROFILES_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_bundled_profiles_are_valid(path: Path) -> None:
    prof = load_profile(str(path))
    assert prof.arms and prof.reference_arm in [a.name for a in prof.arms]


def test_default_profile_is_cpu_tiny() -> None:
    prof = load_profile(None)
    assert prof.name == "cpu-tiny"
    assert [a.name for a in prof.arms] == ["chunked", "layer-major", "demand"]


def test_unknown_field_names_file_and_field(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL + "\n[request]\nmax_tokenz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_profile(str(p))
    msg = str(e.value)
    assert str(p) in msg and "request.max_tokenz" in msg and "unknown field" in msg


def test_out_of_range_value(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL + "\n[request]\nmax_tokens = 0\n")
    with pytest.raises(ConfigError, match="request.max_tokens"):
        load_profile(str(p))


def test_reference_must_be_an_arm(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL + '\n[run]\nreference = "zzz"\n')
    with pytest.raises(ConfigError, match="reference 'zzz' is not an arm"):
        load_profile(str(p))


def test_arm_without_engine(tmp_path: Path) -> None:
    p = write(tmp_path, 'name = "x"\n[[arms]]\nname = "a"\n')
    with pytest.raises(ConfigError, match="no way to reach an engine"):
        load_profile(str(p))


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    p = write(tmp_path, "name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(str(p))
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="cpu-tiny"):
        load_profile("no-such-profile")


def test_overrides(tmp_path: Path) -> None:
    prof = load_profile(str(write(tmp_path, MINIMAL)))
    o = prof.with_overrides(arms=["b", "a"], rounds=4, lengths=[100, 200])
    assert [a.name for a in o.arms] == ["b", "a"] and o.run.rounds == 4 and o.prompts.lengths == [100, 200]
    assert o.reference_arm == "b"
    with pytest.raises(ConfigError, match="unknown arm"):
        prof.with_overrides(arms=["a", "c"])
    with pytest.raises(ConfigError, match="lengths must be distinct"):
        prof.with_overrides(lengths=[5, 5])


def test_engine_args_go_at_the_end_of_every_launch_command(tmp_path: Path) -> None:
    """``--engine-args``: after each arm's own args, or its own command; refused for an arm that attaches to a
    running server (abbench does not launch it); arms of one shared service stay launched the same way."""
    prof = load_profile(str(write(tmp_path, MINIMAL.replace('name = "b"', 'name = "b"\nargs = ["--chunk-tokens", "64"]')
                                  + '[[arms]]\nname = "c"\ncommand = ["{python}", "srv.py", "--port", "{port}"]\n')))
    o = prof.with_overrides(engine_args=["--chunk-tokens", "128"])
    argv = {a.name: o.launch_spec(a.name).argv for a in o.arms}
    assert argv["a"][-2:] == argv["b"][-2:] == argv["c"][-2:] == ["--chunk-tokens", "128"]
    assert argv["b"][-4:-2] == ["--chunk-tokens", "64"] and argv["c"][1:3] == ["srv.py", "--port"]
    assert prof.with_overrides(engine_args=[]) == prof
    attached = load_profile(str(write(tmp_path, MINIMAL + 'base_url = "http://127.0.0.1:9"\n')))
    with pytest.raises(ConfigError, match="arm 'b' attaches to a running server"):
        attached.with_overrides(engine_args=["--x"])
    assert attached.with_overrides(arms=["a"]).with_overrides(engine_args=["--x"]).launch_spec("a").argv[-1] == "--x"
    shared = load_profile(str(write(tmp_path, MINIMAL.replace("[engine]", "[engine]\nshared_service = true"))))
    assert shared.with_overrides(engine_args=["--x"]).launch_spec("b").argv[-1] == "--x"


def test_engine_args_reach_the_launched_services_and_the_record(tmp_path: Path) -> None:
    """``abbench run --engine-args``, end to end on the fake server: every service is launched with them, the run
    records those commands, and arguments that do not split are a usage error before anything starts."""
    import json

    from tests.support import cli
    from tests.support import faultkit as fk

    mark = fk.new_mark()
    toml = fk.write_profile(tmp_path / "p.toml", fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b"}]))
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", "--no-report",
                      "--engine-args", "--token-delay 0.001", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert {s["arms"][0] for s in record["services"]} == {"a", "b"}
    assert all(s["command"][-2:] == ["--token-delay", "0.001"] for s in record["services"])
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "bad"), "-q", "--engine-args", "'--x",
                      cwd=tmp_path)
    assert res.returncode == 2 and "--engine-args: No closing quotation" in fk.flat(res.stderr), res.stderr
    assert not (tmp_path / "bad").exists() and not fk.marked_processes(mark)


def test_the_profile_reference_is_a_valid_profile() -> None:
    """The annotated example in the profile reference (docs/profiles.md) is what users copy: it must validate
    as it stands."""
    import tomllib

    from abbench.profile import profile_from_dict

    reference = (PROFILES_DIR.parent / "docs" / "profiles.md").read_text()
    block = reference.split("```toml", 1)[1].split("```", 1)[0]
    prof = profile_from_dict(tomllib.loads(block), where="docs/profiles.md")
    assert prof.engine.reset_path == "/reset" and [a.name for a in prof.arms] == ["chunked"]


def test_an_unknown_field_suggests_the_closest_known_one(tmp_path: Path) -> None:
    """A misspelt field names the field it is closest to, in its own table (nested and in arrays of tables
    too); a name close to none gets no guess."""
    text = (PROFILES_DIR / "cpu-tiny.toml").read_text()
    for old, new in (("max_tokens = 16", "max_token = 16"), ("health_timeout_s = 120", "helth_timeout_s = 120"),
                     ('expect_path = "chunked"', 'expect_paths = "chunked"'), ("per_length = 1", "zzz = 1")):
        assert old in text
        text = text.replace(old, new, 1)
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_profile(str(p))
    msg = str(e.value)
    assert "request.max_token: unknown field (did you mean 'max_tokens'?" in msg
    assert "engine.helth_timeout_s: unknown field (did you mean 'health_timeout_s'?" in msg
    assert "arms.0.expect_paths: unknown field (did you mean 'expect_path'?" in msg
    assert "prompts.zzz: unknown field (check the spelling" in msg
