"""The one command line of both serving backends: ``abbench serve [--backend engine|transformers] ...`` and
``python -m abbench.engine ...`` end here.

``--backend engine`` (the default) serves the vendored engine (:class:`abbench.engine.runtime.engine.Engine`),
``--backend transformers`` a model's transformers implementation (:class:`abbench.engine.serve.reference.
ReferenceEngine`, the reference), both through the same HTTP app (:func:`abbench.engine.serve.server.create_app`).
What they share is done once, here, for both:

* one argument parser (:func:`build_arg_parser`): the backend's own options, then the server's;
* one API-key guard (:func:`api_key_or_refuse`): with ``--api-key KEY`` (or :data:`API_KEY_ENV` in the
  environment, which keeps the key out of the process list) every route but ``GET /health`` needs
  ``Authorization: Bearer KEY``; without a key only loopback addresses may be bound, and ``--host`` naming
  any other address is refused (exit 2) unless ``--insecure-no-auth`` says so. Checked before anything is
  loaded;
* one bind: the socket is bound before the backend is built (a busy port fails at once) but listens only
  after, so "port accepts connections" means "ready"; one line ``abbench engine ready: http://HOST:PORT ...``
  is printed (and flushed) when it listens. ``--port 0`` picks a free port; the ready line names it.

Exit codes: SIGINT (Ctrl-C) and SIGTERM shut down gracefully (requests in flight get 5 s). After SIGINT, at
any point (while the model builds too), the process prints one line and exits 130, the shell's code for Ctrl-C,
with no traceback; after SIGTERM uvicorn raises the signal again once it has shut down, so a parent sees the
process ended by SIGTERM (-15 to Python's ``subprocess``). Failures raise ``SystemExit``: 2 for usage errors
(argparse, a bad tokenizer spec, the guard), 1 when the port cannot be bound or the backend cannot be built,
each with a one-line message on stderr.

This module imports both backends (lazily: the transformers backend's only when asked for) and neither of them
imports it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shutil
import socket
import sys
from typing import Any

from abbench.engine.config import (
    AUTO_CHUNK_TOKENS, CHUNK_AUTO, DECODE_ATTENTION, DECODE_EXPERTS, DECODE_MISSES, DTYPES, EXPERT_DTYPES,
    FP8_DEQUANT, PREFILL_KERNELS, PREFILL_MODES, PRESETS, SLOT_DTYPES, SLOTS_SHARE_BUFFERS, EngineConfig,
)

__all__ = ["API_KEY_ENV", "BACKENDS", "api_key_or_refuse", "build_arg_parser", "is_loopback", "main"]

log = logging.getLogger("abbench.engine.serve.launch")

BACKENDS = ("engine", "transformers")
API_KEY_ENV = "ABBENCH_ENGINE_API_KEY"
TINY_SPEC = "tiny-qwen3-moe:"  # abbench.engine.serve.reference.TINY_SPEC (not imported: it loads torch)
TINY_SPECS = (TINY_SPEC, "tiny-qwen3-moe-hd64:")  # the names of abbench.engine.serve.reference.TINY_SHAPES
_PROG = {"engine": "abbench serve", "transformers": "abbench serve --backend transformers"}
_DESCRIPTION = {
    "engine": "Serve the vendored offloaded-MoE engine over an OpenAI-compatible API (`python -m abbench.engine` "
              "takes the same arguments: the profiles' engine commands use it).",
    "transformers": "Serve a model's transformers implementation (greedy reference) over the vendored engine's "
                    "OpenAI-compatible API.",
}
EXAMPLES = """\
Examples:
  abbench serve --port 8000                    # the tiny preset on CPU, random weights, chunked prefill
  abbench serve --prefill-mode layer-major --chunk-tokens 128 --port 8001
  abbench serve --backend transformers --model DIR --port 8002   # the reference: the model's transformers code
  abbench memory-plan --model qwen3.5-35b-a3b --budget 16 --max-context 65536   # a 16 GB card's plan, no GPU
  abbench serve --model qwen3.5-35b-a3b --device cuda --gpu-memory-budget 16 --max-context 65536 \\
      --chunk-tokens auto --prefill-mode layer-major --port 8000   # on the GPU: random weights, real shapes
Add --check-plan to a GPU command to see its plan and exit. `abbench run` launches these from a profile's
[engine] command; README.md shows how to A/B two of them."""
"""What ``--help`` ends with."""

_OVERRIDES = {"engine": "prefill_mode, chunk_tokens, attention_batch, decode_misses, trace_layers and full_logprobs "
                        "fields",
              "transformers": "trace_layers and full_logprobs fields"}


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (``localhost``, 127.0.0.0/8, ::1).
    A wildcard (``0.0.0.0``, ``::``, empty) is not."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


# ----------------------------------------------------------------------------------------------- the parser


def _chunk_tokens(value: str) -> int | str:
    """``--chunk-tokens``: a positive number of tokens, or "auto"."""
    if value == CHUNK_AUTO:
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or {CHUNK_AUTO!r}, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


def _engine_options(e: argparse._ArgumentGroup) -> None:
    e.add_argument("--model", default=None, help=f"preset ({', '.join(PRESETS)}) or a local HF model directory "
                   "with config.json (default: tiny, or the checkpoint's config when --weights is a directory)")
    e.add_argument("--weights", default="random:0", help="'random:SEED', an HF checkpoint directory, or "
                   f"'{TINY_SPEC}SEED' (a random tiny Qwen3-MoE checkpoint written once into abbench's cache; "
                   "tiny-qwen3-moe-hd64:SEED: the same with heads of 64)")
    e.add_argument("--tokenizer", default=None, help="qwen3, qwen3.6 or a local HF tokenizer directory "
                   "(default: qwen3.6 for the qwen3.5-* presets, qwen3 for the other presets, the model "
                   "directory otherwise)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    e.add_argument("--dtype", default=None, choices=DTYPES, help="default: float32 on cpu, bfloat16 on cuda")
    e.add_argument("--expert-dtype", default=None, choices=EXPERT_DTYPES,
                   help="how the host bank stores the routed experts: model (the compute dtype, the default) or "
                   "fp8 (float8 e4m3 with one float32 scale per output row, quantized at load: copies move about "
                   "half the bytes and are dequantized on the device, which computes in --dtype)")
    e.add_argument("--slot-dtype", default=None, choices=SLOT_DTYPES,
                   help="what decode's expert slots hold: model (--dtype) or fp8 (an fp8 bank's float8 values and "
                   "row scales, dequantized by decode's Triton experts as they read them: about twice the slots in "
                   "a budget); default auto: fp8 on CUDA for an fp8 bank with per-row scales decoded by Triton's "
                   "experts, else model")
    e.add_argument("--fp8-dequant", default=None, choices=FP8_DEQUANT,
                   help="an fp8 bank's streamed prefill layers: dequantized on the compute stream at their turn "
                   "(compute, the default), on the copy stream right after their copy, beside the compute (copy), "
                   "or never as a pass: the prefill's grouped GEMM reads the FP8 values and row scales (gemm; on "
                   "CUDA a Triton kernel, in every prefill mode, resident included, so other bits than compute's; "
                   "per-row scales only); w8a8: as gemm, with the activations quantized per row to FP8 too and "
                   "the GEMM in FP8 math (other numbers: judge such an arm by numerics)")
    e.add_argument("--prefill-mode", default="chunked", choices=PREFILL_MODES,
                   help="the prefill path of requests that name none: chunked (each chunk runs through every "
                   "layer, so the expert bank streams once per chunk), layer-major (every chunk runs through a "
                   "layer before the next: the bank streams once per window), demand (chunks of at most "
                   "--demand-max-tokens copy only the experts they are routed to), resident (every expert on the "
                   "device, nothing streamed: the floor the others are judged against), auto (the engine's cost "
                   "model picks one per request and says why). Default chunked")
    e.add_argument("--check-plan", action="store_true",
                   help="check this command's configuration and device-memory plan as the engine would at start "
                   "(the device's free memory without --gpu-memory-budget), print the plan and exit: 0 when it "
                   "fits, 1 with the reason when not. Loads no weights and binds no port: seconds at any scale "
                   "(abbench run does this for every arm on a GPU or with a budget before its first request)")
    e.add_argument("--chunk-tokens", type=_chunk_tokens, default=2048, metavar="N|auto",
                   help="prefill chunk length in tokens, the same in every prefill mode (default 2048). auto: the "
                   f"largest of {', '.join(map(str, AUTO_CHUNK_TOKENS))} whose device-memory plan fits (on a GPU "
                   "or with --gpu-memory-budget; else 2048): larger chunks launch fewer kernels but take "
                   "workspace from decode's slots. The chosen length is logged at start")
    e.add_argument("--layer-major-window-tokens", type=int, default=None, metavar="TOKENS",
                   help="the most prompt tokens one layer-major window parks between layers (their activations "
                   "are held on the device): a longer prompt runs in windows, each streaming the bank once. "
                   "Default 65536")
    e.add_argument("--demand-max-tokens", type=int, default=None, metavar="TOKENS",
                   help="demand prefill copies only the routed experts of each chunk of at most this many "
                   "tokens (a short turn touches few experts); a prompt whose every chunk is longer runs chunked. "
                   "Default 256")
    e.add_argument("--gpu-memory-budget", dest="gpu_memory_budget_gib", type=float, default=None, metavar="GIB",
                   help="device memory the engine may use, in GiB (2^30 bytes, as cards are sized: a 16 GB card "
                   "holds 16 GiB), CUDA context and the runtime's reserve included, so the process fits a card "
                   "of this size: the decode "
                   "slot cache gets what the dense weights, KV cache, prefill buffers and workspace leave; a "
                   "budget that cannot hold one token's experts per layer is refused (default: the device's "
                   "free memory at start; on CPU every expert)")
    e.add_argument("--expert-slots-per-layer", type=int, default=None, metavar="N",
                   help="decode slot cache size per layer (default: what --gpu-memory-budget leaves, at most "
                   "num_experts)")
    e.add_argument("--no-host-memory-check", dest="host_memory_check", action="store_false", default=None,
                   help="build the host expert bank even if /proc/meminfo says it will not fit")
    e.add_argument("--no-decode-graphs", dest="decode_graphs", action="store_false", default=None,
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    e.add_argument("--no-warm-decode-graphs", dest="warm_decode_graphs", action="store_false", default=None,
                   help="CUDA: capture a decode KV length's graphs when a request first reaches it, instead of "
                   "every length's at start (then that request's first steps run eagerly and capture, slower)")
    e.add_argument("--no-warm-prefill", dest="warm_prefill", action="store_false", default=None,
                   help="CUDA: no throwaway prefill at start (then the first request compiles kernels and captures "
                   "the prefill graphs: on the H200 a first 4K prompt took 5-6.5 s against 0.53 s)")
    e.add_argument("--no-prefill-graphs", dest="prefill_graphs", action="store_false", default=None,
                   help="CUDA, hybrid models: run every prefill layer step eagerly instead of replaying CUDA graphs "
                   "of full chunks' fixed-shape steps")
    e.add_argument("--no-prime-first-layer", dest="prime_first_layer", action="store_false", default=None,
                   help="layer-major and chunked: do not start copying the first layer's experts as a request "
                   "arrives at an idle engine (by default the copy overlaps the request's parsing and tokenization)")
    e.add_argument("--decode-experts", choices=DECODE_EXPERTS, default=None,
                   help="decode's routed experts: grouped (torch._grouped_mm over every expert, as prefill) or "
                   "triton (the router's softmax/top-k in one kernel and a GEMV over the k routed experts only; "
                   "Qwen3-MoE and Qwen3.5/3.6, needs Triton); default auto: triton on CUDA where it applies, "
                   "else grouped")
    e.add_argument("--decode-attention", choices=DECODE_ATTENTION, default=None,
                   help="decode's attention: torch (batched matmuls over the power-of-two bucket) or triton "
                   "(split-KV flash decoding that reads only the filled positions, and for Qwen3-MoE the norms, "
                   "rope and cache write fused; Qwen3-MoE and Qwen3.5/3.6, needs Triton); default auto: triton "
                   "on CUDA where it applies, else torch")
    e.add_argument("--prefill-kernels", choices=PREFILL_KERNELS, default=None,
                   help="prefill's attention half (Qwen3-MoE and the hybrid): torch (each norm, the rope, the cache write and the "
                   "router's top-k as torch ops, 55 a chunk and layer in bf16) or triton (decode's fused kernels: 10 "
                   "ops in all; needs Triton); the Qwen3.5/3.6 hybrid takes the norms and the router. Every prefill "
                   "mode runs the same kernels either way (default torch: triton is not yet measured on a GPU)")
    e.add_argument("--decode-misses", choices=DECODE_MISSES, default=None,
                   help="offloaded decode, who looks up the slot cache and copies its misses: host (per layer the "
                   "router's choice is read back and the host copies the misses: one round trip a layer) or device "
                   "(kernels of the step look up the slots and read the misses from the pinned host bank over "
                   "PCIe: one graph a step; needs --decode-experts triton); default auto: device with Triton's "
                   "experts, else host")
    e.add_argument("--decode-prefetch", action="store_true", default=None,
                   help="offloaded decode with the misses on the device (Qwen3-MoE): guess each next layer's "
                   "experts from the residual stream (its router applied one layer early) and copy the ones its "
                   "slots lack on a side stream while the current layer computes; the output bits do not change, "
                   "the copies count the wrong guesses too (default off: not yet measured on a GPU)")
    e.add_argument("--router-skew", type=float, default=None, metavar="ALPHA",
                   help="random weights: concentrate the routing as trained routers do, a per-layer Zipf-like "
                   "preference of exponent ALPHA over the experts (default 0: the random router's near-uniform "
                   "routing, under which a short chunk touches most experts)")
    e.add_argument("--auto-demand-max-tokens", type=int, default=None, metavar="N",
                   help="--prefill-mode auto: demand loading for prompts of at most N uncached tokens (a threshold "
                   "from a sweep), the best streamed path otherwise, instead of the cost model")
    e.add_argument("--auto-calibration", type=int, default=None, metavar="N",
                   help="--prefill-mode auto: scale demand's expected expert copies by the median copied/expected "
                   "ratio of the last N demand prefills, any request's (default 16; 0: the cost model alone)")
    e.add_argument("--attention-batch", type=int, default=None, metavar="K",
                   help="layer-major prefill: K adjacent chunks share one attention call in full-attention layers "
                   "where that is bit-identical on the device and the group ends within "
                   "--attention-batch-max-context (default 1: one call per chunk; hybrid Qwen3.5/3.6 models)")
    e.add_argument("--attention-batch-max-context", type=int, default=None, metavar="TOKENS",
                   help="the longest context a batched attention group may end at (default 16384: on the H200 the "
                   "joint call was faster below ~6K tokens, even at 16K-64K and slower at 128K)")
    e.add_argument("--d2d-from-slot-cache", action="store_true", default=None,
                   help="prefill takes an expert that decode's slot cache already holds device-to-device instead "
                   "of over PCIe (off by default; not with --slots-share-buffers on)")
    e.add_argument("--slots-share-buffers", choices=SLOTS_SHARE_BUFFERS, default=None,
                   help="decode's slot cache in the memory of the prefill's two layer buffers: the budget holds the "
                   "larger of the two instead of both, and each prefill overwrites the slots (decode starts cold "
                   "after it); one sequence at a time, streamed prefill. Default auto: on where the budget leaves "
                   "fewer slots than a token's experts beside the buffers (a long context on a small card), else off")
    e.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="the KV cache's length per sequence, prompt and output together (default: the model's "
                   "own limit, max_position_embeddings); a prompt that does not fit is refused (HTTP 400, "
                   "context_length_exceeded)")
    e.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="sequences the engine runs at once (continuous batching: requests join and leave between "
                   "decode steps; queued layer-major prompts are prefilled together, one bank stream for the "
                   "batch); each holds a KV cache of --max-context positions, counted in the device-memory plan "
                   "(default 4, or 1 under --gpu-memory-budget; 1: one request at a time)")
    e.add_argument("--max-prefill-batch-tokens", type=int, default=None, metavar="TOKENS",
                   help="uncached prompt tokens one prefill batch may hold (a longer first prompt runs alone): the "
                   "most a prefill delays the decoding sequences, one batch per token (default 131072)")
    e.add_argument("--deterministic", action="store_true", default=None,
                   help="ask the engine for deterministic kernels")


def _reference_options(r: argparse._ArgumentGroup) -> None:
    r.add_argument("--model", help="local Hugging Face checkpoint directory (config.json + weights), or "
                   f"{TINY_SPEC}SEED: the random tiny Qwen3-MoE checkpoint, made once in abbench's cache "
                   "(tiny-qwen3-moe-hd64:SEED: the same with heads of 64)")
    r.add_argument("--tokenizer", default=None, help="qwen3, qwen3.6 or a local HF tokenizer directory "
                   "(default: the model directory)")
    r.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    r.add_argument("--dtype", default=None, choices=DTYPES, help="default: float32 on cpu, bfloat16 on cuda")
    r.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="the longest prompt and output together a request may have (default: the model's own "
                   "limit); a prompt that does not fit is refused (HTTP 400, context_length_exceeded)")
    r.add_argument("--attn-implementation", default=None, help="transformers attn_implementation (eager, sdpa, ...)")
    r.add_argument("--make-tiny-checkpoint", metavar="DIR", default=None,
                   help="write the random tiny Qwen3-MoE checkpoint (profiles/cpu-tiny-reference.toml) to DIR "
                   "and exit")


def build_arg_parser(backend: str = "engine") -> argparse.ArgumentParser:
    """The command line of ``backend``: ``--backend``, the backend's own options, then the server's (the same
    for both)."""
    import textwrap

    width = max(40, min(shutil.get_terminal_size().columns, 120) - 2)  # raw text below: wrapped here
    p = argparse.ArgumentParser(prog=_PROG[backend], description=textwrap.fill(_DESCRIPTION[backend], width),
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="engine",
                   help="engine: the vendored engine (default); transformers: the model's transformers "
                   "implementation behind the same API (the reference)")
    if backend == "engine":
        _engine_options(p.add_argument_group("engine"))
    else:
        _reference_options(p.add_argument_group("transformers reference"))
    s = p.add_argument_group("server")
    s.add_argument("--allow-request-overrides", action="store_true",
                   help=f"accept the per-request {_OVERRIDES[backend]}")
    s.add_argument("--queue-limit", type=int, default=64, help="max waiting requests; more get 429 (default 64)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only; any other address "
                   "needs --api-key or --insecure-no-auth)")
    s.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on every route but "
                   f"/health (default: ${API_KEY_ENV}, which keeps the key out of the process list)")
    s.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key (anyone who can reach it can use it)")
    s.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default 8000)")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's and uvicorn's logging (default info)")
    return p


def _backend_of(argv: list[str]) -> str:
    """The ``--backend`` named anywhere in ``argv`` (default engine); exit 2 for another name."""
    pre = argparse.ArgumentParser(prog="abbench serve", add_help=False)
    pre.add_argument("--backend", default="engine")
    known, _ = pre.parse_known_args(argv)
    if known.backend not in BACKENDS:
        pre.error(f"--backend {known.backend!r}: expected engine (the vendored engine, the default) or "
                  "transformers (the reference)")
    return str(known.backend)


# ------------------------------------------------------------------------------------------ shared steps


def api_key_or_refuse(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The API key (``--api-key``, else :data:`API_KEY_ENV`; None when neither is set). Exit 2 when
    ``--api-key`` is empty, or when no key is set and ``--host`` is not a loopback address without
    ``--insecure-no-auth``: anyone who can reach the port could use the backend."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    api_key = api_key.strip() if api_key else None
    if args.api_key is not None and not api_key:
        parser.error("--api-key is empty")
    if not api_key and not args.insecure_no_auth and not is_loopback(args.host):
        parser.error(f"--host {args.host} is not a loopback address and no API key is set: anyone who can reach "
                     f"it could use the engine (/v1/completions, /reset). Set {API_KEY_ENV} (or --api-key), or "
                     "pass --insecure-no-auth to serve it open anyway")
    return api_key


def _bind(host: str, port: int) -> socket.socket:
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


def _serve(app: Any, sock: socket.socket, log_level: str, ready_message: str) -> None:
    """Listen on ``sock`` until SIGINT/SIGTERM; ``ready_message`` is printed once it listens."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(ready_message, flush=True)

    http, loop = http_stack()
    log.info("http: %s, event loop: %s", http, loop)
    _Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on", http=http,
                           loop=loop)).run(sockets=[sock])


def http_stack() -> tuple[str, str]:
    """uvicorn's HTTP/1.1 parser and event loop for the server: httptools and uvloop (the engine extra's, about
    0.1 ms less of every request's time in the server before the application sees it) where importable, else
    the pure-Python h11 and asyncio's own loop."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return http, loop


# ------------------------------------------------------------------------------------------ the backends


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs: dict[str, Any] = dict(model=args.model, weights=args.weights, device=args.device,
                                  prefill_mode=args.prefill_mode, chunk_tokens=args.chunk_tokens)
    if getattr(args, "allow_request_overrides", False):  # a request may choose who handles the misses: warm both
        kwargs["warm_every_misses_way"] = True
    for field in ("dtype", "expert_dtype", "slot_dtype", "fp8_dequant", "layer_major_window_tokens", "demand_max_tokens", "gpu_memory_budget_gib",
                  "expert_slots_per_layer", "host_memory_check", "decode_graphs", "warm_decode_graphs",
                  "warm_prefill", "prefill_graphs", "prime_first_layer", "attention_batch", "attention_batch_max_context", "router_skew",
                  "auto_demand_max_tokens", "auto_calibration", "decode_experts", "decode_attention", "prefill_kernels",
                  "decode_misses", "decode_prefetch", "d2d_from_slot_cache", "slots_share_buffers",
                  "max_context", "max_num_seqs", "max_prefill_batch_tokens", "deterministic"):
        if getattr(args, field) is not None:  # leave the engine's defaults alone
            kwargs[field] = getattr(args, field)
    return EngineConfig(**kwargs)


def _engine_tokenizer_spec(args: argparse.Namespace) -> str:
    """Resolve ``tiny-qwen3-moe:SEED`` in --model/--weights and the default model; the tokenizer to load."""
    for name in ("model", "weights"):  # tiny-qwen3-moe:SEED -> the cached tiny checkpoint (made on first use)
        value = getattr(args, name)
        if isinstance(value, str) and value.startswith(TINY_SPECS):
            from abbench.engine.serve.reference import resolve_checkpoint

            setattr(args, name, resolve_checkpoint(value))
    if args.model is None:  # tiny, unless --weights names a checkpoint: then its own config.json
        args.model = args.weights if os.path.isdir(args.weights) else "tiny"
    model_dir = args.model if os.path.isdir(args.model) else os.path.dirname(args.model) or None
    if args.model in PRESETS or not os.path.exists(args.model):
        model_dir = None
    preset = PRESETS.get(args.model)
    default_tokenizer = "qwen3.6" if preset is not None and preset.is_hybrid else "qwen3"
    return args.tokenizer or model_dir or default_tokenizer


def _build_engine(args: argparse.Namespace) -> tuple[Any, str]:
    """The vendored engine and the ready line's description of it."""
    from abbench.engine.runtime.engine import Engine
    from abbench.engine.serve.faults import InjectFaults, armed

    fault = armed()  # tests only: ABBENCH_ENGINE_FAULT (ValueError for an unknown one, before the slow build)
    engine = Engine(_engine_config(args))
    log.info("engine built in %.2fs (bank %d bytes, %s, measured H2D %.2f GB/s): %s", engine.startup_s,
             engine.bank_bytes, engine.expert_format, engine.measured_h2d_gbps,
             ", ".join(f"{k} {v:.2f}s" for k, v in engine.startup_phases.items()))
    if engine.memory_plan is not None:
        log.info("device memory plan: %s", engine.memory_plan.describe())
    log.info("decode: %s, kernels %s, misses %s", engine.decoder.mode, engine.decoder.kernels,
             engine.decoder.misses or "none (resident)")
    log.info("prefill: %d-token chunks%s, attention half's kernels %s", engine.config.chunk_tokens,
             " (--chunk-tokens auto)" if args.chunk_tokens == CHUNK_AUTO else "", engine.model.prefill_kernel)
    if engine.decode_warmup is not None:
        log.info("decode graphs captured for KV lengths %s in %.2fs",
                 ", ".join(map(str, engine.decode_warmup["kv_buckets"])), engine.decode_warmup["seconds"])
    if engine.prefill_warmup is not None:
        w = engine.prefill_warmup
        log.info("prefill warmed with one %d-token %s prompt in %.2fs", w["tokens"], w["mode"], w["seconds"])
    described = f"model {args.model}, prefill {args.prefill_mode}, device {args.device}"
    return (engine if fault is None else InjectFaults(engine, fault)), described


def _check_plan(args: argparse.Namespace) -> int:
    """``--check-plan``: what the engine checks before it loads anything (:func:`abbench.engine.runtime.engine.
    check_plan`), printed; 0 when it fits, 1 (the service's own message on stderr) when not."""
    from abbench.engine.runtime.engine import check_plan

    try:
        cfg, plan = check_plan(_engine_config(args))
    except _BUILD_ERRORS["engine"] as exc:
        print(f"{_LABEL['engine'][0]}: {_LABEL['engine'][1]}: {exc}", file=sys.stderr, flush=True)
        return 1
    what = plan.describe() if plan is not None else "none: on the CPU without a budget every expert is in memory"
    print(f"{_LABEL['engine'][0]}: {cfg.chunk_tokens}-token prefill chunks; device-memory plan: {what}", flush=True)
    return 0


def _build_reference(args: argparse.Namespace) -> tuple[Any, str]:
    """The transformers reference and the ready line's description of it."""
    from abbench.engine.serve.reference import ReferenceEngine

    engine = ReferenceEngine(args.model, device_name=args.device, dtype_name=args.dtype,
                             max_context=args.max_context, attn_implementation=args.attn_implementation)
    log.info("%s loaded in %.2fs (%s, %s)", type(engine.model).__name__, engine.startup_s, engine.config.device,
             engine.config.dtype)
    return engine, (f"transformers reference {type(engine.model).__name__}, model {args.model}, "
                    f"device {args.device}")


_LABEL = {"engine": ("abbench engine", "cannot build the engine"),
          "transformers": ("abbench reference", "cannot load the model")}
_BUILD_ERRORS = {"engine": (ValueError, TypeError, RuntimeError, OSError),
                 "transformers": (ValueError, TypeError, RuntimeError, OSError, ImportError)}


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``--backend`` picks the backend), check the key, bind, build the backend, serve until
    SIGINT/SIGTERM (module docstring: exit codes)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn raises it again after its graceful shutdown, or it came mid-build
        print("abbench engine: stopped (SIGINT)", file=sys.stderr, flush=True)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    backend = _backend_of(argv)
    parser = build_arg_parser(backend)
    args = parser.parse_args(argv)
    if args.queue_limit < 0:
        parser.error("--queue-limit must be >= 0")
    if backend == "transformers":
        if args.make_tiny_checkpoint:
            from abbench.engine.serve.reference import save_tiny_qwen3_moe

            print(save_tiny_qwen3_moe(args.make_tiny_checkpoint))
            return 0
        if not args.model:
            parser.error("--model DIR is required")
    if backend == "engine" and args.check_plan:  # nothing is bound or served: no key to guard
        _engine_tokenizer_spec(args)
        return _check_plan(args)
    api_key = api_key_or_refuse(args, parser)  # before anything is loaded or written

    from abbench.engine.serve.server import create_app
    from abbench.engine.serve.tokenizer import TokenizerSpecError, load_tokenizer

    if backend == "engine":
        tokenizer_spec = _engine_tokenizer_spec(args)
    else:
        from abbench.engine.serve.reference import resolve_checkpoint

        args.model = resolve_checkpoint(args.model)
        tokenizer_spec = args.tokenizer or args.model
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer = load_tokenizer(tokenizer_spec)
    except TokenizerSpecError as exc:
        parser.error(str(exc))
    label, cannot = _LABEL[backend]
    try:  # bound (not listening) before the slow build: a busy port fails at once
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"{label}: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    try:
        engine, described = (_build_engine if backend == "engine" else _build_reference)(args)
    except _BUILD_ERRORS[backend] as exc:
        print(f"{label}: {cannot}: {exc}", file=sys.stderr, flush=True)
        sock.close()
        raise SystemExit(1) from None
    app = create_app(engine, tokenizer, served_model_name=args.served_model_name or args.model,
                     allow_request_overrides=args.allow_request_overrides, queue_limit=args.queue_limit,
                     api_key=api_key)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    auth = "API key required" if api_key else "no API key"
    _serve(app, sock, args.log_level, f"abbench engine ready: http://{shown}:{port} ({described}, {auth})")
    return 0
