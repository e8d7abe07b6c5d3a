"""Prefill in four modes behind one call, with explicit eligibility and per-prompt statistics.

``prefill(model, store, kv, ids, start, mode, ...) -> (last_logits [V] float32, PrefillStats)`` prefills
the tokens ``ids`` [T] at positions [start, start+T) (``start`` > 0 after a prefix-cache hit), writing the
KV cache, in chunks of ``chunk_tokens`` that start at ``start``. Every mode runs the same chunk shapes
through the same ``Model.attn_block``/``Model.moe_block`` calls; only the loop order and where the experts
come from differ, so logits and KV are bitwise equal across modes on one device. In every mode the last
layer's MoE half runs for the prompt's last chunk only (``skips_last_moe``): the other chunks' last-layer
output is read by nothing (their first half writes the cache), so leaving it out changes no logit and no
cache entry (``PrefillStats.moe_skipped``; chunked still streams that layer's bank for each of them):

- ``chunked``: chunk-major; every chunk runs through every layer, and every layer visit streams that layer's
  whole bank (double buffer, next layer prefetched): n_chunks x bank_bytes.
- ``layer-major``: layer-major within a window of chunks; the layer's bank is streamed once per window and
  every chunk of the window runs through it in order (each chunk's attention sees the KV that the chunks
  before it wrote at this layer), activations of all chunks parked: n_windows x bank_bytes. A window holds
  ``window_tokens // chunk_tokens`` chunks (the parked-activation budget).
- ``demand``: chunk-major; a chunk of at most ``demand_max_tokens`` tokens copies only the experts its
  tokens are routed to (read back from the router: one host sync per layer), into the layer buffer at their
  expert index; longer chunks stream the whole bank as in ``chunked``.
- ``resident``: chunk-major over experts that are on the device from the start; nothing is streamed.

When an optimised mode does not apply (layer-major with one chunk, or a window budget of one chunk; demand
with every chunk longer than demand_max_tokens) the chunked path runs, and ``PrefillStats.path`` and
``fallback_reason`` say so. ``cancel`` (a ``threading.Event``-like object or a callable) is checked before
every chunk-layer step; when set, ``Cancelled`` is raised and the KV beyond ``start`` is garbage.
No host synchronisation happens in the chunked, layer-major and resident loops.

Measured on one H200 (PCIe Gen5, 54.7 GB/s pinned H2D), Qwen3-30B-A3B shape, bf16, random weights,
2048-token chunks, time to first token: 4K tokens chunked 2.11 s / layer-major 1.07 s / resident 0.18 s;
16K 8.43 / 1.07 / 0.91 s; 32K 16.99 / 2.47 / 2.44 s, with identical output tokens and logprobs in every
mode. Layer-major is copy-bound (58 GB / 54.7 GB/s = 1.06 s) until resident compute exceeds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from abbench.engine.contract import CancelLike, check_cancel
from abbench.engine.runtime.experts import ExpertStore
from abbench.engine.models.qwen3_moe import KVCache, Model
from abbench.engine.ops.dense import attention_backends
from abbench.engine.runtime.steps import BatchingStats, LayerSteps, plan_attention_groups

@dataclass
class PrefillStats:
    requested_mode: str
    path: str  # what ran: chunked | layer-major | demand | resident
    fallback_reason: str | None
    n_tokens: int
    n_chunks: int
    n_windows: int  # layer-major windows; 0 for the other paths
    h2d_bytes: int = 0
    d2d_bytes: int = 0
    expert_copies: int = 0
    copy_wait_s: float | None = None  # set by callers after a device sync (ExpertStore.copy_stall_seconds)
    graph_replays: int = 0  # layer half-steps replayed from CUDA graphs (steps.LayerSteps)
    attention_batch: int = 1  # chunks per attention call asked for (layer-major)
    attention_batched: int = 0  # attention groups of attention_batch chunks that ran as one call
    attention_fallbacks: dict[str, int] | None = None  # groups that ran one call per chunk, by reason
    auto: dict | None = None  # set by the engine when prefill_mode auto picked the path (engine.policy)
    batch_prompts: int = 1  # prompts prefilled together (prefill_batch): the bytes and windows are the batch's
    moe_skipped: int = 0  # chunks whose last layer's MoE half was left out (not their prompt's last chunk)
    primed: bool = False  # its first layer's copy had started before it (ExpertStore.prime), and it took that copy


@dataclass(frozen=True)
class Batching:
    """Layer-major attention batching for one prefill: ``k`` chunks per call, the context length up to which a
    group may be batched, and whether the device computes a joint call exactly (steps.plan_attention_groups)."""

    k: int = 1
    max_context: int = 0
    exact: bool = False


def plan_chunks(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Chunk boundaries [(a, b)) covering [start, end), starting at ``start``."""
    return [(a, min(a + chunk_tokens, end)) for a in range(start, end, chunk_tokens)]


def plan_windows(chunks: list[tuple[int, int]], chunks_per_window: int) -> list[list[tuple[int, int]]]:
    """Layer-major windows: consecutive runs of ``chunks_per_window`` chunks (the last may be shorter)."""
    return [chunks[i:i + chunks_per_window] for i in range(0, len(chunks), chunks_per_window)]


def choose_path(mode: str, chunks: list[tuple[int, int]], chunk_tokens: int, window_tokens: int,
                demand_max_tokens: int) -> tuple[str, str | None]:
    """(path that will run, fallback reason or None)."""
    if mode == "layer-major":
        if len(chunks) <= 1:
            return "chunked", "layer-major: prompt fits in one chunk"
        if window_tokens // chunk_tokens <= 1:
            return "chunked", (f"layer-major: window budget {window_tokens} tokens holds one chunk of "
                               f"{chunk_tokens}")
        return "layer-major", None
    if mode == "demand":
        if all(b - a > demand_max_tokens for a, b in chunks):
            return "chunked", f"demand: every chunk is longer than demand_max_tokens={demand_max_tokens}"
        return "demand", None
    if mode in ("chunked", "resident"):
        return mode, None
    raise ValueError(f"unknown prefill mode {mode!r}")


def _bank_stream(model: Model, store: ExpertStore, kv: KVCache,
                 visits: list[tuple[list[tuple[int, int]], int]]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The streamed banks for ``visits`` [(the chunks that run through the layer on this visit, layer)], in
    order. What a model needs uploaded for a visit's chunks (``prepare_layer_window``: Qwen4-Exp's PLE rows)
    goes up once the visit's bank copy is queued and before the next one's, so it does not wait behind it."""
    return store.stream_layers([layer for _, layer in visits],
                               before_next=lambda i: model.prepare_layer_window(visits[i][1], kv, visits[i][0]))


def _streamed_chunks(steps: LayerSteps, store: ExpertStore, kv: KVCache, ids: torch.Tensor, start: int,
                     chunks: list[tuple[int, int]], cancel: CancelLike) -> torch.Tensor:
    """Chunk-major with every layer visit streaming the whole layer bank; returns the last chunk's x."""
    model = steps.model
    n_layers = model.cfg.num_hidden_layers
    stream = _bank_stream(model, store, kv, [([c], layer) for c in chunks for layer in range(n_layers)])
    end, x = start + int(ids.shape[0]), None
    for a, b in chunks:
        x = model.embed(ids[a - start:b - start])  # [T, H]
        for layer in range(n_layers):
            check_cancel(cancel)
            _, gate_up, down = next(stream)  # streamed whatever the step: chunked's bytes stay n_chunks x bank
            _layer_step(steps, layer, x, kv, a, b == end, gate_up, down)  # x [T, H] in place
    return x


def _layer_step(steps: LayerSteps, layer: int, x: torch.Tensor, kv: KVCache, a: int, final: bool,
                gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """A chunk-major step of chunk x at [a, ...): the whole layer, or on the last layer of a chunk that is not
    its prompt's last (``final``), the first half alone (``skips_last_moe``)."""
    if _output_unread(steps, layer, final):
        steps.attn_only(layer, x, kv, a)
    else:
        steps.layer(layer, x, kv, a, gate_up, down)


@dataclass
class Part:
    """One prompt of a prefill batch: its cache, the uncached ids [T] (on the compute device) and where they start."""

    kv: KVCache
    ids: torch.Tensor  # [T]
    start: int

    @property
    def end(self) -> int:
        return self.start + int(self.ids.shape[0])


def layer_major_loop(steps: LayerSteps | Model, weights: Iterator[tuple[torch.Tensor, torch.Tensor]], kv: KVCache,
                     ids: torch.Tensor, start: int, windows: list[list[tuple[int, int]]],
                     cancel: CancelLike = None, batching: Batching = Batching(),
                     batch_stats: BatchingStats | None = None) -> torch.Tensor:
    """The layer-major loop over ``weights``: one (gate_up, down) per (window, layer), in that order (the
    streamed banks; ``gpucheck_hybrid`` also passes the resident experts, to time the loop order without
    copies). In full-attention layers, adjacent chunks share an attention call as ``batching`` allows
    (``steps.plan_attention_groups``). Returns the last chunk's hidden states."""
    part = Part(kv, ids, start)
    return layer_major_parts(steps, weights, [part], [[(0, a, b) for a, b in w] for w in windows], cancel,
                             batching, batch_stats)[0]


def layer_major_parts(steps: LayerSteps | Model, weights: Iterator[tuple[torch.Tensor, torch.Tensor]],
                      parts: list[Part], windows: list[list[tuple[int, int, int]]], cancel: CancelLike = None,
                      batching: Batching = Batching(), batch_stats: BatchingStats | None = None,
                      ) -> list[torch.Tensor]:
    """Layer-major over a batch of prompts: ``windows`` hold (part, a, b) chunks, each prompt's chunks in order
    (a window may span prompts); per (window, layer) one bank from ``weights`` serves every chunk of the window,
    each chunk running through the layer with its own prompt's cache, so every chunk makes the calls it makes
    alone, in the same shapes, after the same chunks of its own prompt: bitwise what each prompt gives alone.
    Attention groups (``batching``) form within one prompt's run of chunks.

    Every window's last layer (``_last_layer``) runs every chunk's first half (it writes the cache) but the MoE
    half only for each prompt's last chunk: nothing reads the other chunks' last-layer output. Its first halves
    come before it asks for the layer's bank, so in a copy-bound prefill the GPU computes them while the bank is
    still arriving and only one chunk's MoE half follows it. Returns each part's last chunk's hidden states."""
    steps = steps if isinstance(steps, LayerSteps) else LayerSteps(steps)
    model = steps.model
    n_layers = model.cfg.num_hidden_layers
    chunk_tokens = max(b - a for window in windows for _, a, b in window)
    last: list[torch.Tensor | None] = [None] * len(parts)
    acts: list[torch.Tensor] = []
    for window in windows:
        acts.clear()  # the last window's activations go before this window's are embedded: one window parked
        for p, a, b in window:  # parked, [T_c, H] each
            part = parts[p]
            acts.append(model.embed(part.ids[a - part.start:b - part.start]))
            if b == part.end:
                last[p] = acts[-1]
        runs = _runs_by_part(window)
        for layer in range(n_layers):
            check_cancel(cancel)
            k = batching.k if batching.k > 1 and model.cfg.layer_types[layer] == "full_attention" else 1
            if layer == n_layers - 1 and k == 1 and skips_last_moe(model):
                _last_layer(steps, layer, weights, acts, runs, parts, cancel)
                continue
            gate_up, down = next(weights)
            for p, first, spans in runs:  # prompt by prompt, each prompt's chunks in order
                kv = parts[p].kv
                groups = plan_attention_groups(spans, k, chunk_tokens, batching.max_context, batching.exact,
                                               batch_stats)
                for g, group in enumerate(groups):  # in order: chunk c sees chunks < c at this layer
                    if g or first:
                        check_cancel(cancel)
                    if len(group) == 1:
                        c = group[0]
                        steps.layer(layer, acts[first + c], kv, spans[c][0], gate_up, down)  # [T_c, H] in place
                        continue
                    mids = model.attn_block_group(layer, [acts[first + c] for c in group], kv,
                                                  [spans[c][0] for c in group])
                    for c, mid in zip(group, mids, strict=True):
                        steps.set_mid(layer, acts[first + c], mid)
                        steps.moe(acts[first + c], gate_up, down)
    return [x for x in last if x is not None]


def skips_last_moe(model: Model) -> bool:
    """Whether prefill leaves out the last layer's MoE half for every chunk but a prompt's last: its output is
    read by nothing (the cache is written in the first half). Not Qwen4-Exp, whose halves hand over pending
    work."""
    return not model.cfg.is_qwen4


def _output_unread(steps: LayerSteps, layer: int, final: bool) -> bool:
    """Whether nothing reads ``layer``'s output for a chunk (``final``: its prompt's last): the last layer of any
    other chunk, where ``skips_last_moe``."""
    return layer == steps.model.cfg.num_hidden_layers - 1 and not final and skips_last_moe(steps.model)


def _last_layer(steps: LayerSteps, layer: int, weights: Iterator[tuple[torch.Tensor, torch.Tensor]],
                acts: list[torch.Tensor], runs: list[tuple[int, int, list[tuple[int, int]]]], parts: list[Part],
                cancel: CancelLike) -> None:
    """A layer-major window's last layer (``layer_major_parts``): every chunk's first half in order, then the
    layer's bank, then the MoE half of each prompt's last chunk in the window. A first half that later first
    halves would overwrite waits in a copy (prompts of a batch that end before the window's last chunk)."""
    needed: list[tuple[int, tuple[torch.Tensor, ...] | None]] = []  # (acts index, held first half or current)
    for p, first, spans in runs:
        kv = parts[p].kv
        for c, (a, b) in enumerate(spans):
            if c or first:
                check_cancel(cancel)
            if b != parts[p].end:
                steps.attn_only(layer, acts[first + c], kv, a)
                continue
            steps.attn(layer, acts[first + c], kv, a)
            needed.append((first + c, None if first + c == len(acts) - 1 else steps.hold_mid()))
    gate_up, down = next(weights)
    for i, mid in sorted(needed, key=lambda e: e[1] is not None):  # the current first half before any held one
        if mid is not None:
            steps.resume(acts[i], mid)
        steps.moe(acts[i], gate_up, down)


def _runs_by_part(window: list[tuple[int, int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """A window's chunks as runs of one prompt: (part, index of its first chunk in the window, its spans)."""
    runs: list[tuple[int, int, list[tuple[int, int]]]] = []
    for i, (p, a, b) in enumerate(window):
        if runs and runs[-1][0] == p:
            runs[-1][2].append((a, b))
        else:
            runs.append((p, i, [(a, b)]))
    return runs


def _demand_chunk(steps: LayerSteps, store: ExpertStore, kv: KVCache, x: torch.Tensor, a: int,
                  cancel: CancelLike, final: bool) -> torch.Tensor:
    for layer in range(steps.model.cfg.num_hidden_layers):
        check_cancel(cancel)
        if _output_unread(steps, layer, final):
            steps.attn_only(layer, x, kv, a)  # nothing loaded: nothing reads the output
            break
        top_ids = steps.attn(layer, x, kv, a)  # [T, k]
        gate_up, down = store.load_experts(layer, torch.unique(top_ids).tolist())  # host sync: which experts
        steps.moe(x, gate_up, down)  # x [T, H] in place
    return x


def _resident_chunks(steps: LayerSteps, store: ExpertStore, kv: KVCache, ids: torch.Tensor, start: int,
                     chunks: list[tuple[int, int]], cancel: CancelLike) -> torch.Tensor:
    assert store.resident is not None
    model = steps.model
    end, x = start + int(ids.shape[0]), None
    for a, b in chunks:
        x = model.embed(ids[a - start:b - start])  # [T, H]
        for layer in range(model.cfg.num_hidden_layers):
            check_cancel(cancel)
            gate_up, down = store.resident[layer]
            _layer_step(steps, layer, x, kv, a, b == end, gate_up, down)  # x [T, H] in place
    return x


def _run(steps: LayerSteps, store: ExpertStore, kv: KVCache, ids: torch.Tensor, start: int,
         chunks: list[tuple[int, int]], path: str, chunks_per_window: int, demand_max_tokens: int,
         cancel: CancelLike, batching: Batching, batch_stats: BatchingStats) -> tuple[torch.Tensor, int]:
    """Run ``path``; returns (the last chunk's hidden states [T, H], number of layer-major windows)."""
    model = steps.model
    if path == "chunked":
        return _streamed_chunks(steps, store, kv, ids, start, chunks, cancel), 0
    if path == "resident":
        return _resident_chunks(steps, store, kv, ids, start, chunks, cancel), 0
    if path == "layer-major":
        windows = plan_windows(chunks, chunks_per_window)
        visits = [(window, layer) for window in windows for layer in range(model.cfg.num_hidden_layers)]
        stream = _bank_stream(model, store, kv, visits)
        weights = ((gate_up, down) for _, gate_up, down in stream)
        return layer_major_loop(steps, weights, kv, ids, start, windows, cancel, batching,
                                batch_stats), len(windows)
    # demand: runs of long chunks stream whole banks, short chunks load only their routed experts
    i, x = 0, None
    while i < len(chunks):
        a, b = chunks[i]
        if b - a <= demand_max_tokens:
            x = _demand_chunk(steps, store, kv, model.embed(ids[a - start:b - start]), a, cancel,
                              b == start + int(ids.shape[0]))
            i += 1
            continue
        j = i
        while j < len(chunks) and chunks[j][1] - chunks[j][0] > demand_max_tokens:
            j += 1
        x = _streamed_chunks(steps, store, kv, ids, start, chunks[i:j], cancel)
        i = j
    return x, 0


@torch.no_grad()
def prefill(model: Model | LayerSteps, store: ExpertStore, kv: KVCache, ids: torch.Tensor, start: int, mode: str, *,
            chunk_tokens: int, window_tokens: int, demand_max_tokens: int,
            cancel: CancelLike = None, batching: Batching = Batching()) -> tuple[torch.Tensor, PrefillStats]:
    """Prefill ``ids`` [T] (on the compute device) at positions [start, start+T); see the module docstring.
    ``model`` may be the engine's ``LayerSteps`` (CUDA graphs of fixed-shape layer steps)."""
    steps = model if isinstance(model, LayerSteps) else LayerSteps(model)
    model = steps.model
    n = int(ids.shape[0])
    if n < 1:
        raise ValueError("prefill needs at least one token")
    if start + n > kv.max_context:
        raise ValueError(f"prefill to position {start + n} > KV cache length {kv.max_context}")
    if mode == "resident" and store.resident is None:
        raise ValueError("resident prefill needs an engine started with prefill_mode='resident'")
    chunks = plan_chunks(start, start + n, chunk_tokens)
    path, reason = choose_path(mode, chunks, chunk_tokens, window_tokens, demand_max_tokens)
    kv.write_tokens(start, ids)  # kept by models that read token ids inside layers (Qwen4-Exp's PLE)
    before, replays, primes = store.request.snapshot(), steps.replays, store.primes_taken
    skipped = steps.moe_skipped
    batch_stats = BatchingStats()
    with attention_backends():
        x, n_windows = _run(steps, store, kv, ids, start, chunks, path, window_tokens // chunk_tokens,
                            demand_max_tokens, cancel, batching, batch_stats)
        logits = model.logits(x[-1:])  # [V]
    moved = store.request.minus(before)
    batched = path == "layer-major" and batching.k > 1
    stats = PrefillStats(requested_mode=mode, path=path, fallback_reason=reason, n_tokens=n,
                         n_chunks=len(chunks), n_windows=n_windows, h2d_bytes=moved.h2d_bytes,
                         d2d_bytes=moved.d2d_bytes, expert_copies=moved.expert_copies,
                         graph_replays=steps.replays - replays, attention_batch=batching.k,
                         attention_batched=batch_stats.batched,
                         attention_fallbacks=dict(batch_stats.fallbacks) if batched else None,
                         primed=store.primes_taken > primes, moe_skipped=steps.moe_skipped - skipped)
    return logits, stats


@torch.no_grad()
def prefill_batch(steps: LayerSteps, store: ExpertStore, parts: list[Part], *, chunk_tokens: int, window_tokens: int,
                  cancel: CancelLike = None,
                  batching: Batching = Batching()) -> list[tuple[torch.Tensor, PrefillStats]]:
    """Layer-major prefill of several prompts together (each ``Part`` with its own cache): the prompts' chunks,
    prompt after prompt, in windows of ``window_tokens // chunk_tokens`` chunks (the parked-activation budget
    spans the batch), each window's bank streamed once for every prompt in it (``layer_major_parts``). Each
    prompt's logits and KV are bitwise what it gives alone in any mode. The stats are per prompt; the bytes,
    copies, windows and graph replays are the batch's (shared, not divided). Falls back to chunked (each prompt
    alone) when the batch has one chunk or a window holds one chunk."""
    model = steps.model
    for part in parts:
        if part.ids.shape[0] < 1:
            raise ValueError("prefill needs at least one token")
        if part.end > part.kv.max_context:
            raise ValueError(f"prefill to position {part.end} > KV cache length {part.kv.max_context}")
    chunks = [(p, a, b) for p, part in enumerate(parts) for a, b in plan_chunks(part.start, part.end, chunk_tokens)]
    path, reason = choose_path("layer-major", [(a, b) for _, a, b in chunks], chunk_tokens, window_tokens, 0)
    if path != "layer-major":  # one chunk in all: one prompt
        return [prefill(steps, store, part.kv, part.ids, part.start, "layer-major", chunk_tokens=chunk_tokens,
                        window_tokens=window_tokens, demand_max_tokens=0, cancel=cancel, batching=batching)
                for part in parts]
    for part in parts:
        part.kv.write_tokens(part.start, part.ids)
    before, replays, primes = store.request.snapshot(), steps.replays, store.primes_taken
    skipped = steps.moe_skipped
    batch_stats = BatchingStats()
    windows = plan_windows(chunks, window_tokens // chunk_tokens)
    n_layers = model.cfg.num_hidden_layers
    visits = [(window, layer) for window in windows for layer in range(n_layers)]

    def before_next(i: int) -> None:  # what each prompt's chunks of the visit need uploaded (Qwen4-Exp's PLE rows)
        window, layer = visits[i]
        for p, _first, spans in _runs_by_part(window):
            model.prepare_layer_window(layer, parts[p].kv, spans)

    stream = store.stream_layers([layer for _, layer in visits], before_next=before_next)
    weights = ((gate_up, down) for _, gate_up, down in stream)
    with attention_backends():
        lasts = layer_major_parts(steps, weights, parts, windows, cancel, batching, batch_stats)
        logits = [model.logits(x[-1:]) for x in lasts]  # [V] each
    moved = store.request.minus(before)
    out = []
    for p, part in enumerate(parts):
        n = int(part.ids.shape[0])
        stats = PrefillStats(requested_mode="layer-major", path="layer-major", fallback_reason=reason, n_tokens=n,
                             n_chunks=sum(1 for q, _, _ in chunks if q == p), n_windows=len(windows),
                             h2d_bytes=moved.h2d_bytes, d2d_bytes=moved.d2d_bytes, expert_copies=moved.expert_copies,
                             graph_replays=steps.replays - replays, attention_batch=batching.k,
                             attention_batched=batch_stats.batched,
                             attention_fallbacks=dict(batch_stats.fallbacks) if batching.k > 1 else None,
                             batch_prompts=len(parts), primed=store.primes_taken > primes,
                             moe_skipped=steps.moe_skipped - skipped)
        out.append((logits[p], stats))
    return out
