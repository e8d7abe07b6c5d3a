"""The divergence diagnostics: ``diff`` (two arms' ids side by side, the first divergence classified) and
``probe`` (the forced-continuation probe; with ``--layers`` the first layer and sub-block whose hidden states
differ). They load :mod:`abbench.diagnostics` only when called.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from abbench.cli.common import RESULTS_ROOT, RunArg, _fail, _run_or_latest, console
from abbench.errors import AbbenchError



def diff(
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt id (see the report or `abbench prompts`).")],
    run: RunArg = None,
    arm: Annotated[Optional[str], typer.Option(
        help="Arm to compare with the reference. Default: the first that differs.")] = None,
    round_: Annotated[Optional[int], typer.Option(
        "--round", min=1, help="Round. Default: the lowest where they differ.")] = None,
    context: Annotated[Optional[int], typer.Option(
        min=0, help="Show only this many positions either side of the divergence.")] = None,
) -> None:
    """Print the reference arm's and another arm's ids for one prompt side by side (token text, top-2
    logprobs), the first divergence marked and classified (near-tie or not)."""
    from abbench.diagnostics.diff import diff_prompt, format_diff, load_run_tokenizer
    from abbench.results import load_run

    try:
        record, _ = load_run(_run_or_latest(run), RESULTS_ROOT)
        diff_prompt(record, prompt, arm=arm, round=round_)  # a wrong --prompt/--arm fails before loading it
        try:
            tok = load_run_tokenizer(record)
        except AbbenchError as e:
            console.print(f"[yellow]note:[/] token texts not shown: {e}")
            tok = None
        d = diff_prompt(record, prompt, arm=arm, round=round_, tokenizer=tok)
    except AbbenchError as e:
        _fail(e)
        return
    sys.stdout.write(format_diff(d, tokenizer=tok, context=context))


def probe(
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt id.")],
    arm: Annotated[str, typer.Option("--arm", help="Arm to probe (fed the reference's ids).")],
    run: RunArg = None,
    base_url: Annotated[Optional[str], typer.Option(
        help="A running server with the arm's configuration. Default: launch the arm's service from the "
        "recorded profile.")] = None,
    round_: Annotated[Optional[int], typer.Option(
        "--round", min=1, help="Reference round. Default: its lowest.")] = None,
    positions: Annotated[Optional[int], typer.Option(min=1, help="Probe only the first N positions.")] = None,
    threshold: Annotated[float, typer.Option(
        min=0.0, help="Nats: logprob difference reported as the first difference.")] = 0.01,
    reset_each: Annotated[bool, typer.Option(
        help="Reset the engine's cache before every step (each step prefills the whole history).")] = False,
    layers: Annotated[bool, typer.Option(
        "--layers", help="Layer probe: trace the reference and the arm on one history and print the first layer "
        "and sub-block where their hidden states differ (vendored engine or transformers reference).")] = False,
    position: Annotated[int, typer.Option(
        min=0, help="--layers: trace the state that picks output token N (prompt + the reference's first N "
        "ids); 0 = the last prompt position.")] = 0,
    ref_base_url: Annotated[Optional[str], typer.Option(
        help="--layers: a running server with the reference arm's configuration.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="--layers: also write a Markdown report (and a PNG plot beside it) to this file.")] = None,
) -> None:
    """Forced-continuation probe: feed the arm the prompt plus the reference's own ids, one position at a
    time, and compare its logprobs and choices with what the reference captured. With --layers: where in
    the network the arm's hidden state first differs from the reference's."""
    from abbench.diagnostics.diff import format_probe, load_run_tokenizer
    from abbench.diagnostics.probe import probe_prompt
    from abbench.results import load_run

    if layers:
        _probe_layers(run, prompt, arm, position=position, round_=round_, base_url=base_url,
                      ref_base_url=ref_base_url, out=out)
        return
    try:
        record, _ = load_run(_run_or_latest(run), RESULTS_ROOT)
        where = f" at {base_url}" if base_url else " (launching its service)"
        console.print(f"probing arm {arm} on prompt {prompt}{where}")
        result = probe_prompt(record, prompt, arm, base_url=base_url, round=round_, positions=positions,
                              threshold=threshold, reset_each=reset_each)
        try:
            tok = load_run_tokenizer(record)
        except AbbenchError:
            tok = None
    except AbbenchError as e:
        _fail(e)
        return
    sys.stdout.write(format_probe(result, tokenizer=tok))


def _probe_layers(run: Path, prompt: str, arm: str, *, position: int, round_: int | None, base_url: str | None,
                  ref_base_url: str | None, out: Path | None) -> None:
    from abbench.diagnostics.layertrace import format_layers, layers_markdown, plot_layers
    from abbench.results import load_run
    from abbench.diagnostics.layers import probe_layers

    try:
        record, _ = load_run(run, RESULTS_ROOT)
        from abbench.profile import profile_from_dict

        ref = profile_from_dict(record.profile, where=f"run {record.run_id} profile").parity_reference_arm
        console.print(f"layer probe: arm {arm} against {ref} on prompt {prompt} (launching what has no URL)")
        urls = {k: v for k, v in ((arm, base_url), (ref, ref_base_url)) if v}
        result = probe_layers(record, prompt, arm, position=position, round=round_, base_urls=urls)
    except AbbenchError as e:
        _fail(e)
        return
    sys.stdout.write(format_layers(result))
    if out is not None:
        png = plot_layers(result, out.with_suffix(".png"))
        command = " ".join(["abbench", "probe", str(run), "--prompt", prompt, "--arm", arm, "--layers"]
                           + (["--position", str(position)] if position else []))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(layers_markdown(result, plot=png.name if png else None, command=command), encoding="utf-8")
        console.print(f"report -> {out}")
