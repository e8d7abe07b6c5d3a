"""``Engine``: what the HTTP server drives. Up to ``max_num_seqs`` sequences at once (``scheduler``:
:mod:`abbench.engine.runtime.scheduler`), each with its own cache and prefix cache.

Contract (the server relies on it):
- ``Engine(config)`` plans device memory (``memory_plan``: the decode slot cache sized from
  ``gpu_memory_budget_gib``, or the device's free memory; ``slots_per_layer``), builds the model, the host
  expert bank (refused when it and its headroom, the dense weights plus a twentieth of the bank, do not fit the
  host's available memory) and the device buffers, loads or draws the weights and measures host->device
  bandwidth (``measured_h2d_gbps``); ``startup_s`` says how long it took. ``decoder`` runs decode steps (CUDA
  graphs on CUDA). ``info`` is what the server reports about it (the contract's ``BackendInfo``).
- ``generate(request, cancel)`` (:class:`abbench.engine.contract.GenerateRequest`; the contract's
  ``Backend``) validates eagerly (``ValueError``; ``ContextOverflow`` when prompt + max_tokens > max_context),
  resolves what the request leaves to the engine (prefill mode, chunk length, attention batch, who handles
  decode's misses) into the request it runs, and returns a generator of ``TokenEvent``, one per output token;
  the generator's return value (``StopIteration.value``) is the ``RequestStats``. ``Cancelled`` is raised from
  the generator when ``cancel`` is set (checked at every layer step of prefill and decode). ``generate`` runs
  one request alone through the scheduler; a second ``generate`` while one runs raises ``RuntimeError`` (the
  server submits to ``scheduler`` instead, many at once). On CUDA
  out-of-memory, request-local tensors are released (the traceback's frames are cleared) and
  ``torch.OutOfMemoryError`` propagates unchanged; the engine stays usable. ``run(prompt_ids, max_tokens,
  **fields)`` drains one request (tests, checks).
- The EOS token, when generated and ``ignore_eos`` is false, is yielded and counted (finish_reason "stop").
- Prefix cache, per sequence cache (the scheduler picks the free cache that shares the most; requests one at a
  time always use the first): the KV of the previous request's prompt and generated tokens stays valid; a new
  prompt sharing a prefix with those tokens reuses it (at most len(prompt) - 1 tokens, so at least one token is
  prefilled) and prefills the rest in chunks starting at the reuse point. Hybrid models (linear-attention
  states, valid only where snapshotted) reuse exactly the previous prompt when the new prompt extends it
  (the states are snapshotted at the end of every prefill), else nothing. ``reset()`` flushes the prefix
  cache (and the hybrid states) and the decode slot cache.
- Byte accounting per request (``RequestStats``: H2D/D2D bytes, decode slot-cache hits and misses, decode
  steps, torch's peak device memory during the request) and for the engine's lifetime (``counters``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping

import torch

from abbench.engine.config import (
    AUTO_CHUNK_TOKENS, CHUNK_AUTO, FP8_GEMM_MATH, MAX_ATTENTION_BATCH, PREFILL_MODES, PREFILL_PATHS, EngineConfig,
    ModelConfig, check_hybrid_chunk,
)
from abbench.engine.runtime.memory import (
    GIB, MemoryPlan, auto_chunk_tokens, dense_params, fp8_slots, plan_device_memory,
)
from abbench.engine.contract import (
    BackendInfo, CancelLike, Finished, GenerateRequest, RequestStats, TokenEvent, check_request, drain,
)
from abbench.engine.ops import kernels as decode_kernels
from abbench.engine.ops.sampling import Sampler
from abbench.engine.runtime.decode import Decoder
from abbench.engine.models.bank import ExpertBank
from abbench.engine.models.weights import fp8_block_size
from abbench.engine.runtime.experts import ExpertStore
from abbench.engine.models.factory import build_model
from abbench.engine.runtime.graphs import GraphCache
from abbench.engine.models.hybrid import attention_batching_exact
from abbench.engine.ops.dense import attention_backends
from abbench.engine.ops.moe import probe_graph_capture
from abbench.engine.runtime.policy import Calibration, CostModel, choose, expected_demand_copies
from abbench.engine.runtime.prefill import Batching, PrefillStats, plan_chunks, prefill
from abbench.engine.runtime.scheduler import Scheduler
from abbench.engine.runtime.steps import LayerSteps

__all__ = ["Engine"]


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where the environment configures torch's CUDA allocator (:func:`allocator_settings`)."""


def allocator_settings(device: torch.device, environ: Mapping[str, str]) -> str | None:
    """What the engine sets in torch's CUDA caching allocator on ``device``: expandable segments (the memory a
    freed block leaves can go back to the driver instead of staying reserved) on CUDA, unless ``environ``
    configures the allocator itself (``ALLOC_CONF_VARS``: then as set); None off CUDA. With the slot cache and
    the prefill buffers in one allocation, a 16 GiB hybrid engine kept 2.05 GiB reserved beyond its tensors that
    ``empty_cache()`` could not return (the process at 16.00 GiB by NVML); with expandable segments 0.60 GiB and
    14.53 (docs/engine.md, "Torch's allocator")."""
    if device.type != "cuda" or any(v in environ for v in ALLOC_CONF_VARS):
        return None
    return "expandable_segments:True"


def _resolve_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but torch.cuda.is_available() is false "
                           f"(torch {torch.__version__})")
    dev = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _expert_layout(cfg: EngineConfig, device: torch.device) -> tuple[tuple[int, int] | None, str | None, bool]:
    """How a resolved ``cfg`` holds its experts on ``device``: an FP8 checkpoint's block size (None: per-row
    scales, or not FP8), the math of a prefill GEMM that reads FP8 (None: it reads the model dtype), and whether
    decode's slots hold FP8 values; ValueError for a combination that cannot run."""
    fp8 = cfg.expert_dtype == "fp8"  # an FP8 checkpoint's experts then keep their block scales
    block = fp8_block_size(cfg.weights) if fp8 and not cfg.weights.startswith("random:") else None
    gemm_math = FP8_GEMM_MATH.get(cfg.fp8_dequant) if fp8 else None  # the prefill GEMM reads FP8
    if gemm_math and block is not None:
        raise ValueError(f"fp8_dequant {cfg.fp8_dequant!r} reads per-row scales in the grouped GEMM; "
                         f"{cfg.weights} has {block[0]}x{block[1]} block scales (use fp8_dequant 'compute')")
    if gemm_math and device.type == "cuda" and not decode_kernels.have_triton():
        raise ValueError(f"fp8_dequant {cfg.fp8_dequant!r} runs Triton's grouped GEMM over FP8 on CUDA: "
                         "install Triton")
    # decode's slots hold the FP8 bank's own values and row scales where Triton's experts read them
    return block, gemm_math, fp8_slots(cfg, block, triton=decode_kernels.have_triton())


def _budget_bytes(cfg: EngineConfig, device: torch.device) -> int | None:
    """The device-memory budget the plan of a resolved ``cfg`` sizes from: ``gpu_memory_budget_gib``, else on CUDA
    the device's free memory now; None on CPU without a budget (no plan: the slot cache holds every expert unless
    expert_slots_per_layer says otherwise)."""
    budget = cfg.gpu_memory_budget_gib
    if budget is not None:
        return int(budget * GIB)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _plan_memory(cfg: EngineConfig, device: torch.device, slots_fp8: bool) -> MemoryPlan | None:
    """The device-memory plan of a resolved ``cfg`` (slots per layer from the budget; ValueError when it cannot
    fit); None where there is no budget to plan (:func:`_budget_bytes`)."""
    budget_bytes = _budget_bytes(cfg, device)
    return None if budget_bytes is None else plan_device_memory(cfg, budget_bytes, slots_fp8=slots_fp8)


def _chunk_chosen(cfg: EngineConfig, device: torch.device, slots_fp8: bool) -> EngineConfig:
    """``cfg`` with ``chunk_tokens`` "auto" made a number (:func:`abbench.engine.runtime.memory.auto_chunk_tokens`
    under the plan's budget; the last of AUTO_CHUNK_TOKENS where there is no plan); any other ``cfg`` as it is."""
    if cfg.chunk_tokens != CHUNK_AUTO:
        return cfg
    budget_bytes = _budget_bytes(cfg, device)
    chunk = AUTO_CHUNK_TOKENS[-1] if budget_bytes is None else auto_chunk_tokens(cfg, budget_bytes, slots_fp8)
    return dataclasses.replace(cfg, chunk_tokens=chunk)


def check_plan(config: EngineConfig) -> tuple[EngineConfig, MemoryPlan | None]:
    """What ``Engine(config)`` checks before it loads anything: the configuration against the model, the device,
    the expert layout and the device-memory plan; returns the configuration as the engine would run it (every
    default filled in, an "auto" chunk length chosen) and its plan (None: CPU without a budget), or raises
    ValueError/RuntimeError with the reason the engine would give. Loads no weights: seconds, at any scale."""
    cfg = config.resolved()
    device = _resolve_device(cfg.device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _block, _gemm_math, slots_fp8 = _expert_layout(cfg, device)
        cfg = _chunk_chosen(cfg, device, slots_fp8)
        return cfg, _plan_memory(cfg, device, slots_fp8)


class Engine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = cfg = config.resolved()
        self.model_config: ModelConfig = cfg.model  # type: ignore[assignment]
        self.device = _resolve_device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        if cfg.deterministic:
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        settings = allocator_settings(self.device, os.environ)
        if settings is not None:  # before the first allocation
            torch.cuda.memory._set_allocator_settings(settings)
        mc = self.model_config
        self._lock = threading.Lock()
        self.startup_phases: dict[str, float] = {}  # seconds of each step of the build, in order
        last = [t0]

        def mark(phase: str) -> None:  # the GPU's queued work counts in the phase that queued it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.startup_phases[phase] = round(now - last[0], 3)
            last[0] = now

        with self._on_device():
            fp8 = cfg.expert_dtype == "fp8"  # an FP8 checkpoint's experts then keep their block scales
            block, gemm_math, self.fp8_slots = _expert_layout(cfg, self.device)
            self.config = cfg = _chunk_chosen(cfg, self.device, self.fp8_slots)
            self.memory_plan = _plan_memory(cfg, self.device, self.fp8_slots)
            mark("plan")
            bank = ExpertBank(mc, self.dtype, pin=self.device.type == "cuda", check_memory=cfg.host_memory_check,
                              dense_bytes=dense_params(mc) * self.dtype.itemsize, fp8=fp8, block=block)
            # one cache per sequence the engine may run at once (the first is ``kv``, which tools drive directly)
            mark("host bank")
            self.model, self.caches = build_model(mc, cfg.weights, bank, cfg.max_context, self.device, self.dtype,
                                                  router_skew=cfg.router_skew, caches=cfg.max_num_seqs)
            self.kv = self.caches[0]
            self.model.prefill_kernel = self._prefill_kernel(cfg.prefill_kernels)
            self.slots_per_layer = self.memory_plan.slots_per_layer if self.memory_plan else (
                cfg.expert_slots_per_layer or mc.num_experts)
            resident = cfg.prefill_mode == "resident"
            # the slots in the prefill buffers' memory: where the plan chose it, or asked for without a plan
            share = (self.memory_plan.slots_share_buffers if self.memory_plan is not None
                     else cfg.slots_share_buffers == "on")
            mark("weights")
            self.store = ExpertStore(bank, self.device, self.slots_per_layer, resident, cfg.d2d_from_slot_cache,
                                     fp8_slots=self.fp8_slots, dequant_on_compute=cfg.fp8_dequant == "compute",
                                     fp8_gemm_math=gemm_math, share_buffers=share)
            self.scheduler = Scheduler(self, self.caches)
            self.decoder = Decoder(self.model, self.store, self.caches, graphs=cfg.decode_graphs,
                                   experts=cfg.decode_experts, attention=cfg.decode_attention,
                                   misses=cfg.decode_misses, prefetch=cfg.decode_prefetch)
            self.steps = self._layer_steps()
            self._batch_exact: dict[tuple[int, int], bool] = {}
            if cfg.attention_batch > 1:  # probe the configured chunk length now, not in the first request
                self._batching(cfg.attention_batch, cfg.chunk_tokens)
            mark("device experts, decoder, steps")
            self.measured_h2d_gbps = self.store.measure_h2d_gbps(cfg.bandwidth_probe_bytes)
            mark("bandwidth probe")
            self.decode_warmup: dict | None = None
            if cfg.warm_decode_graphs and self.decoder.graphs is not None:
                self._warm_decode()
                mark("decode graphs")
            self.policy: CostModel | None = None
            self.calibration: Calibration | None = None
            # demand prefills not yet compared with the model: (chunks, experts copied)
            self._calibration_pending: deque[tuple[list[tuple[int, int]], int]] = deque(maxlen=64)
            self.prefill_warmup: dict | None = None
            if cfg.warm_prefill or (cfg.warm_prefill is None and self.device.type == "cuda"):
                self._warm_prefill()
                mark("prefill warm-up")
            if cfg.prefill_mode == "auto":  # the cost model's inputs, and routing counts from now on
                self.policy = self._measure_costs()
                self.steps.track_routing()
                if cfg.auto_calibration:
                    self.calibration = Calibration(cfg.auto_calibration)
                mark("auto's costs")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.bank_bytes = bank.bank_bytes
        self.expert_format = bank.format
        self.counters: dict = {
            "requests_total": 0, "requests_cancelled": 0, "h2d_bytes_total": 0, "d2d_bytes_total": 0,
            "expert_copies_total": 0, "startup_h2d_bytes": self.store.startup_h2d_bytes,
            "cached_prompt_tokens_total": 0,
            "requests_by_path": {m: 0 for m in PREFILL_PATHS},
            "prefill_tokens_by_path": {m: 0 for m in PREFILL_PATHS},
        }
        self.startup_s = time.perf_counter() - t0

    def set_decode_prefetch(self, on: bool) -> None:
        """Turn the decode prefetch on or off (an engine built with it: ``decode_prefetch``; ValueError otherwise),
        and where the engine warmed its decode graphs at start, capture the new setting's now, so that no
        measured step pays for them (``tools.gpucheck_batch --decode-prefetch both``)."""
        self.decoder.set_prefetch(on)
        if self.decode_warmup is not None:
            self._warm_decode()

    def _warm_decode(self) -> None:
        """Capture every decode KV-length bucket's graphs now (``Decoder.warm``), then put back what the
        throwaway steps wrote (KV and states are garbage there, the slot cache holds their experts): the
        prefix cache and the hybrids' states are cleared, the slots flushed, the decoder's step counts kept."""
        t0 = time.perf_counter()
        steps = dict(self.decoder.steps)
        buckets = self.decoder.warm(every_way=self.config.warm_every_misses_way)
        self.decoder.steps = steps
        self.reset()
        self.store.forget_traffic()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.decode_warmup = {"kv_buckets": buckets, "seconds": round(time.perf_counter() - t0, 3)}

    def _warm_prefill(self) -> None:
        """One throwaway prefill now, so that no request pays the prefill path's first use: its layer steps' CUDA
        graphs (a key's first sighting runs eagerly, the second captures), the lazy set-up of its kernels and
        copies, Triton's compilation. On the H200 the first request of a fresh engine took 5.0-6.5 s for a 4K
        prompt, where the next ones prefilled in 0.53 s (``results/20261205b-h200-batch-decode-load``, every service's
        log). The prompt: two full chunks and a short one (at most the context less one), token 0, in the
        engine's prefill mode (auto: layer-major, before the auto policy measures and tracks anything), no
        decode. Then the prefix cache and the slots are reset and the traffic forgotten, as after the decode
        warm-up."""
        cfg = self.config
        t0 = time.perf_counter()
        n = min(2 * cfg.chunk_tokens + 1, self.caches[0].max_context - 1)
        if n < 1:
            return
        mode = "layer-major" if cfg.prefill_mode == "auto" else cfg.prefill_mode
        with torch.no_grad(), attention_backends():
            self._prefill([0] * n, 0, mode, None, cfg.chunk_tokens, cfg.attention_batch)
        self.reset()
        self.store.forget_traffic()
        self.prefill_warmup = {"tokens": n, "mode": mode, "seconds": round(time.perf_counter() - t0, 3)}

    def _prefill_kernel(self, kernels: str) -> str:
        """``EngineConfig.prefill_kernels`` for this model: ValueError where Triton's kernels do not apply."""
        if kernels == "triton":
            name = self.model.cfg.name
            if not self.model.prefill_kernels_apply:
                raise ValueError(f"prefill_kernels 'triton' applies to Qwen3-MoE and the Qwen3.5/3.6 hybrid; {name} "
                                 "norms and routes its own way")
            decode_kernels.require_attention_kernels("prefill_kernels", name, self.model.cfg.head_dim)
        return kernels

    def _layer_steps(self) -> LayerSteps:
        """The prefill layer steps: CUDA graphs of full chunks' fixed-shape half-steps where the model has them
        (``EngineConfig.prefill_graphs``, CUDA, a grouped expert kernel that captures), else eager."""
        cfg, model = self.config, self.model
        graphs = None
        if (cfg.prefill_graphs and self.device.type == "cuda" and model.prefill_graph_moe
                and model.grouped and probe_graph_capture(self.device, self.dtype)):
            graphs = GraphCache(self.device)
        return LayerSteps(model, graphs, cfg.chunk_tokens)

    @property
    def prefill_graphs_mode(self) -> str:
        return "eager" if self.steps.graphs is None else "cuda-graphs"

    def _batching(self, k: int, chunk: int) -> Batching:
        """Attention batching of ``k`` chunks of ``chunk`` tokens; whether the device computes the joint call bit
        for bit is probed once per (k, chunk) (``hybrid.attention_batching_exact``) at the start of a prompt, at
        its second chunk and at the batching limit."""
        if k <= 1:
            return Batching()
        cfg = self.config
        exact = self._batch_exact.get((k, chunk))
        if exact is None:
            limit = min(cfg.attention_batch_max_context, cfg.max_context)
            starts = sorted({0, chunk, max(0, (limit - k * chunk) // chunk * chunk)})
            with self._on_device(), torch.no_grad(), attention_backends():
                exact = attention_batching_exact(self.model_config, chunk, k, starts, self.device, self.dtype,
                                                 self.model.scale)
            self._batch_exact[(k, chunk)] = exact
        return Batching(k, cfg.attention_batch_max_context, exact)

    def _measure_costs(self) -> CostModel:
        """The auto policy's inputs (:mod:`abbench.engine.runtime.policy`), measured now: the H2D bandwidth (the start-up
        probe's, or a small probe when it was skipped), one layer step's compute time at the demand and chunk
        lengths (layer 0, eagerly, through the first prefill buffer filled with its experts: median of 3 after a
        warm-up) and one host round trip. The steps write KV and states: the engine is reset afterwards."""
        cfg, mc, store, model = self.config, self.model_config, self.store, self.model
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        gbps = self.measured_h2d_gbps
        if not gbps == gbps:  # NaN: no start-up probe
            gbps = store.measure_h2d_gbps(min(2 * store.bank.layer_bytes, 256 * 2**20))
        if store.resident is not None:
            gate_up, down = store.resident[0]
        else:
            store._copy_experts(0, 0, range(mc.num_experts))
            gate_up, down = store.buf_gate_up[0], store.buf_down[0]
        step_s: dict[int, float] = {}
        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad(), attention_backends():
            for t in sorted({min(cfg.demand_max_tokens, cfg.chunk_tokens), cfg.chunk_tokens}):
                ids = torch.randint(0, mc.vocab_size, (t,), generator=gen).to(self.device)
                times = []
                for _ in range(4):
                    sync()
                    t0 = time.perf_counter()
                    model.moe_block(*model.attn_block(0, model.embed(ids), self.kv, 0), gate_up, down)
                    sync()
                    times.append(time.perf_counter() - t0)
                step_s[t] = sorted(times[1:])[1]
            probe = torch.zeros(1, device=self.device)
            rtts = []
            for _ in range(9):
                t0 = time.perf_counter()
                probe.add_(1).tolist()
                rtts.append(time.perf_counter() - t0)
        store.forget_traffic()
        self.reset()
        return CostModel(bandwidth=gbps * 1e9, layer_bytes=store.bank.layer_bytes,
                         expert_bytes=store.bank.expert_bytes, n_layers=mc.num_hidden_layers,
                         num_experts=mc.num_experts, top_k=mc.num_experts_per_tok, step_s=step_s,
                         sync_s=sorted(rtts)[len(rtts) // 2], overlap=self.device.type == "cuda")

    def _auto_path(self, n: int, start: int, chunk_tokens: int) -> tuple[str, dict]:
        """The path the auto policy picks for n uncached tokens at ``start``, and what it saw. The demand
        prefills run since the last call are compared with the model first (``Calibration``)."""
        cfg = self.config
        counts = self.steps.route_counts
        freqs = None
        if counts is not None and int(counts.sum()) > 0:  # one host read of the routing seen so far
            freqs = (counts.double() + 1.0).cpu().numpy()  # add-one: an expert never seen is not impossible
        while self._calibration_pending and self.calibration is not None:
            chunks, copied = self._calibration_pending.popleft()
            self.calibration.observe(expected_demand_copies(self.policy, chunks, cfg.demand_max_tokens, freqs), copied)
        chunks = plan_chunks(start, start + n, chunk_tokens)
        path, reason, est, cal = choose(self.policy, chunks, cfg.layer_major_window_tokens // chunk_tokens,
                                        cfg.demand_max_tokens, freqs, cfg.auto_demand_max_tokens, self.calibration)
        info = {"path": path, "reason": reason, "routing": "observed" if freqs is not None else "uniform",
                "estimates_s": {k: round(v, 6) for k, v in est.items()}}
        if self.calibration is not None:
            info["calibrated_s"] = {k: round(v, 6) for k, v in cal.items()}
            info["calibration"] = {"demand_copies_factor": round(self.calibration.factor, 4),
                                   "demand_prefills": self.calibration.seen}
        return path, info

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # -- public API -------------------------------------------------------------------------------------
    def generate(self, request: GenerateRequest, cancel: CancelLike = None) -> Iterator[TokenEvent]:
        """Generator; yields one TokenEvent per output token; its return value (StopIteration.value) is
        RequestStats. Raises Cancelled (checked every layer step and every decode step), ContextOverflow
        before any work. What the request leaves to the engine is resolved here (:meth:`resolve`), so the
        request that runs says everything it ran with."""
        return self._generate(self.resolve(request), cancel)

    def resolve(self, request: GenerateRequest) -> GenerateRequest:
        """``request`` checked (ValueError, ContextOverflow) with every choice it left to the engine made: the
        prefill mode, the chunk length (:meth:`check_chunk_tokens`), the chunks per attention call in
        layer-major prefill (hybrid Qwen3.5/3.6 models only) and who handles the decode slot cache's misses
        (``Decoder.check_misses``; None with resident experts). ``trace_layers``: ``RequestStats.layer_trace``
        holds the prefill's layer trace (:mod:`abbench.engine.ops.trace`)."""
        mode = request.prefill_mode or self.config.prefill_mode
        k = self.config.attention_batch if request.attention_batch is None else int(request.attention_batch)
        if not 1 <= k <= MAX_ATTENTION_BATCH:
            raise ValueError(f"attention_batch must be in [1, {MAX_ATTENTION_BATCH}], got {k}")
        if k > 1 and not self.model.attention_batching:
            raise ValueError(f"attention_batch {k} needs a model with joint attention calls (the Qwen3.5/3.6 "
                             f"hybrid); {self.model_config.name} has none")
        chunk = self.check_chunk_tokens(request.chunk_tokens)
        prompt = check_request(request, self.model_config.vocab_size, self.config.max_context)
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {mode!r}")
        if mode == "resident" and self.store.resident is None:
            raise ValueError("prefill_mode 'resident' needs an engine started with prefill_mode='resident'")
        if mode == "auto" and self.policy is None:
            raise ValueError("prefill_mode 'auto' needs an engine started with prefill_mode='auto' (it measures "
                             "the cost model's inputs and tracks the routing from the start)")
        misses = self.decoder.check_misses(request.decode_misses)
        return dataclasses.replace(
            request, prompt_ids=prompt, max_tokens=int(request.max_tokens), temperature=float(request.temperature),
            logprobs=None if request.logprobs is None else int(request.logprobs), prefill_mode=mode,
            chunk_tokens=chunk, attention_batch=k, decode_misses=misses, trace_layers=bool(request.trace_layers))

    def check_chunk_tokens(self, chunk_tokens: int | None) -> int:
        """A request's prefill chunk length: the config's when None. Every mode runs the same chunk shapes, so
        any chunk length keeps chunked, layer-major, demand and resident bitwise equal to each other at that
        length (not across lengths: the chunking changes the summation order). ValueError when it is not
        positive, not a multiple of the delta rule's block on a hybrid model, or larger than the config's chunk
        length on an engine held to a device-memory budget (the budget was planned for that chunk length)."""
        cfg = self.config
        if chunk_tokens is None:
            return cfg.chunk_tokens
        chunk = int(chunk_tokens)
        if chunk <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk}")
        check_hybrid_chunk(self.model_config, chunk)
        if cfg.gpu_memory_budget_gib is not None and chunk > cfg.chunk_tokens:
            raise ValueError(f"chunk_tokens {chunk} > the engine's {cfg.chunk_tokens}: its "
                             f"{cfg.gpu_memory_budget_gib:g} GiB device-memory budget was planned for "
                             f"{cfg.chunk_tokens}-token chunks (start it with a larger --chunk-tokens)")
        return chunk

    def run(self, prompt_ids: list[int], max_tokens: int = 16, cancel: CancelLike = None,
            **fields) -> tuple[list[TokenEvent], RequestStats]:
        """Drain one request of ``prompt_ids`` and ``fields`` (GenerateRequest's): (events, stats)."""
        return drain(self.generate(GenerateRequest(list(prompt_ids), max_tokens, **fields), cancel))

    @property
    def info(self) -> BackendInfo:
        """What the server reports about this engine (the contract's ``BackendInfo``)."""
        model = self.config.model
        return BackendInfo(model=model if isinstance(model, str) else self.model_config.name,
                           model_name=self.model_config.name, vocab_size=self.model_config.vocab_size,
                           max_context=self.config.max_context or self.model_config.max_position_embeddings,
                           startup_s=self.startup_s,
                           decode_mode=self.decoder.mode, decode_kernels=self.decoder.kernels,
                           measured_h2d_gbps=self.measured_h2d_gbps, bank_bytes=self.bank_bytes,
                           slots_per_layer=self.slots_per_layer, expert_format=self.expert_format)

    def reset(self) -> None:
        """Flush the prefix cache of every sequence cache and the decode slot cache (only while idle)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("Engine.reset() while a request is running")
        try:
            if self.scheduler.busy:
                raise RuntimeError("Engine.reset() while sequences are running")
            self.scheduler.pool.clear()
            self.store.flush_slots()
        finally:
            self._lock.release()

    def prime_prefill(self) -> bool:
        """A request has arrived at an idle engine and is being parsed and tokenized: start copying the first
        layer's bank, which every layer-major and chunked prefill streams first (``ExpertStore.prime``), so the
        copy overlaps that work. Only where the engine's prefill mode streams banks,
        ``EngineConfig.prime_first_layer`` and no sequence runs (queued ones have not started: the engine thread
        that calls this starts them); returns whether a copy started."""
        cfg = self.config
        if not cfg.prime_first_layer or cfg.prefill_mode not in ("layer-major", "chunked") or self.scheduler.running:
            return False
        with self._on_device():
            return self.store.prime(0)

    def drop_prime(self) -> None:
        """The request a prime was for will not prefill (refused, failed): forget it (``ExpertStore.drop_prime``)."""
        if not self.scheduler.running:
            self.store.drop_prime()

    def reset_peak(self) -> None:
        """Start a new peak of torch's allocated device memory (CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def device_bytes(self) -> int | None:
        """torch's allocated device memory now (None off CUDA)."""
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else None

    def peak_bytes(self) -> int | None:
        """torch's peak allocated device memory since the last ``reset_peak`` (None off CUDA)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None

    # -- internals --------------------------------------------------------------------------------------
    def _prefill(self, ids: list[int], start: int, mode: str, cancel: CancelLike, chunk_tokens: int,
                 attention_batch: int = 1, kv=None) -> tuple[torch.Tensor, PrefillStats]:
        """One prompt's prefill into ``kv`` (a sequence cache; the first by default), the auto policy resolved."""
        kv = self.kv if kv is None else kv
        cfg = self.config
        auto = None
        if mode == "auto":
            mode, auto = self._auto_path(len(ids), start, chunk_tokens)
        with self._on_device():
            copies0 = self.store.request.expert_copies
            t = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
            logits, stats = prefill(self.steps, self.store, kv, t, start, mode,
                                    chunk_tokens=chunk_tokens,
                                    window_tokens=cfg.layer_major_window_tokens,
                                    demand_max_tokens=cfg.demand_max_tokens, cancel=cancel,
                                    batching=self._batching(attention_batch, chunk_tokens))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.calibration is not None and stats.path == "demand":  # compared at the next auto decision
                self._calibration_pending.append((plan_chunks(start, start + len(ids), chunk_tokens),
                                                  self.store.request.expert_copies - copies0))
            if auto is not None:
                stats.requested_mode, stats.auto = "auto", auto
            return logits, stats

    def _alloc_retries(self) -> int | None:
        """The CUDA caching allocator's retry count so far (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def _sample(self, sampler: Sampler, logits: torch.Tensor) -> TokenEvent:
        with self._on_device():
            return TokenEvent(*sampler(logits))

    def _generate(self, request: GenerateRequest, cancel: CancelLike):
        """The resolved ``request`` (:meth:`resolve`) run alone through the scheduler: the generator
        :meth:`generate` returns. The server drives the scheduler itself (many requests at once)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("Engine.generate() while another request is running (one at a time)")
        out: deque = deque()
        seq = self.scheduler.submit(request, cancel, out.append)
        try:
            while True:
                while not out:
                    self.scheduler.step()
                item = out.popleft()
                if isinstance(item, Finished):
                    return item.stats
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not seq.done:  # the consumer closed the generator early
                self.scheduler.abort(seq)
            self._lock.release()
