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
