"""The reference backend: a model's own transformers implementation behind the vendored engine's API.

``abbench serve --backend transformers --model DIR [--device cpu|cuda] [--dtype ...] --port P`` (or
``python -m abbench.engine --backend transformers ...``; the command line is :mod:`abbench.engine.serve.launch`,
which this module does not import) serves the same OpenAI-compatible API as the vendored engine
(:mod:`abbench.engine.serve.server`: native ``token_ids``, top-k logprobs with ``top_logprob_ids``, SSE, usage,
``/health``, ``/reset``, ``/metrics``, OpenAI-shaped errors) by running ``AutoModelForCausalLM`` from a local
checkpoint directory, any architecture transformers knows. So an arm can ask "does my engine match the
model's reference implementation?" in the same run, prompts and ABBA plan as the engine's other arms.

Contract: :class:`ReferenceEngine` is a :class:`abbench.engine.contract.Backend`, as
:class:`abbench.engine.runtime.engine.Engine` is (``generate(request, cancel)`` / ``reset()``: a generator of
``TokenEvent``, one per output token, whose return value is a ``RequestStats``; ``ValueError``/``ContextOverflow``
before any work; ``Cancelled`` at the next step after the cancel flag is set; one request at a time: its
``scheduler`` is a ``SerialScheduler``, where the vendored engine batches), so the
vendored server's routes, queue, request schema, SSE framing and errors serve it unchanged. It imports the
contract and the ops it shares with the engine (the sampler, the layer trace), never the runtime.

How it computes: the whole prompt in one forward pass with a fresh KV cache (transformers' ``DynamicCache``),
then one token per forward pass with that cache; the logits of the last position in float32, chosen by the
engine's own :class:`abbench.engine.ops.sampling.Sampler` (greedy at temperature 0: ``argmax``, the first of equal
maxima; the logprobs from ``log_softmax`` in float32), so the two backends' margins compare like for like.
No prefix cache (every request starts from an empty cache; ``/reset`` has nothing to flush) and no
offload: the per-request ``abbench`` object reports ``prefill_path = "reference"``, zero host-to-device
expert bytes and zero cached prompt tokens. Every per-request engine override but ``trace_layers`` and
``full_logprobs`` (``GenerateRequest.overrides``: ``prefill_mode``, ``chunk_tokens``, ...) is refused (400).
``trace_layers`` (with ``--allow-request-overrides``) returns the layer trace of :mod:`abbench.engine.ops.trace`
from forward hooks on the decoder layers (``model.model.layers``): ``attention`` (``self_attn``'s output),
``experts`` (``mlp``'s output: every expert, shared ones included) and ``residual`` (the layer's output),
at the last prompt position; hashes of two implementations rarely agree, the RMS of the difference does
the localizing.

:func:`save_tiny_qwen3_moe` writes the random tiny Qwen3-MoE checkpoint ``profiles/cpu-tiny-reference.toml``
serves from both backends (``abbench serve --backend transformers --make-tiny-checkpoint DIR``).

Imports nothing from the harness; transformers is imported only when a model is loaded.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from abbench.engine.config import DTYPES
from abbench.engine.contract import (
    BackendInfo, CancelLike, Cancelled, GenerateRequest, RequestStats, SerialScheduler, TokenEvent, check_cancel,
    check_request, drain,
)
from abbench.engine.ops.sampling import Sampler
from abbench.engine.ops.trace import LayerTrace

__all__ = ["ReferenceEngine", "resolve_checkpoint", "save_tiny_qwen3_moe"]

log = logging.getLogger("abbench.engine.serve.reference")

PATH = "reference"
SUPPORTED_OVERRIDES = ("trace_layers", "full_logprobs")  # of GenerateRequest.overrides(): the rest are the engine's


@dataclass(frozen=True)
class ReferenceModelInfo:
    """What the server reads of ``engine.model_config``."""

    name: str
    vocab_size: int
    max_position_embeddings: int
    eos_ids: frozenset[int] = frozenset()


@dataclass
class ReferenceConfig:
    """What the server reads of ``engine.config``."""

    model: str
    device: str
    dtype: str
    max_context: int


def _eos_ids(*sources: Any) -> frozenset[int]:
    out: set[int] = set()
    for src in sources:
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, (list, tuple)):
            out.update(int(x) for x in v)
    return frozenset(out)


def _device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but torch.cuda.is_available() is false")
    dev = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


@dataclass
class ReferenceEngine:
    """A transformers causal LM with the vendored ``Engine``'s serving contract (module docstring)."""

    model_dir: str
    device_name: str = "cpu"
    dtype_name: str | None = None
    max_context: int | None = None
    attn_implementation: str | None = None
    counters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import transformers

        t0 = time.perf_counter()
        self.device = _device(self.device_name)
        dtype = self.dtype_name or ("float32" if self.device.type == "cpu" else "bfloat16")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError(f"{self.model_dir}: not a local checkpoint directory (no config.json)")
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, **kwargs)
        self.model.to(self.device).eval()
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        max_pos = int(getattr(text, "max_position_embeddings", 0) or 1 << 20)
        self.model_config = ReferenceModelInfo(
            name=Path(self.model_dir).resolve().name, vocab_size=vocab, max_position_embeddings=max_pos,
            eos_ids=_eos_ids(self.model.config, text, getattr(self.model, "generation_config", None)))
        ctx = self.max_context or max_pos
        if ctx > max_pos:
            raise ValueError(f"max_context {ctx} > the model's max_position_embeddings {max_pos}")
        self.config = ReferenceConfig(model=self.model_dir, device=str(self.device), dtype=dtype, max_context=ctx)
        self.dtype = getattr(torch, dtype)
        params = inspect.signature(self.model.forward).parameters
        self._keep = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x: cache
        self.counters.update({"requests_total": 0, "requests_cancelled": 0, "h2d_bytes_total": 0,
                              "d2d_bytes_total": 0, "expert_copies_total": 0, "cached_prompt_tokens_total": 0,
                              "requests_by_path": {PATH: 0}, "prefill_tokens_by_path": {PATH: 0}})
        self.scheduler = SerialScheduler(self)  # one request at a time, in arrival order
        self._lock = threading.Lock()
        self.startup_s = time.perf_counter() - t0
        self.info = BackendInfo(model=self.model_dir, model_name=self.model_config.name, vocab_size=vocab,
                                max_context=ctx, startup_s=self.startup_s, decode_mode="transformers",
                                decode_kernels="transformers")  # no offload: no bandwidth, bank or slots

    # -- the Engine contract ----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest, cancel: CancelLike = None) -> Iterator[TokenEvent]:
        """As :meth:`abbench.engine.runtime.engine.Engine.generate` (the :class:`abbench.engine.contract.Backend`
        contract); validates eagerly. The engine's per-request overrides are refused, ``trace_layers`` aside."""
        prompt = check_request(request, self.model_config.vocab_size, self.config.max_context)
        refused = [name for name in request.overridden() if name not in SUPPORTED_OVERRIDES]
        if refused:
            raise ValueError(f"the transformers reference runs the model's own forward pass: no {refused[0]} "
                             f"(omit {', '.join(refused)})")
        sampler = Sampler(float(request.temperature), request.seed, self.device,
                          None if request.logprobs is None else int(request.logprobs), full=request.full_logprobs)
        return self._generate(prompt, int(request.max_tokens), sampler, request.ignore_eos, cancel,
                              request.trace_layers)

    def run(self, prompt_ids: list[int], max_tokens: int = 16, cancel: CancelLike = None,
            **fields: Any) -> tuple[list[TokenEvent], RequestStats]:
        """Drain one request of ``prompt_ids`` and ``fields`` (GenerateRequest's): (events, stats)."""
        return drain(self.generate(GenerateRequest(list(prompt_ids), max_tokens, **fields), cancel))

    def reset(self) -> None:
        """Nothing to flush: every request starts from an empty KV cache."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("reset() while a request is running")
        self._lock.release()

    def prime_prefill(self) -> bool:
        """Nothing streams: nothing to start ahead of a request."""
        return False

    def drop_prime(self) -> None:
        """Nothing was started ahead."""

    # -- internals --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits of the last position (float32, [V]) after feeding ``ids`` on top of ``cache``."""
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if self._keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=t, **kwargs)
        return out.logits[0, -1].float(), cache  # the cache object is updated in place

    def _hooks(self, tracer: LayerTrace) -> list[Any]:
        """Forward hooks feeding ``tracer`` from every decoder layer (module docstring)."""
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"trace_layers: {type(self.model).__name__} has no model.layers to hook")

        def hook(layer: int, block: str):
            def fn(_module: Any, _args: Any, output: Any) -> None:
                t = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(t, torch.Tensor):
                    tracer(layer, block, t.reshape(-1, t.shape[-1]))
            return fn

        handles = []
        for i, layer in enumerate(layers):
            for name, block in (("self_attn", "attention"), ("mlp", "experts")):
                if hasattr(layer, name):
                    handles.append(getattr(layer, name).register_forward_hook(hook(i, block)))
            handles.append(layer.register_forward_hook(hook(i, "residual")))
        return handles

    def _generate(self, prompt: list[int], max_tokens: int, sampler: Sampler, ignore_eos: bool,
                  cancel: CancelLike, trace_layers: bool = False) -> Iterator[TokenEvent]:
        from transformers import DynamicCache

        if not self._lock.acquire(blocking=False):
            raise RuntimeError("generate() while another request is running (one at a time)")
        counters = self.counters
        try:
            start_bytes = None
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                start_bytes = int(torch.cuda.memory_allocated(self.device))
            check_cancel(cancel)
            prefill_start = time.perf_counter()
            tracer = LayerTrace() if trace_layers else None
            handles = self._hooks(tracer) if tracer is not None else []
            try:
                logits, cache = self._forward(prompt, DynamicCache(config=self.model.config))
            finally:
                for h in handles:
                    h.remove()
            prefill_end = time.perf_counter()
            counters["requests_by_path"][PATH] += 1
            counters["prefill_tokens_by_path"][PATH] += len(prompt)
            event = TokenEvent(*sampler(logits))
            first_token = time.perf_counter()
            eos = frozenset() if ignore_eos else self.model_config.eos_ids
            n_out = 1
            yield event
            while event.token_id not in eos and n_out < max_tokens:
                check_cancel(cancel)
                logits, cache = self._forward([event.token_id], cache)
                event = TokenEvent(*sampler(logits))
                n_out += 1
                yield event
            return RequestStats(
                prefill_path=PATH, fallback_reason=None, h2d_bytes=0, d2d_bytes=0, prefill_h2d_bytes=0,
                decode_h2d_bytes=0, bank_bytes=0, expert_copies=0, cached_prompt_tokens=0,
                prompt_tokens=len(prompt), completion_tokens=n_out, n_chunks=1, n_windows=0,
                prefill_start=prefill_start, prefill_end=prefill_end, first_token=first_token,
                finish_reason="stop" if event.token_id in eos else "length",
                peak_device_bytes=(int(torch.cuda.max_memory_allocated(self.device))
                                   if self.device.type == "cuda" else None),
                start_device_bytes=start_bytes, layer_trace=tracer.export() if tracer is not None else None,
                full_logprobs=sampler.first_full_b64())
        except Cancelled:
            counters["requests_cancelled"] += 1
            raise
        finally:
            counters["requests_total"] += 1
            self._lock.release()


# ------------------------------------------------------------------------------------------ a tiny checkpoint


TINY_QWEN3_MOE = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=2048, rope_theta=10000.0,
                      norm_topk_prob=True, tie_word_embeddings=False)
"""The shape of :func:`save_tiny_qwen3_moe`: the Qwen3 vocabulary (so the built-in ``qwen3`` tokenizer's ids
fit), everything else tiny."""

TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-qwen3-moe": TINY_QWEN3_MOE,
    # The same with heads of 64: vLLM's CPU attention refuses head_dim 16 ("Unsupported CPU attention
    # configuration"); profiles/cpu-tiny-vllm.toml serves this one on vLLM and on the vendored engine.
    "tiny-qwen3-moe-hd64": {**TINY_QWEN3_MOE, "head_dim": 64},
}
"""The named tiny checkpoints (``NAME:SEED`` in a ``--model``/``--weights``, :func:`resolve_checkpoint`)."""


def random_qwen3_moe(cfg: Any, seed: int) -> Any:
    """A transformers ``Qwen3MoeForCausalLM`` of ``cfg`` (a ``Qwen3MoeConfig``) with every tensor redrawn under
    ``torch.manual_seed(seed)`` so that each matters: matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights
    1 + N(0, 0.2^2) (a swapped or ignored norm would show)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def save_tiny_qwen3_moe(out_dir: str | Path, *, seed: int = 0, shape: str = "tiny-qwen3-moe") -> Path:
    """A random transformers ``Qwen3MoeForCausalLM`` of ``shape`` (:data:`TINY_SHAPES`; default
    :data:`TINY_QWEN3_MOE`), saved with ``save_pretrained`` (safetensors) into ``out_dir``. Every tensor is
    redrawn so that each matters: matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.2^2)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(**TINY_SHAPES[shape], eos_token_id=151645)
    model = random_qwen3_moe(cfg, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


TINY_SPEC = "tiny-qwen3-moe:"


def is_tiny_spec(value: object) -> bool:
    """Whether ``value`` names a tiny checkpoint (``NAME:SEED``, NAME one of :data:`TINY_SHAPES`)."""
    return isinstance(value, str) and value.split(":", 1)[0] in TINY_SHAPES and ":" in value


def resolve_checkpoint(spec: str) -> str:
    """``NAME:SEED`` (``tiny-qwen3-moe:0``, ``tiny-qwen3-moe-hd64:0``: :data:`TINY_SHAPES`) -> the directory
    of that tiny checkpoint in abbench's cache (``$ABBENCH_CACHE_DIR`` or ``~/.cache/abbench``), written with
    :func:`save_tiny_qwen3_moe` the first time (into a temporary folder renamed into place, so two services
    starting together cannot see half of it). Any other value is returned as it is."""
    if not is_tiny_spec(spec):
        return spec
    name, seed = spec.split(":", 1)
    if not seed.isdigit():
        raise ValueError(f"{spec!r}: expected {name}:SEED with an integer seed")
    root = Path(os.environ.get("ABBENCH_CACHE_DIR") or Path.home() / ".cache" / "abbench")
    out = root / f"{name}-{seed}"
    if not (out / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{seed}-", dir=root))
        save_tiny_qwen3_moe(tmp, seed=int(seed), shape=name)
        try:
            os.replace(tmp, out)
        except OSError:  # another process put it there first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
