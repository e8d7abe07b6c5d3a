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
from abbench.errors import AbbenchError, ConfigError



def _first_divergence(record, prompt: str | None, arm: str | None, round_: int | None):  # type: ignore[no-untyped-def]
    """``(prompt, arm)`` as given, else the run's first divergence from the parity reference (said on stderr);
    ConfigError when nothing diverges there."""
    from abbench.diagnostics.diff import first_divergence

    if prompt is not None and arm is not None:
        return prompt, arm, None
    d = first_divergence(record, prompt_id=prompt, arm=arm, round=round_)
    if d is None:
        where = " and ".join(x for x in (f"prompt {prompt}" if prompt else "", f"arm {arm}" if arm else "") if x)
        raise ConfigError(f"no measured output of run {record.run_id}{' for ' + where if where else ''} differs from "
                          "the parity reference's: nothing diverges; name --prompt (and --arm) to look anyway")
    console.print(f"first divergence: {d.describe()}", highlight=False)
    return d.prompt_id, d.arm, d


def diff(
    run: RunArg = None,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", help="Prompt id (see the report or `abbench prompts`). Default: the prompt of the run's first "
        "divergence from the reference (the earliest output position over every prompt, arm and round).")] = None,
    arm: Annotated[Optional[str], typer.Option(
        help="Arm to compare with the reference. Default: the first that differs.")] = None,
    round_: Annotated[Optional[int], typer.Option(
        "--round", min=1, help="Round. Default: the lowest where they differ.")] = None,
    context: Annotated[Optional[int], typer.Option(
        min=0, help="Show only this many positions either side of the divergence.")] = None,
) -> None:
    """Print the reference arm's and another arm's ids for one prompt side by side (token text, top-2
    logprobs), the first divergence marked and classified (near-tie or not).

    Examples:

    \b
      abbench diff results/chunk-sizes-bf16
      abbench diff results/chunk-sizes-bf16 --prompt fresh-1024-1 --arm chunk96 --context 3
      abbench diff results/readme-cpu-tiny --prompt fresh-384-0    # identical over all 16 ids
    """
    from abbench.diagnostics.diff import diff_prompt, format_diff, load_run_tokenizer
    from abbench.results import load_run

    try:
        record, _ = load_run(_run_or_latest(run), RESULTS_ROOT)
        if prompt is None:
            prompt, arm, _ = _first_divergence(record, None, arm, round_)
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
    run: RunArg = None,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", help="Prompt id. Default: the prompt of the run's first divergence.")] = None,
    arm: Annotated[Optional[str], typer.Option(
        "--arm", help="Arm to probe (fed the reference's ids). Default: the arm of the run's first "
        "divergence.")] = None,
    base_url: Annotated[Optional[str], typer.Option(
        help="A running server with the arm's configuration. Default: launch the arm's service from the "
        "recorded profile.")] = None,
    round_: Annotated[Optional[int], typer.Option(
        "--round", min=1, help="Reference round. Default: its lowest.")] = None,
    positions: Annotated[Optional[int], typer.Option(min=1, help="Probe only the first N positions.")] = None,
    logprob_delta: Annotated[float, typer.Option(
        "--logprob-delta", min=0.0, metavar="NATS",
        help="A probed logprob further than this from the reference's own is reported as the first "
        "difference.")] = 0.01,
    reset_each: Annotated[bool, typer.Option(
        help="Reset the engine's cache before every step (each step prefills the whole history).")] = False,
    layers: Annotated[bool, typer.Option(
        "--layers", help="Layer probe: trace the reference and the arm on one history and print the first layer "
        "and sub-block where their hidden states differ (vendored engine or transformers reference).")] = False,
    position: Annotated[Optional[int], typer.Option(
        min=0, help="--layers: trace the state that picks output token N (prompt + the reference's first N "
        "ids); 0 = the last prompt position. Default: the output position where the arm first diverged from "
        "the reference in the run (0 when it never did).")] = None,
    ref_base_url: Annotated[Optional[str], typer.Option(
        help="--layers: a running server with the reference arm's configuration.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="--layers: also write a Markdown report (and a PNG plot beside it) to this file.")] = None,
    numerics: Annotated[bool, typer.Option(
        "--numerics", help="Numerics probe: the arm's KL from the run's parity reference over the whole "
        "vocabulary at each compared position (up to the first divergence), beside the top-k lower bound a run's "
        "verdict has (vendored engine or transformers reference; --positions caps it; --ref-base-url: the "
        "reference's server).")] = False,
    all_prompts: Annotated[bool, typer.Option(
        "--all-prompts", help="--numerics: every prompt the arm has a measured ok sample of, each side's service "
        "launched once, then every compared position pooled.")] = False,
) -> None:
    """Forced-continuation probe: feed the arm the prompt plus the reference's own ids, one position at a
    time, and compare its logprobs and choices with what the reference captured. With --layers: where in
    the network the arm's hidden state first differs from the reference's. Launches the services it needs
    from the run's recorded profile (or uses --base-url / --ref-base-url). Without --prompt and --arm: the
    run's first divergence; with --layers and no --position, at the output position where it diverged.

    Examples:

    \b
      abbench probe results/chunk-sizes-bf16 --layers --out layers.md
      abbench probe results/20261205t-cpu-tiny-fp8 --arm fp8 --numerics --positions 2
    """
    from abbench.diagnostics.diff import format_probe, load_run_tokenizer
    from abbench.diagnostics.probe import probe_prompt
    from abbench.results import load_run

    if all_prompts and (not numerics or prompt is not None):
        _fail(ConfigError("--all-prompts goes with --numerics, in place of --prompt"))
        return
    try:
        record, _ = load_run(_run_or_latest(run), RESULTS_ROOT)
        if numerics:
            prompt, arm = _numerics_target(record, prompt, arm, quiet=all_prompts)
        else:
            prompt, arm, found = _first_divergence(record, prompt, arm, round_)
    except AbbenchError as e:
        _fail(e)
        return
    if numerics:
        _probe_numerics(record, prompt, arm, round_=round_, positions=positions, base_url=base_url,
                        ref_base_url=ref_base_url, all_prompts=all_prompts)
        return
    if layers:
        if position is None:
            from abbench.diagnostics.diff import first_divergence

            d = found or first_divergence(record, prompt_id=prompt, arm=arm, round=round_)
            position = d.position if d is not None else 0
            console.print(f"--position {position}: " + ("where the arm first diverged in the run" if d else
                                                        "the arm never diverged: the last prompt position"))
        _probe_layers(record, run, prompt, arm, position=position, round_=round_, base_url=base_url,
                      ref_base_url=ref_base_url, out=out)
        return
    try:
        where = f" at {base_url}" if base_url else " (launching its service)"
        console.print(f"probing arm {arm} on prompt {prompt}{where}")
        result = probe_prompt(record, prompt, arm, base_url=base_url, round=round_, positions=positions,
                              threshold=logprob_delta, reset_each=reset_each)
        try:
            tok = load_run_tokenizer(record)
        except AbbenchError:
            tok = None
    except AbbenchError as e:
        _fail(e)
        return
    sys.stdout.write(format_probe(result, tokenizer=tok))


def _numerics_target(record, prompt: str | None, arm: str | None,  # type: ignore[no-untyped-def]
                     quiet: bool = False) -> tuple[str, str]:
    """--numerics: ``arm`` as given, else the first arm whose numerics the run judges; ``prompt`` as given, else that
    arm's first measured ok prompt (said on stderr)."""
    from abbench.analysis.frames import measured_ok
    from abbench.analysis.numerics import compared_arms

    if arm is None:
        judged = compared_arms(record)
        if not judged:
            raise ConfigError(f"run {record.run_id} judges no arm's numerics (parity = \"numerics\" or a numerics "
                              "check); name --arm")
        arm = judged[0]
    if prompt is None:
        first = next((s.prompt_id for s in sorted(measured_ok(record), key=lambda s: s.step) if s.arm == arm), None)
        if first is None:
            raise ConfigError(f"arm {arm} has no measured ok sample in run {record.run_id}; name --prompt")
        prompt = first
        if not quiet:
            console.print(f"--prompt {prompt}: arm {arm}'s first measured prompt", highlight=False)
    return prompt, arm


def _probe_numerics(record, prompt: str, arm: str, *, round_: int | None,  # type: ignore[no-untyped-def]
                    positions: int | None, base_url: str | None, ref_base_url: str | None,
                    all_prompts: bool = False) -> None:
    from abbench.analysis.frames import measured_ok
    from abbench.diagnostics.numerics_probe import format_numerics, format_numerics_summary, probe_numerics_prompts
    from abbench.profile import profile_from_dict

    try:
        ref = profile_from_dict(record.profile, where=f"run {record.run_id} profile").parity_reference_arm
        prompts = (list(dict.fromkeys(s.prompt_id for s in sorted(measured_ok(record), key=lambda s: s.step)
                                      if s.arm == arm)) if all_prompts else [prompt])
        where = f"{len(prompts)} prompts" if all_prompts else f"prompt {prompt}"
        console.print(f"numerics probe: arm {arm} against {ref} on {where} (launching what has no URL)")
        urls = {k: v for k, v in ((arm, base_url), (ref, ref_base_url)) if v}
        results = probe_numerics_prompts(record, prompts, arm, base_urls=urls, round=round_, positions=positions)
    except AbbenchError as e:
        _fail(e)
        return
    sys.stdout.write(format_numerics_summary(results) if all_prompts else format_numerics(results[0]))


def _probe_layers(record, run: Path | None, prompt: str, arm: str, *, position: int,  # type: ignore[no-untyped-def]
                  round_: int | None, base_url: str | None, ref_base_url: str | None, out: Path | None) -> None:
    from abbench.diagnostics.layertrace import format_layers, layers_markdown, plot_layers
    from abbench.diagnostics.layers import probe_layers

    try:
        from abbench.profile import profile_from_dict

        profile = profile_from_dict(record.profile, where=f"run {record.run_id} profile")
        known = arm in {a.name for a in profile.arms}
        ref = (known and profile.arm(arm).parity_reference) or profile.parity_reference_arm  # its own, else the run's
        console.print(f"layer probe: arm {arm} against {ref} on prompt {prompt} (launching what has no URL)")
        urls = {k: v for k, v in ((arm, base_url), (ref, ref_base_url)) if v}
        result = probe_layers(record, prompt, arm, position=position, round=round_, base_urls=urls)
    except AbbenchError as e:
        _fail(e)
        return
    sys.stdout.write(format_layers(result))
    if out is not None:
        png = plot_layers(result, out.with_suffix(".png"))
        command = " ".join(["abbench", "probe", str(run or record.run_id), "--prompt", prompt, "--arm", arm,
                            "--layers", "--position", str(position)])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(layers_markdown(result, plot=png.name if png else None, command=command), encoding="utf-8")
        console.print(f"report -> {out}")
