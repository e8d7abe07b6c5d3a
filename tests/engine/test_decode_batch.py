"""Batched decode (``Decoder.step_batch``, abbench.engine.runtime.decode; the scheduler's decode phase): B sequences
of different prompt lengths decoding in one step get bitwise the logits, ids and logprobs each gets alone, with
resident experts and with a slot cache of top_k + 1 slots a layer (so misses evict, within a step, experts an
earlier sequence of the same step loaded); the union of a batch's experts is copied once and each copy is
charged to the sequence whose lookup missed; the per-layer path reads the routing once per layer for the whole
batch; a cancel or an exception of one sequence ends that sequence only; the warm-up covers every graph a batch
replays.

The tiny presets with a 1,024-token vocabulary (the logits' GEMV over the presets' 150-250K rows would cost more
than everything else here) and a 256-position cache; engines shared within the file. Set
ABBENCH_ENGINE_TEST_DEVICE=cuda to run them on a GPU (CUDA graphs per sequence cache, the miss copies' stream
order, and the device-handled misses' test, which needs Triton).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pytest
import torch

from abbench.engine.config import PRESETS, EngineConfig
from abbench.engine.contract import Cancelled, Finished, GenerateRequest
from abbench.engine.ops import kernels as decode_kernels
from abbench.engine.runtime.decode import DecodeItem, kv_buckets
from abbench.engine.runtime.engine import Engine

DEVICE = os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu")
KNOBS = dict(weights="random:0", chunk_tokens=64, layer_major_window_tokens=256, max_context=256,
             bandwidth_probe_bytes=0, max_num_seqs=3, device=DEVICE)
MODELS = ("tiny", "qwen3.5-tiny", "qwen4-exp-tiny")
VOCAB = 1024
LENGTHS = (70, 23, 41)  # three prompts of different lengths
TOKENS = 4  # output tokens a sequence: the first from prefill, then 3 decode steps


def _config(model: str, experts: str, **kw) -> EngineConfig:
    """``experts``: "offloaded" (top_k + 1 slots a layer, the host handles the misses: the per-layer path) or
    "resident" (whole steps)."""
    mc = dataclasses.replace(PRESETS[model], vocab_size=VOCAB, eos_token_id=VOCAB - 1, name=f"{model}-v{VOCAB}")
    if experts == "resident":
        return EngineConfig(model=mc, prefill_mode="resident", **{**KNOBS, **kw})
    return EngineConfig(model=mc, prefill_mode="chunked", expert_slots_per_layer=mc.num_experts_per_tok + 1,
                        **{**KNOBS, "decode_misses": "host", **kw})


@pytest.fixture(scope="module")
def engines() -> Callable[[str, str], Engine]:
    """One engine per (model, experts) for the whole file, built when a test first asks for it."""
    made: dict[tuple[str, str], Engine] = {}

    def get(model: str, experts: str) -> Engine:
        if (model, experts) not in made:
            made[model, experts] = Engine(_config(model, experts))
        return made[model, experts]

    return get


def _prompts(engine: Engine, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, engine.model_config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _request(engine: Engine, prompt: list[int], n: int = TOKENS) -> GenerateRequest:
    return engine.resolve(GenerateRequest(prompt, n, ignore_eos=True, logprobs=3, prefill_mode="layer-major"))


_SOLO: dict[tuple, list[tuple]] = {}


def _alone(engine: Engine, prompt: list[int], n: int = TOKENS) -> list[tuple]:
    """(id, logprob, top logprobs) of each output token of ``prompt`` alone on the engine (cached per engine)."""
    key = (id(engine), tuple(prompt), n)
    if key not in _SOLO:
        engine.reset()
        events, _ = engine.run(prompt, n, ignore_eos=True, logprobs=3, prefill_mode="layer-major")
        _SOLO[key] = [(e.token_id, e.logprob, e.top_logprobs) for e in events]
    return _SOLO[key]


def _together(engine: Engine, prompts: list[list[int]], cancels=None, n: int = TOKENS) -> list[list]:
    """Every prompt submitted to the scheduler before it steps (as the server submits concurrent requests), then
    stepped until all are done: what each one emitted."""
    engine.reset()
    outs: list[list] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.scheduler.submit(_request(engine, p, n), None if cancels is None else cancels[i], outs[i].append)
    while engine.scheduler.busy:
        engine.scheduler.step()
    return outs


def _tokens(out: list) -> list[tuple]:
    return [(e.token_id, e.logprob, e.top_logprobs) for e in out if not isinstance(e, (Finished, BaseException))]


@pytest.fixture
def batch_sizes(monkeypatch) -> Callable[[Engine], list[int]]:
    """Spy on an engine's ``step_batch``: the size of every batch it runs."""
    sizes: list[int] = []

    def spy(engine: Engine) -> list[int]:
        real = engine.decoder.step_batch
        monkeypatch.setattr(engine.decoder, "step_batch", lambda items, *a, **kw: (sizes.append(len(items)),
                                                                                    real(items, *a, **kw))[1])
        return sizes

    return spy


@pytest.mark.parametrize("experts", ["offloaded", "resident"])
@pytest.mark.parametrize("model", MODELS)
def test_sequences_decoding_together_get_the_ids_and_logprobs_they_get_alone(engines, batch_sizes, model, experts):
    """Through the scheduler (the server's path): three requests of different prompt lengths admitted together
    decode in batched steps of three, each with bitwise its solo ids, logprobs and top logprobs."""
    engine = engines(model, experts)
    prompts = _prompts(engine)
    solo = [_alone(engine, p) for p in prompts]
    sizes = batch_sizes(engine)
    outs = _together(engine, prompts)
    assert sizes == [3] * (TOKENS - 1)  # one prefill batch, then every decode step over all three
    for out, want in zip(outs, solo, strict=True):
        assert isinstance(out[-1], Finished) and _tokens(out) == want
    stats = [out[-1].stats for out in outs]
    if experts == "offloaded":
        assert all(s.decode_steps_per_layer == TOKENS - 1 and s.slot_misses > 0 for s in stats)
    else:
        assert all(s.decode_steps_whole == TOKENS - 1 and s.slot_misses == s.slot_hits == 0 for s in stats)


def _first_token(engine: Engine, prompt: list[int], cache: int) -> int:
    """Prefill ``prompt`` into sequence cache ``cache``; its first token (greedy)."""
    mode = "resident" if engine.store.resident is not None else "chunked"
    with torch.no_grad():
        logits, _ = engine._prefill(prompt, 0, mode, None, engine.config.chunk_tokens, kv=engine.caches[cache])
    return int(torch.argmax(logits))


def _solo_logits(engine: Engine, prompt: list[int], steps: int) -> list[torch.Tensor]:
    engine.reset()
    tok, out = _first_token(engine, prompt, 0), []
    with engine._on_device():
        for i in range(steps):
            logits = engine.decoder.step(tok, len(prompt) + i, cache=0)
            out.append(logits.clone())
            tok = int(torch.argmax(logits))
    return out


@pytest.mark.parametrize("experts", ["offloaded", "resident"])
@pytest.mark.parametrize("model", MODELS)
def test_a_batched_step_gives_each_sequence_the_logits_of_its_solo_step(engines, model, experts):
    """Directly through the decoder: each sequence's logits at every step are bitwise those of its solo steps,
    whichever cache it decodes in. Offloaded, some batch step copies more experts than the slot cache has
    slots (so a lookup evicted an expert an earlier sequence of the same step loaded and read), and every step
    reads the routing once per layer."""
    engine = engines(model, experts)
    prompts = _prompts(engine, seed=1)
    steps = TOKENS - 1
    solo = [_solo_logits(engine, p, steps) for p in prompts]
    engine.reset()
    order = [2, 0, 1]  # prompt i decodes in cache order[i]
    toks = [_first_token(engine, p, order[i]) for i, p in enumerate(prompts)]
    decoder, store, L = engine.decoder, engine.store, engine.model_config.num_hidden_layers
    copies = []
    with engine._on_device():
        for step in range(steps):
            syncs0, copies0 = decoder.syncs, store.lifetime.expert_copies
            items = [DecodeItem(toks[i], len(p) + step, order[i]) for i, p in enumerate(prompts)]
            results = decoder.step_batch(items)
            assert decoder.syncs - syncs0 == (L if experts == "offloaded" else 0)
            copies.append(store.lifetime.expert_copies - copies0)
            for i, r in enumerate(results):
                assert r.error is None and torch.equal(r.logits, solo[i][step]), (i, step)
                toks[i] = int(torch.argmax(r.logits))
            assert sum(r.traffic.expert_copies for r in results) == copies[-1]  # every copy charged to one of them
    if experts == "offloaded":
        assert max(copies) > L * engine.slots_per_layer
    else:
        assert copies == [0] * steps


def test_the_per_layer_path_reads_the_routing_once_per_layer_for_the_whole_batch(engines):
    engine = engines("tiny", "offloaded")
    L = engine.model_config.num_hidden_layers
    engine.reset()
    prompts = _prompts(engine, seed=2)
    toks = [_first_token(engine, p, c) for c, p in enumerate(prompts)]
    decoder = engine.decoder
    syncs0 = decoder.syncs
    results = decoder.step_batch([DecodeItem(t, len(p), c) for c, (t, p) in enumerate(zip(toks, prompts))])
    assert all(r.error is None and r.way == "per_layer" for r in results)
    assert decoder.syncs - syncs0 == L  # not 3 x L
    decoder.step(toks[0], len(prompts[0]) + 1, cache=0)
    assert decoder.syncs - syncs0 == 2 * L


def test_the_union_of_a_batchs_experts_is_copied_once_and_charged_to_the_sequence_that_missed(engines):
    """Two sequences of one prompt route alike. From a flushed slot cache at every step, one alone copies its
    k experts a layer; the two decoding together copy exactly that (the union, once), all charged to the first,
    while the second only hits what the first just loaded; one after the other they copy twice that. Through the
    scheduler (no flushes), every decode copy the engine counts is charged to exactly one of the two requests,
    and each request is charged its own k lookups a layer and step."""
    engine = engines("tiny", "offloaded")
    L, k = engine.model_config.num_hidden_layers, engine.model_config.num_experts_per_tok
    store, decoder = engine.store, engine.decoder
    prompt = _prompts(engine, (50,), seed=3)[0]
    steps = 3

    def decode(caches: list[int]) -> tuple[int, list[list[int]]]:
        """Expert copies in all, and each item's (copies, hits, misses)."""
        toks = [_first_token(engine, prompt, c) for c in caches]
        charged = [[0, 0, 0] for _ in caches]
        c0 = store.lifetime.expert_copies
        with engine._on_device():
            for step in range(steps):
                store.flush_slots()
                results = decoder.step_batch([DecodeItem(t, len(prompt) + step, c) for t, c in zip(toks, caches)])
                for mine, r in zip(charged, results, strict=True):
                    mine[0] += r.traffic.expert_copies
                    mine[1] += r.lookups.hits
                    mine[2] += r.lookups.misses
                toks = [int(torch.argmax(r.logits)) for r in results]
        return store.lifetime.expert_copies - c0, charged

    n = steps * L * k
    engine.reset()
    assert decode([0]) == (n, [[n, 0, n]])
    engine.reset()
    assert decode([0, 1]) == (n, [[n, 0, n], [0, n, 0]])  # the union, copied once, charged to the first
    engine.reset()
    assert decode([0])[0] + decode([1])[0] == 2 * n  # one after the other: twice

    engine.reset()
    h2d0 = engine.counters["h2d_bytes_total"]
    outs = _together(engine, [prompt, prompt])
    stats = [out[-1].stats for out in outs]
    assert engine.counters["h2d_bytes_total"] - h2d0 == stats[0].prefill_h2d_bytes + sum(s.decode_h2d_bytes
                                                                                         for s in stats)
    for s in stats:
        assert s.slot_hits + s.slot_misses == (TOKENS - 1) * L * k
        assert s.decode_h2d_bytes == s.slot_misses * store.bank.expert_bytes
    assert 0 < sum(s.slot_misses for s in stats) < (TOKENS - 1) * L * k  # what one misses the other hits


class _CancelAt:
    """A cancel flag that turns set at its ``n``-th look once ``armed``."""

    def __init__(self, n: int):
        self.n, self.looks, self.armed = n, 0, False

    def is_set(self) -> bool:
        if self.armed:
            self.looks += 1
        return self.armed and self.looks >= self.n


@pytest.mark.parametrize("model", MODELS)
def test_a_sequence_cancelled_mid_step_leaves_the_other_two_as_they_are_alone(engines, model):
    """The middle sequence's cancel turns set inside a batched step, at its third layer (looks: the scheduler's,
    the step's, layer 1's, layer 2's): it gets ``Cancelled`` after the tokens it had, the two others go on in
    the same steps with bitwise their solo ids and logprobs."""
    engine = engines(model, "offloaded")
    prompts = _prompts(engine, seed=4)
    n = TOKENS + 1
    solo = [_alone(engine, p, n) for p in prompts]
    cancel = _CancelAt(4)
    cancelled0 = engine.counters["requests_cancelled"]
    engine.reset()
    outs: list[list] = [[] for _ in prompts]
    sched = engine.scheduler
    for i, p in enumerate(prompts):
        sched.submit(_request(engine, p, n), cancel if i == 1 else None, outs[i].append)
    sched.step()  # the prefill batch: every first token
    sched.step()  # a batched decode step
    cancel.armed = True
    while sched.busy:
        sched.step()
    assert isinstance(outs[1][-1], Cancelled) and _tokens(outs[1]) == solo[1][:2]  # mid-way through its 3rd
    assert cancel.looks == 4
    for i in (0, 2):
        assert isinstance(outs[i][-1], Finished) and _tokens(outs[i]) == solo[i]
    assert engine.counters["requests_cancelled"] == cancelled0 + 1 and sched.pool.free() == 3


def test_a_cancel_seen_mid_step_takes_only_that_sequence_out_of_the_remaining_layers(engines, monkeypatch):
    """Directly: the cancelled item's result is ``Cancelled`` and it runs no layer past the cancel; the others'
    logits are their solo ones, in this step and the next."""
    engine = engines("tiny", "offloaded")
    prompts = _prompts(engine, seed=5)
    solo = [_solo_logits(engine, p, 2) for p in prompts]
    engine.reset()
    toks = [_first_token(engine, p, c) for c, p in enumerate(prompts)]
    decoder = engine.decoder
    attn: list[tuple[int, int]] = []  # (cache, layer) of every attention half run (eagerly or a graph's replay)
    real_run = decoder._run
    monkeypatch.setattr(decoder, "_run", lambda c, key, fn: (attn.extend([(c, key[2])] if key[0] == "attn" else []),
                                                             real_run(c, key, fn))[1])
    cancel = _CancelAt(3)  # the step's look, layer 1's, layer 2's
    cancel.armed = True
    results = decoder.step_batch([DecodeItem(toks[0], len(prompts[0]), 0), DecodeItem(toks[1], len(prompts[1]), 1,
                                                                                       cancel),
                                  DecodeItem(toks[2], len(prompts[2]), 2)])
    assert isinstance(results[1].error, Cancelled) and results[1].logits is None
    assert [layer for c, layer in attn if c == 1] == [0, 1]
    for i in (0, 2):
        assert results[i].error is None and torch.equal(results[i].logits, solo[i][0])
    toks = [int(torch.argmax(results[i].logits)) for i in (0, 2)]
    again = decoder.step_batch([DecodeItem(toks[0], len(prompts[0]) + 1, 0),
                                DecodeItem(toks[1], len(prompts[2]) + 1, 2)])
    assert torch.equal(again[0].logits, solo[0][1]) and torch.equal(again[1].logits, solo[2][1])


def test_an_exception_in_one_sequences_lookup_fails_that_sequence_only(engines, monkeypatch):
    """An error raised by one sequence's own work (here its slot lookup at layer 2) ends that sequence, whose
    request gets the error; the others get their solo ids and logprobs. An error of the batch's shared routing
    read is no one sequence's: every sequence still in the step gets it."""
    engine = engines("tiny", "offloaded")
    store, decoder = engine.store, engine.decoder
    prompts = _prompts(engine, seed=6)
    solo = [_alone(engine, p) for p in prompts]
    real = store.decode_experts
    calls = {"n": 0, "armed": False}
    boom = RuntimeError("lookup failed")

    def failing(layer: int, ids):
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] == 2 * 3 + 2:  # layers 0 and 1 of three sequences, then layer 2's second
                raise boom
        return real(layer, ids)

    monkeypatch.setattr(store, "decode_experts", failing)
    engine.reset()
    outs: list[list] = [[] for _ in prompts]
    sched = engine.scheduler
    for i, p in enumerate(prompts):
        sched.submit(_request(engine, p), None, outs[i].append)
    sched.step()  # prefill
    calls["armed"] = True
    while sched.busy:
        sched.step()
    assert outs[1][-1] is boom and _tokens(outs[1]) == solo[1][:1]
    for i in (0, 2):
        assert isinstance(outs[i][-1], Finished) and _tokens(outs[i]) == solo[i]
    assert sched.pool.free() == 3

    monkeypatch.setattr(store, "decode_experts", real)
    engine.reset()
    toks = [_first_token(engine, p, c) for c, p in enumerate(prompts)]
    read = RuntimeError("read failed")
    monkeypatch.setattr(decoder, "_routing", lambda top_ids: (_ for _ in ()).throw(read))
    results = decoder.step_batch([DecodeItem(t, len(p), c) for c, (t, p) in enumerate(zip(toks, prompts))])
    assert [r.error for r in results] == [read] * 3 and all(r.logits is None for r in results)


def test_a_cancel_flag_that_raises_fails_its_sequence_only(engines):
    """The server's injected OOM comes from a request's cancel flag (``serve.faults``): raised at the scheduler's
    look before the batched step, it fails that sequence, and the other two decode as alone."""
    engine = engines("tiny", "offloaded")
    prompts = _prompts(engine, seed=9)
    solo = [_alone(engine, p) for p in prompts]
    oom = torch.OutOfMemoryError("injected")

    class Raising:
        armed = False

        def is_set(self) -> bool:
            if self.armed:
                raise oom
            return False

    flag = Raising()
    outs = [[] for _ in prompts]
    engine.reset()
    sched = engine.scheduler
    for i, p in enumerate(prompts):
        sched.submit(_request(engine, p), flag if i == 2 else None, outs[i].append)
    sched.step()  # prefill
    flag.armed = True
    while sched.busy:
        sched.step()
    assert outs[2][-1] is oom and _tokens(outs[2]) == solo[2][:1]
    for i in (0, 1):
        assert isinstance(outs[i][-1], Finished) and _tokens(outs[i]) == solo[i]


class _Graphs:
    """A stand-in for one cache's ``GraphCache`` on any device: runs every piece eagerly and records its key."""

    def __init__(self):
        self.keys: list[tuple] = []

    def run(self, key: tuple, fn: Callable[[], None]) -> None:
        self.keys.append(key)
        fn()


@pytest.mark.parametrize("experts", ["offloaded", "resident"])
def test_the_warm_up_covers_every_graph_a_batched_step_replays(engines, monkeypatch, experts):
    """Each sequence cache has its own graphs, keyed by the cache, and the batched steps theirs: the warm-up's
    steps see every key that three sequences decoding together use afterwards, and per cache no more than
    2 + buckets x 2 x layers keys where the host handles the misses (the per-layer path: embedding, head, per
    bucket every layer's two halves), or one whole step per bucket (resident; misses on the device), only the
    engine's own way, and one batched step's key per batch size (2 to C sequences; where the decoder batches:
    CUDA with Triton's kernels)."""
    engine = engines("tiny", experts)
    decoder = engine.decoder
    graphs = [_Graphs() for _ in engine.caches]
    monkeypatch.setattr(decoder, "graphs", graphs)
    batch = _Graphs()
    monkeypatch.setattr(decoder, "batch_graphs", batch)
    engine._warm_decode()
    warmed = [set(g.keys) for g in graphs]
    warmed_batch = set(batch.keys)
    for g in (*graphs, batch):
        g.keys.clear()
    _together(engine, _prompts(engine, seed=7))
    C, L = len(engine.caches), engine.model_config.num_hidden_layers
    buckets = len(kv_buckets(engine.config.max_context))
    assert sum(len(g.keys) for g in (*graphs, batch)) > 0
    for c, g in enumerate(graphs):
        assert set(g.keys) <= warmed[c]
        assert all(key[1] == c for key in warmed[c])  # every key names its cache
    assert set(batch.keys) <= warmed_batch
    if experts == "offloaded":  # the engine's way of handling misses only: per layer (host), else whole steps
        per_cache = buckets if decoder.misses == "device" else 2 + buckets * 2 * L
    else:
        per_cache = buckets
    assert [len(w) for w in warmed] == [per_cache] * C
    whole = experts != "offloaded" or decoder.misses == "device"  # a batch of host-handled misses runs per item
    assert len(warmed_batch) == ((C - 1) if decoder.batched and whole else 0)


_TRITON = decode_kernels.have_triton() and (DEVICE.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not _TRITON, reason="Triton's decode kernels run on CUDA, or on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("model,experts", [("tiny", "offloaded"), ("tiny", "resident"), ("tiny", "fp8-slots"),
                                           ("qwen3.5-tiny", "offloaded"), ("qwen3.5-tiny", "resident")])
def test_a_batch_through_the_triton_kernels_is_bitwise_solo_and_charged_per_sequence(model, experts):
    """Triton's experts and attention, misses on the device: B sequences' tokens go through every layer at once
    (one batched step: ``decode_attn_rows``, ``moe_tokens``), each sequence's logits bitwise its solo steps'
    (decoded alone through the same kernels), whichever cache it sits in. Offloaded (top_k + 1 slots a layer:
    the batch's experts overflow the slots, so some are read from the host uncached), the device's lookups are
    charged to the sequences (each expert to the first routed to it: their sum is what the store folds in) and
    a batch mixing host- and device-handled sequences runs the host's layer-outer and the device's whole, in
    list order, bitwise solo too. "fp8-slots": an FP8 bank whose slots keep its float8 values and row scales, each
    sequence bitwise the solo steps of the same engine with its slots in the compute dtype (dequantized copies).
    The hybrid (qwen3.5-tiny) runs layer-outer: each sequence's attention half as alone, the experts of all
    their tokens at once."""
    kw = dict(decode_experts="triton", decode_attention="triton")
    if experts == "fp8-slots":
        kw.update(expert_dtype="fp8", slot_dtype="fp8")
    offloaded = experts != "resident"
    engine = Engine(_config(model, "offloaded" if offloaded else "resident", **kw,
                            **({"decode_misses": "device"} if offloaded else {})))
    assert engine.decoder.batched == (model == "tiny") and engine.decoder.rows_batched == (model != "tiny")
    assert engine.store.slots is None or engine.store.slots.fp8 == (experts == "fp8-slots")
    prompts = _prompts(engine, seed=8)
    steps = TOKENS - 1
    reference = engine if experts != "fp8-slots" else Engine(
        _config(model, "offloaded", **{**kw, "slot_dtype": "model"}, decode_misses="device"))
    solo = [_solo_logits(reference, p, steps) for p in prompts]
    store, decoder = engine.store, engine.decoder
    order = [2, 0, 1]  # prompt i decodes in cache order[i]
    for ways in ([None] * 3, ["device", "host", "device"]) if offloaded else ([None] * 3,):
        engine.reset()
        toks = [_first_token(engine, p, order[i]) for i, p in enumerate(prompts)]
        with engine._on_device():
            for step in range(steps):
                store.collect_decode_counts()
                hits0, misses0 = store.slot_lifetime.hits, store.slot_lifetime.misses
                batched0 = decoder.steps["batched"]
                results = decoder.step_batch([DecodeItem(t, len(p) + step, order[i], misses=w)
                                              for i, (t, p, w) in enumerate(zip(toks, prompts, ways))])
                assert decoder.steps["batched"] - batched0 == (1 if ways[1] is None else 0)
                assert [r.way for r in results] == ["per_layer" if w == "host" else "whole" for w in ways]
                for i, r in enumerate(results):
                    assert r.error is None and torch.equal(r.logits, solo[i][step]), (ways, i, step)
                toks = [int(torch.argmax(r.logits)) for r in results]
                decoder.settle(results)
                assert sum(r.lookups.misses for r in results) == store.slot_lifetime.misses - misses0
                assert sum(r.lookups.hits for r in results) == store.slot_lifetime.hits - hits0
                assert sum(r.traffic.expert_copies for r in results) == store.slot_lifetime.misses - misses0
                if experts == "resident":
                    assert all(r.lookups.hits == r.lookups.misses == 0 for r in results)
