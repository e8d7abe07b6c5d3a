"""Where profiles come from: a path to a TOML file (used as given), or a name looked up in ``./profiles`` of
the working directory first, then among the bundled profiles; :func:`load_profile` reads and validates one
(TOML errors and validation errors are :class:`~abbench.errors.ConfigError` naming the file and field).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from abbench.errors import ConfigError
from abbench.profile.model import Profile, _validate

__all__ = [
    "BUNDLED_PROFILES_DIR", "DEFAULT_PROFILE", "LOCAL_PROFILES_DIR", "PROFILES_DIR", "ProfileEntry",
    "available_profiles", "load_profile", "profile_dirs", "resolve_profile_path",
]


def _bundled_profiles_dir() -> Path:
    """The profiles that ship with abbench: ``abbench/bundled_profiles/`` in an installed package (the wheel
    carries the repository's top-level ``profiles/`` there), else ``profiles/`` beside the package (a checkout
    or an editable install, where ``profiles/`` itself is the source)."""
    here = Path(__file__).resolve().parent.parent  # abbench/
    installed = here / "bundled_profiles"
    if installed.is_dir() and any(installed.glob("*.toml")):
        return installed
    return here.parent / "profiles"


BUNDLED_PROFILES_DIR = _bundled_profiles_dir()
PROFILES_DIR = BUNDLED_PROFILES_DIR  # the bundled profiles (the name older callers use)
LOCAL_PROFILES_DIR = Path("profiles")  # ./profiles in the working directory, looked at before the bundled ones
DEFAULT_PROFILE = "cpu-tiny"


@dataclass(frozen=True)
class ProfileEntry:
    """One profile file found by :func:`available_profiles`: its name, path and where it came from
    (``"./profiles"`` or ``"bundled"``); ``shadowed_by`` is set on a bundled profile that a ``./profiles``
    file of the same name hides."""

    name: str
    path: Path
    source: str
    shadowed_by: Path | None = None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def profile_dirs(cwd: Path | None = None) -> list[tuple[str, Path]]:
    """Where profile names are looked up, in order: ``./profiles`` in the working directory (``cwd``), then
    the bundled profiles. In the repository root both are the same folder; it is listed once, as bundled."""
    local = (cwd or Path.cwd()) / LOCAL_PROFILES_DIR
    dirs: list[tuple[str, Path]] = []
    if local.is_dir() and not _same_dir(local, BUNDLED_PROFILES_DIR):
        dirs.append(("./profiles", local))
    dirs.append(("bundled", BUNDLED_PROFILES_DIR))
    return dirs


def available_profiles(cwd: Path | None = None) -> list[ProfileEntry]:
    """Every profile file a name can reach, the winning one first for each name (see :func:`profile_dirs`)."""
    entries: list[ProfileEntry] = []
    seen: dict[str, Path] = {}
    for source, d in profile_dirs(cwd):
        for p in sorted(d.glob("*.toml")):
            entries.append(ProfileEntry(p.stem, p, source, shadowed_by=seen.get(p.stem)))
            seen.setdefault(p.stem, p)
    return entries


def resolve_profile_path(name_or_path: str | None, cwd: Path | None = None) -> Path:
    """A path to a TOML file (used as given), or a profile name (``cpu-tiny``) looked up in ``./profiles``
    of the working directory first, then among the bundled profiles."""
    if name_or_path is None:
        name_or_path = DEFAULT_PROFILE
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists() or "/" in name_or_path:
        if not p.is_file():
            raise ConfigError(f"profile file {p} does not exist")
        return p
    for _, d in profile_dirs(cwd):
        candidate = d / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    known = sorted({e.name for e in available_profiles(cwd)})
    looked = " and ".join(str(d) for _, d in profile_dirs(cwd))
    import difflib

    close = difflib.get_close_matches(name_or_path, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ConfigError(
        f"no profile named {name_or_path!r} (looked in {looked}): {hint}pass a path to a .toml file or one of: "
        f"{', '.join(known) or '(none)'}"
    )


def load_profile(name_or_path: str | None = None) -> Profile:
    """Load and validate a profile; every error is a :class:`ConfigError` naming the file and field."""
    path = resolve_profile_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    if "source_path" in data:
        raise ConfigError(f"{path}: source_path: unknown field (it is set by abbench, not by the profile)")
    data["source_path"] = str(path.resolve())
    return _validate(data, str(path))

