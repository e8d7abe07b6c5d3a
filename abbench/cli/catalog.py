"""What a profile reaches before anything runs: ``prompts`` (the built prompts, their token counts and hashes)
and ``profiles`` (every profile a name finds, and where it came from).
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer
from rich.table import Table

from abbench.cli.common import JsonOpt, ProfileOpt, _fail, _parse_lengths, console, out
from abbench.errors import AbbenchError, ConfigError



def prompts(
    profile: ProfileOpt = None,
    lengths: Annotated[Optional[str], typer.Option(help="Fresh prompt lengths, e.g. 512,2k.")] = None,
    show: Annotated[Optional[str], typer.Option(help="Print the full text of this prompt id.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build the profile's prompts and print their ids, token counts and sha256 (for inspection).

    Examples:

    \b
      abbench prompts
      abbench prompts -p cpu-tiny --lengths 512,2k --json
      abbench prompts --show fresh-384-0
    """
    from abbench.profile import load_profile
    from abbench.prompts import build_prompts, check_lengths
    from abbench.runner import profile_dir
    from abbench.tokenizers import load_tokenizer

    try:
        prof = load_profile(profile).with_overrides(lengths=_parse_lengths(lengths))
        check_lengths(prof.prompts)  # before the tokenizer loads
        t0 = time.perf_counter()
        tok = load_tokenizer(prof.tokenizer.source, base_dir=profile_dir(prof))
        t1 = time.perf_counter()
        built = build_prompts(tok, prof.prompts, base_dir=profile_dir(prof))
        if prof.sweep is not None:  # a sweep's grid (refinement points are added as the run finds them)
            from abbench.runner.sweep import build_points

            built += build_points(tok, prof, list(prof.sweep.points))
        t2 = time.perf_counter()
    except AbbenchError as e:
        _fail(e)
        return
    if show:
        match = [b for b in built if b.record.id == show]
        if not match:
            _fail(ConfigError(f"--show: no prompt {show!r}; ids are {', '.join(b.record.id for b in built)}"))
        sys.stdout.write(match[0].text)
        return
    if as_json:
        from abbench.cli.documents import emit, prompts_document

        emit(prompts_document(prof, built))
        return
    total = sum(b.record.token_count for b in built)
    table = Table(title=f"{prof.name}: {len(built)} prompts, {total:,} tokens")
    for col, width in (("id", 18), ("kind", 12), ("tokens", 7), ("corpus", 8), ("sha256", 12)):
        table.add_column(col, no_wrap=True, min_width=width, justify="right" if col == "tokens" else "left")
    table.add_column("preview", no_wrap=True, overflow="ellipsis")
    for b in built:
        r = b.record
        table.add_row(r.id, r.kind, str(r.token_count), r.corpus, r.sha256[:12],
                      " ".join(r.preview.split())[:48])
    out.print(table)
    console.print(f"tokenizer {prof.tokenizer.source!r} loaded in {t1 - t0:.2f} s; prompts built and "
                  f"checked (exact length, re-encoded) in {t2 - t1:.2f} s")


def profiles(as_json: JsonOpt = False) -> None:
    """List the profiles a name reaches: ./profiles in the working directory first, then the bundled ones
    (each row says where it came from; a bundled profile hidden by a ./profiles file of the same name is
    marked). Names are never cut; --json gives every field.

    Examples:

    \b
      abbench profiles
      abbench profiles --json
    """
    from abbench.profile import available_profiles, load_profile, profile_dirs

    rows = []
    for e in available_profiles():
        row = {"name": e.name, "source": e.source, "path": str(e.path), "hidden_by": e.shadowed_by, "arms": None,
               "description": None, "error": None}
        try:
            prof = load_profile(str(e.path))
            row.update(arms=[a.name for a in prof.arms], description=prof.description)
        except AbbenchError as err:
            row["error"] = str(err).splitlines()[-1].strip()
        rows.append(row)
    if as_json:
        from abbench.cli.documents import emit, profiles_document

        emit(profiles_document(profile_dirs(), rows))
        return
    table = Table(title="profiles (" + ", then ".join(f"{src}: {d}" for src, d in profile_dirs()) + ")")
    width = max((len(r["name"]) for r in rows), default=4)
    table.add_column("name", no_wrap=True, min_width=width)  # never cut: scripts grep for it
    table.add_column("source", no_wrap=True)
    table.add_column("arms", overflow="fold")
    table.add_column("description", overflow="fold")
    for r in rows:
        source = r["source"] if r["hidden_by"] is None else f"{r['source']} (hidden by {r['hidden_by']})"
        if r["error"] is None:
            table.add_row(r["name"], source, ",".join(r["arms"]), r["description"])
        else:
            table.add_row(r["name"], source, "[red]invalid[/]", r["error"])
    out.print(table)
