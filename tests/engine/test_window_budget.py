"""The layer-major window budget, as prefill runs it and as the device-memory plan sizes it.

``layer_major_window_tokens`` is a promise about device memory: a layer-major window parks the activations
of at most that many tokens. So no window may hold more tokens than the budget, at chunk, window and prompt
lengths that do not divide each other (where a split rounded the wrong way shows); and the memory plan must
set aside room for a whole window's parked activations, so that a device-memory budget which cannot hold
them is refused when the engine starts, before any request runs.

The windows are observed, not recomputed: every chunk's visit to a layer goes through the model's
``attn_block``, so the chunks that run through layer 0 back to back are one window (the chunked path visits
every layer with one chunk before the next chunk starts). A small random model on CPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from abbench.engine import EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.config import ITEMSIZE  # noqa: E402
from abbench.engine.runtime.memory import plan_device_memory  # noqa: E402
from abbench.engine.runtime.prefill import plan_chunks, plan_windows, prefill  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402

MINI = ModelConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                   max_position_embeddings=1024, eos_token_id=None, name="mini-window")
KNOBS = dict(model=MINI, weights="random:3", chunk_tokens=32, layer_major_window_tokens=64, demand_max_tokens=32,
             max_context=512, bandwidth_probe_bytes=0, device="cpu")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(**KNOBS))


def _windows(engine: Engine, n: int, chunk: int, window: int, mode: str = "layer-major"):
    """Prefill n tokens; returns (logits, stats, the windows seen: lists of (start, tokens) per window)."""
    ids = torch.randint(0, MINI.vocab_size, (n,), generator=torch.Generator().manual_seed(n + chunk + window))
    calls: list[tuple[int, int, int]] = []
    model = engine.model
    real = model.attn_block

    def spy(layer, x, kv, start):
        calls.append((layer, int(start), int(x.shape[0])))
        return real(layer, x, kv, start)

    def group_spy(layer, xs, kv, starts):  # hybrids' joint attention over adjacent chunks
        calls.extend((layer, int(a), int(x.shape[0])) for x, a in zip(xs, starts))
        return real_group(layer, xs, kv, starts)

    def cache_spy(layer, x, kv, start):  # a last layer's chunk whose output nothing reads: its cache entries alone
        done = real_cache(layer, x, kv, start)
        if done:
            calls.append((layer, int(start), int(x.shape[0])))
        return done

    real_group = getattr(model, "attn_block_group", None)
    real_cache = model.cache_only
    engine.reset()
    engine.store.begin_request()
    model.attn_block, model.cache_only = spy, cache_spy
    if real_group is not None:
        model.attn_block_group = group_spy
    try:
        logits, stats = prefill(model, engine.store, engine.kv, ids, 0, mode, chunk_tokens=chunk,
                                window_tokens=window, demand_max_tokens=chunk)
    finally:
        del model.attn_block, model.cache_only  # the instance attributes: back to the class's methods
        if real_group is not None:
            del model.attn_block_group
        engine.reset()
    windows: list[list[tuple[int, int]]] = []
    previous = None
    for layer, start, tokens in calls:
        if layer == 0:
            if previous != 0:
                windows.append([])
            windows[-1].append((start, tokens))
        previous = layer
    return logits.clone(), stats, windows


CASES = [  # (chunk, window, prompt): the window is no multiple of the chunk, the prompt no multiple of either
    (32, 80, 230),    # 2.5 chunks per window: 2 fit
    (32, 100, 200),   # 3.125: 3 fit
    (24, 50, 170),    # 2.08: 2 fit
    (16, 47, 90),     # 2.94: 2 fit
    (32, 95, 96),     # a prompt of exactly the chunks that fit
    (20, 130, 170),   # 6.5: 6 fit
]
SEEN: dict[tuple[int, int, int], list[list[tuple[int, int]]]] = {}  # the windows each case ran, for the plan test


@pytest.mark.parametrize(("chunk", "window", "n"), CASES)
def test_no_window_holds_more_tokens_than_its_budget(engine: Engine, chunk: int, window: int, n: int) -> None:
    _, stats, windows = _windows(engine, n, chunk, window)
    SEEN[chunk, window, n] = windows
    assert stats.path == "layer-major", stats.fallback_reason
    sizes = [sum(t for _, t in w) for w in windows]
    assert max(sizes) <= window, (sizes, window)
    # every chunk runs exactly once, in order, and each window but the last holds as many whole chunks as
    # the budget allows (no more bank copies than needed)
    seen = [c for w in windows for c in w]
    assert seen == [(a, min(chunk, n - a)) for a in range(0, n, chunk)]
    assert all((len(w) + 1) * chunk > window for w in windows[:-1]), (sizes, window)
    # the engine's own account agrees with what ran: one bank copied per window
    assert stats.n_windows == len(windows) and stats.n_chunks == len(seen)
    assert stats.h2d_bytes == len(windows) * engine.bank_bytes


def test_window_plans_partition_the_chunks_within_their_count() -> None:
    """The planning functions alone, over many lengths: the windows hold every chunk once, in order, none
    more than the count asked for, and only the last fewer."""
    for start, n, chunk in [(0, 1, 7), (0, 230, 32), (45, 300, 32), (3, 1000, 24), (100, 95, 100)]:
        chunks = plan_chunks(start, start + n, chunk)
        assert chunks[0][0] == start and chunks[-1][1] == start + n
        assert all(b - a == chunk for a, b in chunks[:-1]) and 0 < chunks[-1][1] - chunks[-1][0] <= chunk
        for per in range(1, len(chunks) + 2):
            windows = plan_windows(chunks, per)
            assert [c for w in windows for c in w] == chunks
            assert all(len(w) == per for w in windows[:-1]) and 0 < len(windows[-1]) <= per


@pytest.mark.parametrize(("chunk", "window"), [(32, 63), (32, 32), (40, 79)])
def test_a_budget_below_two_chunks_falls_back_to_chunked(engine: Engine, chunk: int, window: int) -> None:
    logits, stats, windows = _windows(engine, 150, chunk, window)
    assert stats.path == "chunked" and "window" in stats.fallback_reason
    assert all(sum(t for _, t in w) <= chunk for w in windows)


def test_parked_activations_never_exceed_one_window(engine: Engine) -> None:
    """What the memory plan sets aside, one window of parked activations, is what prefill holds: each
    activation is embedded once per chunk and updated in place, so the embedded tensors still alive when a
    chunk is embedded are the parked ones."""
    import weakref

    model = engine.model
    real = model.embed
    alive: list[weakref.ref] = []
    parked: list[int] = []

    def spy(ids):
        x = real(ids)
        parked.append(sum(int(t.shape[0]) for r in alive if (t := r()) is not None) + int(x.shape[0]))
        alive.append(weakref.ref(x))
        return x

    chunk, window, n = 32, 80, 230
    ids = torch.randint(0, MINI.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    engine.reset()
    engine.store.begin_request()
    model.embed = spy
    try:
        _, stats = prefill(model, engine.store, engine.kv, ids, 0, "layer-major", chunk_tokens=chunk,
                           window_tokens=window, demand_max_tokens=chunk)
    finally:
        del model.embed
        engine.reset()
    assert stats.path == "layer-major" and stats.n_windows > 1 and len(parked) == stats.n_chunks
    assert max(parked) <= window, parked


def _plan(**kw):
    return plan_device_memory(EngineConfig(**{**KNOBS, "max_num_seqs": 1, **kw}).resolved(), 10**12)  # as budgeted


def test_the_plan_sets_aside_a_whole_window_of_parked_activations(engine: Engine) -> None:
    """Per token of window beyond one chunk, the plan's workspace grows by at least one token's hidden state
    (the parked activation), up to the longest window the KV cache allows; and what it sets aside covers the
    windows prefill actually parks."""
    per_token = MINI.hidden_size * ITEMSIZE["float32"]
    one_chunk = _plan(layer_major_window_tokens=32).workspace_bytes
    for window in (33, 80, 100, 257, 512):
        grown = _plan(layer_major_window_tokens=window).workspace_bytes - one_chunk
        assert grown >= (window - 32) * per_token, window
    for (chunk, window, n), windows in SEEN.items() or {c: _windows(engine, c[2], c[0], c[1])[2]
                                                        for c in CASES[:2]}.items():
        parked = max(sum(t for _, t in w) for w in windows)
        smallest = _plan(chunk_tokens=chunk, layer_major_window_tokens=chunk).workspace_bytes
        assert _plan(chunk_tokens=chunk, layer_major_window_tokens=window).workspace_bytes - smallest >= (
            parked - chunk) * per_token


def test_a_budget_that_cannot_hold_the_window_is_refused_at_start() -> None:
    """A budget that holds the engine with 64-token windows and the fewest decode slots, but not 512-token
    windows: the engine with the longer window refuses to start, naming the workspace."""
    small = _plan(layer_major_window_tokens=64)
    k = MINI.num_experts_per_tok
    budget = small.fixed_bytes + k * small.slot_bytes + small.slot_bytes // 2
    assert _plan(layer_major_window_tokens=512).fixed_bytes > small.fixed_bytes + small.slot_bytes // 2
    Engine(EngineConfig(**KNOBS, gpu_memory_budget_gib=budget / 2**30))  # fits
    with pytest.raises(ValueError, match="workspace") as e:
        Engine(EngineConfig(**{**KNOBS, "layer_major_window_tokens": 512}, gpu_memory_budget_gib=budget / 2**30))
    assert "decode needs" in str(e.value)
