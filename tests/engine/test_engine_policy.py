"""The auto prefill policy and concentrated routing: what an engine developer deciding a threshold relies on.

- The cost model (pure): demand wins below the suffix length where its per-layer copies of the routed experts
  plus round trips cost as much as streaming the bank, streamed paths above; layer-major is never offered for a
  one-chunk plan; a threshold from a sweep replaces the model.
- ``router_skew``: a short chunk touches fewer experts than under the random router's near-uniform routing.
- ``prefill_mode auto``: whichever path it picks, the output is bitwise that path's; the response says what it
  picked and why; it needs an engine started in auto mode.
- Calibration: demand's expected copies are scaled by what demand prefills actually copied (a robust median over
  a window), so a model that overestimates demand's copies stops picking a streamed path where demand is faster.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from abbench.engine import EngineConfig  # noqa: E402
from abbench.engine.runtime.policy import (
    Calibration, CostModel, choose, estimate, expected_demand_copies, expected_distinct,
)
from abbench.engine.runtime.engine import Engine  # noqa: E402

DEVICE = os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu")
E, K, L, EB = 128, 8, 48, 9_437_184  # Qwen3-30B-A3B: 128 experts top-8, 48 layers, one bf16 expert 9.4 MB
GPU = CostModel(bandwidth=55e9, layer_bytes=E * EB, expert_bytes=EB, n_layers=L, num_experts=E, top_k=K,
                step_s={256: 0.2e-3, 2048: 0.5e-3}, sync_s=50e-6, overlap=True)


def _one_chunk(t: int) -> list[tuple[int, int]]:
    return [(16384, 16384 + t)]


def test_demand_wins_below_the_crossover_and_streaming_above():
    """Uniform routing: the crossover is where L x (step + sync + distinct(T) x expert / bw) = max(bank, L x step);
    demand is chosen just below it and the streamed path just above."""
    bank = GPU.bank_s

    def demand(t: int) -> float:
        return L * (GPU.step(t) + GPU.sync_s + expected_distinct(None, t, K, E) * EB / GPU.bandwidth)

    cross = next(t for t in range(1, 2049) if demand(t) >= max(bank, L * GPU.step(t)))
    assert 10 < cross < 256  # under uniform routing top-8 of 128 touches most experts within a few dozen tokens
    below, _, est, _ = choose(GPU, _one_chunk(cross - 1), 64, 2048)
    assert below == "demand" and est["demand"] < est["chunked"]
    above, reason, _, _ = choose(GPU, _one_chunk(cross + 1), 64, 2048)
    assert above == "chunked" and "chunked" in reason


def test_concentrated_routing_moves_the_crossover_up():
    """Routing frequencies that concentrate (Zipf-like) make a chunk touch fewer experts: demand stays cheaper to
    longer suffixes than under uniform routing."""
    zipf = [[1.0 / (r + 1) ** 1.5 for r in range(E)] for _ in range(L)]
    assert expected_distinct(zipf[0], 64, K, E) < 0.7 * expected_distinct(None, 64, K, E)

    def crossover(freqs):
        return next(t for t in range(1, 4097) if choose(GPU, _one_chunk(t), 64, 4096, freqs)[0] != "demand")

    assert crossover(zipf) > crossover(None)


def test_layer_major_only_for_several_chunks_and_a_threshold_replaces_the_model():
    assert "layer-major" not in estimate(GPU, _one_chunk(2048), 64, 256)
    chunks = [(a, a + 2048) for a in range(0, 16384, 2048)]
    est = estimate(GPU, chunks, 64, 256)
    assert est["layer-major"] < est["chunked"]  # one bank instead of eight
    assert choose(GPU, chunks, 64, 256)[0] == "layer-major"
    path, reason, _, _ = choose(GPU, _one_chunk(100), 64, 256, demand_max_uncached=128)
    assert path == "demand" and "--auto-demand-max-tokens 128" in reason
    assert choose(GPU, _one_chunk(200), 64, 256, demand_max_uncached=128)[0] == "chunked"
    assert choose(GPU, chunks, 64, 256, demand_max_uncached=128)[0] == "layer-major"


def _engine(**kw) -> Engine:
    knobs = dict(model="tiny", weights="random:0", device=DEVICE, chunk_tokens=64, layer_major_window_tokens=512,
                 demand_max_tokens=64, max_context=2048, bandwidth_probe_bytes=0)
    return Engine(EngineConfig(**{**knobs, **kw}))


@pytest.fixture(scope="module")
def chunked() -> Engine:
    """The random-router engine in chunked mode (tests that only run it reset it first or need no cache)."""
    return _engine(prefill_mode="chunked")


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_router_skew_concentrates_a_short_chunk_on_fewer_experts(chunked: Engine):
    uniform, skewed = chunked, _engine(prefill_mode="chunked", router_skew=2.0)
    uniform.reset()
    vocab = uniform.model_config.vocab_size
    copies = {}
    for name, engine in (("uniform", uniform), ("skewed", skewed)):
        copies[name] = sum(engine.run(_ids(16, s, vocab), 1, prefill_mode="demand")[1].expert_copies
                           for s in range(4))
    assert copies["skewed"] < copies["uniform"]
    with pytest.raises(ValueError, match="random weights only"):
        EngineConfig(weights="/nonexistent", router_skew=1.0)


def test_calibration_is_a_robust_ratio_of_copies_over_a_window():
    cal = Calibration(window=3)
    assert cal.factor == 1.0 and cal.seen == 0
    cal.observe(1000, 3900)  # a first prefill alone steers nothing
    assert cal.factor == 1.0 and cal.seen == 1
    for copied in (800, 900):
        cal.observe(1000, copied)
    assert cal.factor == pytest.approx(0.9)  # median of 0.8, 0.9, 3.9: the wild one does not move it
    for _ in range(3):  # the window forgets what came before
        cal.observe(2000, 3000)
    assert cal.factor == pytest.approx(1.5) and cal.seen == 3
    cal.observe(0, 10)  # nothing expected, nothing copied, not a number: ignored
    cal.observe(10, 0)
    cal.observe(10, float("nan"))
    assert cal.seen == 3
    for _ in range(3):
        cal.observe(1, 1e6)
    assert cal.factor == Calibration.FACTOR_RANGE[1]  # bounded
    with pytest.raises(ValueError):
        Calibration(window=0)


def test_expected_copies_are_the_demand_estimates_copy_term():
    """The copies a demand prefill is expected to make are what its estimate charges the bandwidth for: every
    short chunk's distinct experts per layer, a whole bank for a chunk that streams; a factor scales exactly
    that term."""
    zipf = [[1.0 / (r + 1) ** 1.5 for r in range(E)] for _ in range(L)]
    short = [(0, 512), (512, 1024)]
    copies = expected_demand_copies(GPU, short, 2048, zipf)
    assert copies == pytest.approx(2 * sum(expected_distinct(zipf[i], 512, K, E) for i in range(L)))
    assert expected_demand_copies(GPU, [(0, 4096)], 2048, zipf) == L * E
    base, scaled = estimate(GPU, short, 64, 2048, zipf), estimate(GPU, short, 64, 2048, zipf, copies_factor=0.5)
    assert base["demand"] - scaled["demand"] == pytest.approx(0.5 * copies * EB / GPU.bandwidth)
    assert {p: v for p, v in base.items() if p != "demand"} == {p: v for p, v in scaled.items() if p != "demand"}


def test_demand_copying_fewer_experts_than_expected_wins_where_it_is_faster():
    """Near the crossover, where the model puts a streamed path just ahead of demand, demand prefills measured to
    copy 0.8x the experts expected make auto pick demand; copies as expected change no choice."""
    zipf = [[1.0 / (r + 1) ** 1.5 for r in range(E)] for _ in range(L)]
    plans = [[(16384 + a, 16384 + min(a + 2048, t)) for a in range(0, t, 2048)] for t in range(64, 8193, 64)]
    close = []
    for chunks in plans:
        est = estimate(GPU, chunks, 64, 2048, zipf)
        streamed = min(v for p, v in est.items() if p != "demand")
        if streamed < est["demand"] < 1.05 * streamed:
            close.append(chunks)
    assert close, "no plan near the crossover"
    fewer, as_expected = Calibration(), Calibration()
    for _ in range(4):
        fewer.observe(1000, 800)
        as_expected.observe(1000, 1000)
    for chunks in close:
        assert choose(GPU, chunks, 64, 2048, zipf)[0] != "demand"
        path, reason, est, cal = choose(GPU, chunks, 64, 2048, zipf, calibration=fewer)
        assert path == "demand" and "x0.800" in reason and cal["demand"] < est["demand"]
    for chunks in plans:
        assert (choose(GPU, chunks, 64, 2048, zipf, calibration=as_expected)[0]
                == choose(GPU, chunks, 64, 2048, zipf)[0])


def test_the_engine_calibrates_from_every_demand_prefill_and_reports_it():
    auto = _engine(prefill_mode="auto", router_skew=2.0)
    vocab = auto.model_config.vocab_size
    for mode, seed in (("demand", 1), ("chunked", 2), ("demand", 3), ("layer-major", 4), ("demand", 5)):
        assert auto.run(_ids(200, seed, vocab), 1, prefill_mode=mode)[1].prefill_path == mode
    info = auto.run(_ids(40, 6, vocab), 1)[1].auto
    assert info["calibration"]["demand_prefills"] == 3  # the demand prefills only
    f = info["calibration"]["demand_copies_factor"]
    assert f == pytest.approx(auto.calibration.factor, abs=1e-4) and f != 1.0
    assert info["calibrated_s"]["chunked"] == info["estimates_s"]["chunked"]  # only demand's copy term moves
    assert (info["calibrated_s"]["demand"] < info["estimates_s"]["demand"]) == (f < 1.0)
    # an engine started with auto_calibration=0 reports none: test_auto_gives_bitwise_the_path_it_picked_and_says_why
    with pytest.raises(ValueError, match="auto_calibration"):
        EngineConfig(auto_calibration=-1)


def test_auto_gives_bitwise_the_path_it_picked_and_says_why(chunked: Engine):
    auto = _engine(prefill_mode="auto", router_skew=2.0, auto_calibration=0)  # the model's own choices
    vocab = auto.model_config.vocab_size
    prefix = _ids(256, 1, vocab)
    seen = set()
    for n, seed in ((8, 2), (64, 3), (300, 4)):
        prompt = prefix + _ids(n, seed, vocab)
        auto.reset()
        auto.run(prefix, 1)
        events, stats = auto.run(prompt, 3, logprobs=2)
        assert stats.auto["path"] == stats.prefill_path or stats.fallback_reason
        assert stats.auto["reason"].startswith("auto: ") and stats.auto["routing"] == "observed"
        assert "calibration" not in stats.auto  # auto_calibration=0
        assert set(stats.auto["estimates_s"]) >= {"chunked", "demand"}
        seen.add(stats.auto["path"])
        auto.reset()
        auto.run(prefix, 1, prefill_mode=stats.auto["path"])
        ref, _ = auto.run(prompt, 3, logprobs=2, prefill_mode=stats.auto["path"])
        assert [(e.token_id, e.top_logprobs) for e in events] == [(e.token_id, e.top_logprobs) for e in ref]
    assert "layer-major" in seen or "chunked" in seen  # 300 uncached tokens stream
    with pytest.raises(ValueError, match="started with prefill_mode='auto'"):
        chunked.run(prefix, 1, prefill_mode="auto")
    fixed = _engine(prefill_mode="auto", auto_demand_max_tokens=32)
    assert fixed.run(prefix[:20], 1)[1].prefill_path == "demand"
    assert fixed.run(prefix[:200], 1)[1].prefill_path == "layer-major"


def test_the_sweep_brackets_a_crossover_by_the_sign_of_the_log_ratio():
    from abbench.engine.tools.gpucheck_policy import crossover

    lengths = [64, 128, 256, 512]
    lo, hi, x = crossover(lengths, [1.0, 2.0, 4.0, 8.0], [2.0, 2.0, 2.0, 2.0])  # equal at 128: not faster there
    assert (lo, hi) == (64, 128) and x == pytest.approx(128)
    lo, hi, x = crossover(lengths, [1.0, 1.0, 3.0, 9.0], [2.0, 2.0, 2.0, 2.0])
    assert (lo, hi) == (128, 256) and 128 < x < 256
    assert crossover(lengths, [1.0] * 4, [2.0] * 4) is None


def test_gpucheck_policy_runs_on_cpu_and_every_mode_agrees(capsys):
    from abbench.engine.tools.gpucheck_policy import main

    main(["--device", "cpu", "--suffixes", "8,128", "--skews", "0", "--repeats", "1", "--prefix", "64"])
    out = capsys.readouterr().out
    assert "modes bitwise equal: True" in out  # timings on a shared CPU are not asserted
    assert "demand vs the faster streamed path:" in out
