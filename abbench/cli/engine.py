"""The vendored engine's commands: ``serve`` (the engine, or the transformers reference, behind one API; its
options pass through), ``memory-plan`` (the device-memory plan a budget leaves, no GPU needed) and
``export-gguf`` (the engine's weights as a llama.cpp GGUF).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from abbench.cli.common import _fail, _parse_csv, console, out
from abbench.errors import AbbenchError, ConfigError


def serve(ctx: typer.Context) -> None:
    """Serve the vendored offloaded-MoE engine (OpenAI-compatible), or with `--backend transformers` a model's
    transformers implementation behind the same API (the reference). All other options pass through; see
    `abbench serve --help` and `abbench serve --backend transformers --help`."""
    from abbench.engine.serve.launch import main as serve_main  # --backend is the launcher's option

    raise typer.Exit(serve_main(list(ctx.args)))


def memory_plan_cmd(
    model: Annotated[str, typer.Option(help="The engine's preset (e.g. qwen3-30b-a3b-2507, qwen3.5-35b-a3b, "
                                            "qwen4-exp-half) or a local HF model directory.")] = "tiny",
    budget: Annotated[Optional[float], typer.Option(help="Device-memory budget in GiB (2^30 bytes, as cards are "
                                                         "sized: a 16 GB card holds 16 GiB), the engine's "
                                                         "--gpu-memory-budget; without it, the smallest budget "
                                                         "each chunk length needs.")] = None,
    chunk_tokens: Annotated[str, typer.Option(help="Comma-separated prefill chunk lengths to compare.")] =
        "2048,4096,8192,16384",
    max_context: Annotated[Optional[int], typer.Option(help="The engine's --max-context (the KV cache's length; "
                                                           "default: the model's own limit, as the engine's)."
                                                      )] = None,
    window_tokens: Annotated[Optional[int], typer.Option(help="The engine's --layer-major-window-tokens "
                                                              "(default: the engine's).")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (the engine's --dtype on CUDA).")] = "bfloat16",
    resident: Annotated[bool, typer.Option(help="Plan for --prefill-mode resident (every expert on the "
                                                "device) instead of offloaded experts.")] = False,
    max_num_seqs: Annotated[int, typer.Option(help="The engine's --max-num-seqs: sequences at once, one KV "
                                                   "cache of --max-context positions each.")] = 1,
    expert_dtype: Annotated[str, typer.Option(help="The engine's --expert-dtype: model (the host bank in --dtype) "
                                                   "or fp8 (the bank in float8 e4m3; the device adds a staging "
                                                   "area of one layer's FP8 experts).")] = "model",
    slot_dtype: Annotated[str, typer.Option(help="The engine's --slot-dtype: auto (an fp8 bank's slots hold its "
                                                 "float8 values and row scales, as on CUDA with Triton's decode "
                                                 "experts), model or fp8.")] = "auto",
    fp8_dequant: Annotated[str, typer.Option(help="The engine's --fp8-dequant for an fp8 bank: compute or copy "
                                                  "(layers dequantized into buffers in --dtype, through the "
                                                  "staging area) or gemm / w8a8 (buffers and resident experts "
                                                  "hold the FP8 values and row scales, no staging area).")] = "compute",
    slots_share_buffers: Annotated[str, typer.Option(help="The engine's --slots-share-buffers: auto (the slot "
                                                          "cache in the prefill buffers' memory where the budget "
                                                          "leaves too few slots beside them, one sequence), on or "
                                                          "off.")] = "auto",
) -> None:
    """What the vendored engine keeps on the GPU at each prefill chunk length, and the decode slot cache a
    budget leaves (the plan `--gpu-memory-budget` applies at start-up; no GPU needed). A longer chunk runs
    fewer, larger GEMMs but needs a larger workspace, so fewer experts stay cached for decode: choose the
    chunk length per budget here, then start the engine with it (`--chunk-tokens`).

    Examples:

    \b
      abbench memory-plan --model qwen3-30b-a3b-2507 --budget 24 --chunk-tokens 2048,8192
      abbench memory-plan --model qwen3.5-35b-a3b --chunk-tokens 2048,8192 --max-context 131072
      abbench memory-plan --model qwen3-30b-a3b --budget 24 --max-context 8192 --max-num-seqs 8
      abbench memory-plan --model qwen3-30b-a3b --budget 16 --max-context 32768 --expert-dtype fp8
      abbench memory-plan --model qwen3.5-35b-a3b --budget 16 --max-context 262144 --window-tokens 65536
    """
    from abbench.engine.config import AUTO_CHUNK_TOKENS, EngineConfig
    from abbench.engine.runtime.memory import GIB, auto_chunk_tokens, least_budget, plan_device_memory

    try:
        chunks = [int(c) for c in (_parse_csv(chunk_tokens, "--chunk-tokens") or [])]
    except ValueError:
        chunks = []
    if not chunks or any(c <= 0 for c in chunks):
        _fail(ConfigError(f"--chunk-tokens {chunk_tokens!r}: give positive token counts, e.g. 2048,8192"))
        return
    try:
        context = max_context or EngineConfig(model=model).model_config().max_position_embeddings
    except (ValueError, AbbenchError) as e:
        _fail(e if isinstance(e, AbbenchError) else ConfigError(str(e)))
        return
    table = Table(title=f"device-memory plan: {model}, {dtype}, max context {context:,}"
                  + (f", {max_num_seqs} sequences" if max_num_seqs > 1 else "")
                  + (f", budget {budget:g} GiB" if budget is not None else "") + (", resident" if resident else "")
                  + (f", {expert_dtype} expert bank" if expert_dtype != "model" else "")
                  + (f", {slot_dtype} slots" if slot_dtype != "auto" else "")
                  + (f", fp8_dequant {fp8_dequant}" if fp8_dequant != "compute" else ""))
    for col in ("chunk tokens", "KV (GiB)", "workspace (GiB)", "fixed (GiB)", "slots/layer", "slot cache (GiB)", "total (GiB)",
                "note"):
        table.add_column(col, justify="left" if col == "note" else "right")
    gb = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    knobs = dict(layer_major_window_tokens=window_tokens) if window_tokens else {}

    def config(chunk: int) -> EngineConfig:
        return EngineConfig(model=model, device="cuda", dtype=dtype, chunk_tokens=chunk, max_context=max_context,
                            prefill_mode="resident" if resident else "chunked", max_num_seqs=max_num_seqs,
                            expert_dtype=expert_dtype, slot_dtype=slot_dtype, fp8_dequant=fp8_dequant,
                            slots_share_buffers=slots_share_buffers, **knobs).resolved()

    auto = None  # the chunk length --chunk-tokens auto takes under this budget (the engine's own rule)
    if budget is not None:
        try:
            auto = auto_chunk_tokens(config(AUTO_CHUNK_TOKENS[-1]), int(budget * GIB))
        except (ValueError, AbbenchError) as e:
            _fail(e if isinstance(e, AbbenchError) else ConfigError(str(e)))
            return
        if auto not in chunks:
            table.caption = f"--chunk-tokens auto takes {auto:,} tokens under this budget"
    for chunk in chunks:
        try:
            cfg = config(chunk)
        except (ValueError, AbbenchError) as e:
            _fail(e if isinstance(e, AbbenchError) else ConfigError(str(e)))
            return
        try:
            if budget is None:  # the least decode can run with: one token's experts in every layer
                k = 0 if resident else cfg.model.num_experts_per_tok
                plan = plan_device_memory(cfg, least_budget(cfg, k)[0])
                note = f"needs at least {plan.total_bytes / GIB:.2f} GiB" + ("" if resident else f" ({plan.slots_per_layer} slots per layer)")
            else:
                plan, note = plan_device_memory(cfg, int(budget * GIB)), ""
            if plan.slots_share_buffers:
                note = (note + "; " if note else "") + (
                    f"slots in the prefill buffers' memory ({gb(plan.prefill_buffer_bytes)} GiB): cold after each "
                    "prefill")
        except ValueError as e:
            table.add_row(f"{chunk:,}", "", "", "", "", "", "", f"[red]does not fit[/]: {str(e).split(';')[0]}")
            continue
        if chunk == auto:
            note = (note + "; " if note else "") + "--chunk-tokens auto takes this"
        table.add_row(f"{chunk:,}", gb(plan.kv_bytes), gb(plan.workspace_bytes), gb(plan.fixed_bytes), str(plan.slots_per_layer),
                      gb(plan.pool_bytes(plan.slots_per_layer)), gb(plan.total_bytes), note)
    out.print(table)


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
    tokenizer), tensor by tensor, for an A/B run of the engine against llama.cpp (docs/llamacpp.md).

    Examples:

    \b
      abbench export-gguf --model tiny --dtype bfloat16 --out tiny-bf16.gguf
    """
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
