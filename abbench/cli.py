"""The ``abbench`` command line (Typer). Thin: parse, load, call the core, show progress, map errors to exit
codes (0 ok, 1 gate failed, 2 usage/config/results error, 130 interrupted).

Commands: ``run``, ``report``, ``gate``, ``compare`` (two runs), ``diff`` and ``probe`` (divergence diagnostics), ``prompts``,
``profiles``, ``serve`` (the vendored engine), ``export-gguf`` (the engine's weights as a llama.cpp GGUF).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from abbench.errors import AbbenchError, ConfigError

app = typer.Typer(
    help="abbench: rigorous A/B validation of inference-engine changes (exact prompts, ABBA rounds, greedy "
    "parity, TTFT/H2D/VRAM telemetry, reports, a CI gate).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console()

RESULTS_ROOT = Path("results")
REPORTS_ROOT = Path("reports")


def _fail(e: AbbenchError) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
    raise typer.Exit(e.exit_code)


def _parse_csv(value: Optional[str], flag: str) -> Optional[list[str]]:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ConfigError(f"{flag}: give a comma-separated list")
    return items


def _parse_lengths(value: Optional[str]) -> Optional[list[int]]:
    items = _parse_csv(value, "--lengths")
    if items is None:
        return None
    out_: list[int] = []
    for it in items:
        mult = 1
        s = it.lower()
        if s.endswith("k"):
            mult, s = 1024, s[:-1]
        try:
            n = int(s) * mult
        except ValueError:
            raise ConfigError(f"--lengths: {it!r} is not a token count (e.g. 512, 4k, 32768)") from None
        if n <= 0:
            raise ConfigError(f"--lengths: {it!r} must be positive")
        out_.append(n)
    return out_


ProfileOpt = Annotated[
    Optional[str],
    typer.Option("--profile", "-p", help="A path to a .toml file, or a profile name: looked up in ./profiles, then "
                 "among the bundled profiles (`abbench profiles` lists them). Default: cpu-tiny."),
]


@app.command()
def run(
    profile: ProfileOpt = None,
    arms: Annotated[Optional[str], typer.Option(help="Comma-separated arms to run, in order (A,B). Default: all.")] = None,
    rounds: Annotated[Optional[int], typer.Option(min=1, help="Rounds; arm order reverses every round.")] = None,
    lengths: Annotated[Optional[str], typer.Option(help="Fresh prompt lengths, e.g. 512,2k,4k.")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Run directory. Default: results/<run-id>.")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish an interrupted run in this directory.")] = None,
    report: Annotated[bool, typer.Option(help="Render the Markdown report when the run ends.")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Run an A/B experiment: build exact prompts, drive every arm in ABBA rounds, record every sample."""
    from abbench import runner
    from abbench.profile import load_profile

    try:
        if resume is not None:
            if any(v is not None for v in (profile, arms, rounds, lengths, out_dir)):
                raise ConfigError("--resume continues a run with its recorded profile; drop the other options")
            prof = None
            run_dir = resume
        else:
            prof = load_profile(profile).with_overrides(arms=_parse_csv(arms, "--arms"), rounds=rounds,
                                                        lengths=_parse_lengths(lengths))
            run_dir = out_dir or RESULTS_ROOT / runner.new_run_id(prof)
            runner.check_run_dir_free(run_dir)
        t0 = time.perf_counter()
        record = _run_with_progress(runner, prof, run_dir, resume=resume is not None, quiet=quiet)
        ok = sum(1 for s in record.samples if s.ok)
        console.print(f"run {record.status}: {len(record.samples)} samples ({ok} ok) in "
                      f"{time.perf_counter() - t0:.1f} s -> {run_dir}")
        kinds = Counter(s.error_kind or "error" for s in record.samples if not s.ok)
        if kinds:
            console.print(f"[yellow]note:[/] {sum(kinds.values())} failed sample(s): "
                          + ", ".join(f"{n} {k}" for k, n in kinds.most_common()), highlight=False)
        if report:
            _render_report(run_dir)
        if record.status != "complete":  # stopped by run.on_request_failure = stop: not a finished run
            raise AbbenchError(f"the run is {record.status}: {record.status_reason}; finish it with "
                               f"`abbench run --resume {run_dir}`")
    except AbbenchError as e:
        _fail(e)
    except KeyboardInterrupt:  # outside the runner (it maps its own): loading the profile, the report
        console.print("[bold red]error:[/] interrupted", highlight=False)
        raise typer.Exit(130) from None


def _run_with_progress(runner, prof, run_dir: Path, *, resume: bool, quiet: bool):  # type: ignore[no-untyped-def]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if prof is None:  # resume: the runner loads the recorded profile
        from abbench.profile import profile_from_dict
        from abbench.results import load_run

        rec, _ = load_run(run_dir)
        prof = profile_from_dict(rec.profile, where=f"{run_dir}/run.json")
    argv = sys.argv[:]

    def warn(ev) -> None:  # type: ignore[no-untyped-def]
        from rich.markup import escape

        console.print(f"[yellow]warning:[/] {escape(ev.message)}", highlight=False)

    if quiet:  # no progress display, but warnings (a skipped arm, a restarted service) still show
        return runner.execute(prof, run_dir, resume=resume, argv=argv,
                              observer=lambda ev: warn(ev) if ev.kind == "warning" else None)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
        transient=False,
    )
    task = progress.add_task("preparing", total=None, last="")

    def observe(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.kind == "sample" and ev.sample is not None:
            s = ev.sample
            last = (f"{s.arm} {s.prompt_id} ttft={s.ttft_s * 1e3:.1f} ms" if s.ok and s.ttft_s is not None
                    else f"{s.arm} {s.prompt_id} FAILED ({s.error_kind})")
            progress.update(task, completed=ev.done, total=ev.total, description="running", last=last)
        elif ev.kind == "service":
            progress.update(task, description=ev.message, completed=ev.done, total=ev.total or None)
        elif ev.kind == "prompts":
            progress.update(task, description=ev.message)
        elif ev.kind == "warning":
            warn(ev)

    with progress:
        return runner.execute(prof, run_dir, resume=resume, observer=observe, argv=argv)


def _run_or_latest(run: Optional[Path]) -> Path:
    """``run`` as given, or the most recent run under ./results (said on stderr); ResultsError when none."""
    if run is not None:
        return run
    from abbench.results import latest_run

    found = latest_run(RESULTS_ROOT)
    console.print(f"no run given: using the latest under {RESULTS_ROOT}/: {found}", highlight=False)
    return found


RunArg = Annotated[Optional[Path], typer.Argument(
    help="Run directory (or run id under results/). Default: the most recent run under ./results/.")]


def _render_report(run: Path, out: Optional[Path] = None) -> Path:
    from abbench.report import write_report
    from abbench.results import load_run

    record, problems = load_run(run, RESULTS_ROOT)
    root = out or REPORTS_ROOT
    md = write_report(record, problems, root / f"{record.run_id}.md", root / record.run_id)
    console.print(f"report -> {md}")
    return md


@app.command()
def report(
    run: RunArg = None,
    out: Annotated[Optional[Path], typer.Option(help="Reports folder. Default: reports/.")] = None,
) -> None:
    """Render reports/<run-id>.md and its PNG plots from a run directory."""
    try:
        _render_report(_run_or_latest(run), out)
    except AbbenchError as e:
        _fail(e)


@app.command()
def gate(
    run: RunArg = None,
    parity_tokens: Annotated[
        Optional[int], typer.Option(min=1, help="First K greedy ids that must match. Default: the profile's.")
    ] = None,
    check: Annotated[Optional[list[str]], typer.Option(
        "--check", help="A declared check, METRIC[ARM(, KIND)(, >=TOKENS|<=TOKENS)] OP VALUE (repeatable), on top "
        "of the profile's gate.checks; e.g. 'ttft_ratio[layer-major, fresh, >=32768] <= 0.15'.")] = None,
    checks_from: Annotated[Optional[str], typer.Option(
        "--checks-from", help="Also judge the gate.checks of this profile (name or .toml), e.g. a run recorded "
        "before its profile declared them.")] = None,
    accept_near_ties: Annotated[
        Optional[float], typer.Option(min=1e-9, help="Accept near-tie flips whose top-2 margin is "
                                      "below this many nats (arms with their own accept_near_ties keep it). Default: the "
                                      "profile's gate.accept_near_ties.")
    ] = None,
) -> None:
    """Exit 0 when every prompt's first K ids match the parity reference arm (or, where accepted, flip at a near
    tie) and the declared checks hold; 1 when
    not (naming prompt, arm and position, or the check and its cell); 2 on a usage or results error (a bad
    check expression or an unknown arm included)."""
    from rich.markup import escape

    from abbench.analysis import gate as judge
    from abbench.results import load_run

    try:
        record, problems = load_run(_run_or_latest(run), RESULTS_ROOT)
        extra = list(check or [])
        if checks_from is not None:
            from abbench.profile import load_profile

            extra = load_profile(checks_from).gate.checks + extra
        verdict = judge(record, parity_tokens=parity_tokens, checks=extra, accept_near_ties=accept_near_ties)
    except AbbenchError as e:
        _fail(e)
        return
    for p in problems:
        console.print(f"[yellow]note:[/] {p}")
    table = Table(title=f"gate: {record.run_id}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for c in verdict.checks:
        colour = "green" if c.passed else "yellow" if c.result == "inconclusive" else "red"
        table.add_row(escape(c.name), f"[{colour}]{c.result}[/]", escape(c.detail))
    out.print(table)
    for c in verdict.checks:  # declared checks, unwrapped: one line per cell they judged
        if "[" in c.name:
            out.print(f"check {escape(c.name)}: {c.result}", highlight=False, soft_wrap=True)
            for cell in c.detail.split("; "):
                out.print(f"  {escape(cell)}", highlight=False, soft_wrap=True)
    for f in verdict.failures:
        out.print(f"[red]FAIL[/] {escape(f)}", highlight=False, soft_wrap=True)
    for n in verdict.notes:
        out.print(f"[yellow]note:[/] {escape(n)}", highlight=False, soft_wrap=True)
    if not verdict.passed:
        out.print("[bold red]gate: FAIL[/]")
        raise typer.Exit(1)
    out.print("[bold green]gate: PASS[/]")


@app.command()
def compare(
    base: Annotated[Path, typer.Argument(help="The base run (e.g. main): a run directory or id under results/.")],
    cand: Annotated[Path, typer.Argument(help="The candidate run (e.g. the PR), made with the same profile.")],
    threshold: Annotated[float, typer.Option(
        min=0.0, help="Exit 1 when a metric is worse by more than this fraction with its whole 95% interval "
        "beyond it.")] = 0.05,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write the Markdown here (default: stdout).")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        help="The plot (PNG). Default: next to --out (<out>.png); none when writing to stdout.")] = None,
) -> None:
    """Compare two runs of one profile (main vs a PR): per arm, kind and length the median TTFT, decode
    rate, H2D and peak device memory, the change with a 95% bootstrap interval, and the fingerprint
    differences. Exit 0 no regression, 1 a regression beyond --threshold, 2 when the prompts or the tokenizer
    differ (or a usage error)."""
    import os

    from abbench.compare import compare as compare_runs
    from abbench.compare import plot_changes, render_markdown
    from abbench.results import load_run

    try:
        rb, _ = load_run(base, RESULTS_ROOT)
        rc, _ = load_run(cand, RESULTS_ROOT)
        c = compare_runs(rb, rc, threshold=threshold)
    except AbbenchError as e:
        _fail(e)
        return
    plot_path = plot or (out_file.with_suffix(".png") if out_file is not None else None)
    link = None
    if plot_path is not None and plot_changes(c, plot_path):
        where = out_file.parent if out_file is not None else Path.cwd()
        link = Path(os.path.relpath(plot_path, where)).as_posix()
    text = render_markdown(c, link)
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(text, encoding="utf-8")
        console.print(f"compare -> {out_file}" + (f" (plot {plot_path})" if link else ""))
    else:
        sys.stdout.write(text)
    if len(c.regressions):
        console.print(f"[bold red]compare: {len(c.regressions)} regression(s) beyond {threshold:.0%}[/]")
        raise typer.Exit(1)


@app.command()
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
    from abbench.diff import diff_prompt, format_diff, load_run_tokenizer
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


@app.command()
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
    from abbench.diff import format_probe, load_run_tokenizer
    from abbench.runner import probe_prompt
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
    from abbench.layertrace import format_layers, layers_markdown, plot_layers
    from abbench.results import load_run
    from abbench.runner.layers import probe_layers

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


@app.command()
def prompts(
    profile: ProfileOpt = None,
    lengths: Annotated[Optional[str], typer.Option(help="Fresh prompt lengths, e.g. 512,2k.")] = None,
    show: Annotated[Optional[str], typer.Option(help="Print the full text of this prompt id.")] = None,
) -> None:
    """Build the profile's prompts and print their ids, token counts and sha256 (for inspection)."""
    from abbench.profile import load_profile
    from abbench.prompts import build_prompts
    from abbench.runner import profile_dir
    from abbench.tokenizers import load_tokenizer

    try:
        prof = load_profile(profile).with_overrides(lengths=_parse_lengths(lengths))
        t0 = time.perf_counter()
        tok = load_tokenizer(prof.tokenizer.source, base_dir=profile_dir(prof))
        t1 = time.perf_counter()
        built = build_prompts(tok, prof.prompts, base_dir=profile_dir(prof))
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
    total = sum(b.record.token_count for b in built)
    table = Table(title=f"{prof.name}: {len(built)} prompts, {total:,} tokens")
    for col, width in (("id", 16), ("kind", 12), ("tokens", 7), ("corpus", 8), ("sha256", 12)):
        table.add_column(col, no_wrap=True, min_width=width, justify="right" if col == "tokens" else "left")
    table.add_column("preview", no_wrap=True, overflow="ellipsis")
    for b in built:
        r = b.record
        table.add_row(r.id, r.kind, str(r.token_count), r.corpus, r.sha256[:12],
                      " ".join(r.preview.split())[:48])
    out.print(table)
    console.print(f"tokenizer {prof.tokenizer.source!r} loaded in {t1 - t0:.2f} s; prompts built and "
                  f"checked (exact length, re-encoded) in {t2 - t1:.2f} s")


@app.command()
def profiles() -> None:
    """List the profiles a name reaches: ./profiles in the working directory first, then the bundled ones
    (each row says where it came from; a bundled profile hidden by a ./profiles file of the same name is
    marked)."""
    from abbench.profile import available_profiles, load_profile, profile_dirs

    table = Table(title="profiles (" + ", then ".join(f"{src}: {d}" for src, d in profile_dirs()) + ")")
    table.add_column("name")
    table.add_column("source")
    table.add_column("arms")
    table.add_column("description")
    for e in available_profiles():
        source = e.source if e.shadowed_by is None else f"{e.source} (hidden by {e.shadowed_by})"
        try:
            prof = load_profile(str(e.path))
            table.add_row(e.name, source, ",".join(a.name for a in prof.arms), prof.description)
        except AbbenchError as err:
            table.add_row(e.name, source, "[red]invalid[/]", str(err).splitlines()[-1])
    out.print(table)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Serve the vendored offloaded-MoE engine (OpenAI-compatible), or with `--backend transformers` a model's
    transformers implementation behind the same API (the reference). All other options pass through; see
    `abbench serve --help` and `abbench serve --backend transformers --help`."""
    args, backend = list(ctx.args), "engine"
    for i, a in enumerate(args):
        if a == "--backend" and i + 1 < len(args):
            backend = args[i + 1]
            del args[i:i + 2]
            break
        if a.startswith("--backend="):
            backend = a.split("=", 1)[1]
            del args[i]
            break
    if backend == "transformers":
        from abbench.engine.reference import main as reference_main

        raise typer.Exit(reference_main(args))
    if backend != "engine":
        raise typer.BadParameter(f"--backend {backend!r}: expected engine (the vendored engine, the default) or "
                                 "transformers (the reference)")
    from abbench.engine.server import main as engine_main

    engine_main(args)


@app.command("memory-plan")
def memory_plan_cmd(
    model: Annotated[str, typer.Option(help="The engine's preset (e.g. qwen3-30b-a3b-2507, qwen3.5-35b-a3b, "
                                            "qwen4-exp-half) or a local HF model directory.")] = "tiny",
    budget: Annotated[Optional[float], typer.Option(help="Device-memory budget in GB (1e9 bytes), the engine's "
                                                         "--gpu-memory-budget; without it, the smallest budget "
                                                         "each chunk length needs.")] = None,
    chunk_tokens: Annotated[str, typer.Option(help="Comma-separated prefill chunk lengths to compare.")] =
        "2048,4096,8192,16384",
    max_context: Annotated[int, typer.Option(help="The engine's --max-context (the KV cache's length).")] = 65536,
    window_tokens: Annotated[Optional[int], typer.Option(help="The engine's --layer-major-window-tokens "
                                                              "(default: the engine's).")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (the engine's --dtype on CUDA).")] = "bfloat16",
    resident: Annotated[bool, typer.Option(help="Plan for --prefill-mode resident (every expert on the "
                                                "device) instead of offloaded experts.")] = False,
) -> None:
    """What the vendored engine keeps on the GPU at each prefill chunk length, and the decode slot cache a
    budget leaves (the plan `--gpu-memory-budget` applies at start-up; no GPU needed). A longer chunk runs
    fewer, larger GEMMs but needs a larger workspace, so fewer experts stay cached for decode: choose the
    chunk length per budget here, then start the engine with it (`--chunk-tokens`)."""
    from abbench.engine.config import EngineConfig
    from abbench.engine.memory import plan_device_memory

    try:
        chunks = [int(c) for c in (_parse_csv(chunk_tokens, "--chunk-tokens") or [])]
    except ValueError:
        chunks = []
    if not chunks or any(c <= 0 for c in chunks):
        _fail(ConfigError(f"--chunk-tokens {chunk_tokens!r}: give positive token counts, e.g. 2048,8192"))
        return
    table = Table(title=f"device-memory plan: {model}, {dtype}, max context {max_context:,}"
                  + (f", budget {budget:g} GB" if budget is not None else "") + (", resident" if resident else ""))
    for col in ("chunk tokens", "workspace", "fixed (GB)", "slots/layer", "slot cache", "total", "note"):
        table.add_column(col, justify="left" if col == "note" else "right")
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    for chunk in chunks:
        knobs = dict(layer_major_window_tokens=window_tokens) if window_tokens else {}
        try:
            cfg = EngineConfig(model=model, device="cuda", dtype=dtype, chunk_tokens=chunk, max_context=max_context,
                               prefill_mode="resident" if resident else "chunked", **knobs).resolved()
        except (ValueError, AbbenchError) as e:
            _fail(e if isinstance(e, AbbenchError) else ConfigError(str(e)))
            return
        try:
            if budget is None:  # the least decode can run with: one token's experts in every layer
                k = 0 if resident else cfg.model.num_experts_per_tok
                unbounded = plan_device_memory(cfg, 1 << 62)
                plan = plan_device_memory(cfg, unbounded.fixed_bytes + k * unbounded.slot_bytes)
                note = f"needs at least {plan.total_bytes / 1e9:.2f} GB" + ("" if resident else f" ({k} slots per layer)")
            else:
                plan, note = plan_device_memory(cfg, int(budget * 1e9)), ""
        except ValueError as e:
            table.add_row(f"{chunk:,}", "", "", "", "", "", f"[red]does not fit[/]: {str(e).split(';')[0]}")
            continue
        table.add_row(f"{chunk:,}", gb(plan.workspace_bytes), gb(plan.fixed_bytes), str(plan.slots_per_layer),
                      gb(plan.slots_per_layer * plan.slot_bytes), gb(plan.total_bytes), note)
    out.print(table)


@app.command("export-gguf")
def export_gguf_cmd(
    model: Annotated[str, typer.Option(help="The engine's preset (a Qwen3-MoE shape: tiny, qwen3-30b-a3b-half, ...).")] = "tiny",
    weights: Annotated[str, typer.Option(help="random:SEED, the engine's --weights.")] = "random:0",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16: the engine's --dtype; the GGUF's matrices in it.")] = "float32",
    device: Annotated[str, typer.Option(help="Device the weights are drawn on: the one the engine runs on (cpu, "
                                             "cuda); a CUDA draw differs from a CPU one.")] = "cpu",
    out_path: Annotated[Optional[Path], typer.Option("--out", help="GGUF to write (default: the cache path the "
                                                     "profiles' llama.cpp command reads).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="Built-in vocabulary (default: qwen3 for 151,936 "
                                                          "rows).")] = None,
) -> None:
    """Write a llama.cpp `qwen3moe` GGUF of the vendored engine's own random weights (same values, same
    tokenizer), tensor by tensor, for an A/B run of the engine against llama.cpp (README "Against llama.cpp")."""
    try:
        from abbench.peers.gguf_export import export_gguf
        from abbench.peers.llamacpp_serve import gguf_cache_path

        import gguf  # noqa: F401  (the writer's one extra dependency)
    except ImportError as e:
        _fail(ConfigError(f"{e}: the GGUF export needs the gguf package: pip install 'abbench[peer]'"))
        return
    target = out_path or gguf_cache_path(model, weights, dtype, device)
    done = {"bytes": 0}

    def progress(name: str, nbytes: int) -> None:
        done["bytes"] += nbytes
        if name.endswith("ffn_down_exps.weight") or not name.startswith("blk."):
            console.print(f"  {name}: {done['bytes'] / 1e9:.2f} GB written", highlight=False)

    try:
        summary = export_gguf(model, target, weights=weights, dtype=dtype, device=device, tokenizer=tokenizer,
                              progress=progress)
    except (ValueError, AbbenchError) as e:
        _fail(e if isinstance(e, AbbenchError) else ConfigError(str(e)))
        return
    console.print(f"wrote {summary['path']}: {summary['bytes'] / 1e9:.3f} GB, {summary['tensors']} tensors, "
                  f"{summary['seconds']:.1f} s", highlight=False)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
