"""FP8 expert banks (``--expert-dtype fp8``): the host bank holds float8 e4m3 values with one float32 scale per
output row, copies move those bytes (scales included) and are dequantized on the device, which computes in its
own dtype.

What an engine developer validating the quantized path relies on: the quantization's error bound; exact byte
accounting; every prefill mode and the decode slot cache's miss path bitwise equal among themselves within FP8;
the FP8 engine bitwise equal to the same engine whose bank holds the dequantized values (so the device computes
with exactly the rounded weights, nothing else changes); a checkpoint quantized at load as random weights are;
the memory plan and the configuration's refusals. Small shapes on CPU; ABBENCH_ENGINE_TEST_DEVICE=cuda runs
the same assertions on a GPU (bfloat16 there)."""

from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

from abbench.engine import EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.models.bank import FP8, FP8_MAX, ExpertBank, dequantize, quantize_rows  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.runtime.memory import fp8_staging_bytes, plan_device_memory  # noqa: E402

MINI = ModelConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2,
                   max_position_embeddings=4096, eos_token_id=None, name="mini")
MODES = ("chunked", "layer-major", "demand", "resident")
DEVICE = os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu")
KNOBS = dict(chunk_tokens=32, layer_major_window_tokens=64, demand_max_tokens=32, max_context=512,
             bandwidth_probe_bytes=0, device=DEVICE)


def _engine(model=MINI, **overrides) -> Engine:
    return Engine(EngineConfig(**{"model": model, "weights": "random:1", **KNOBS, **overrides}))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, MINI.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, ids: list[int], mode: str, max_tokens: int = 6):
    """(output ids, their top-5 logprobs, stats) of one request from an empty prefix cache."""
    engine.reset()
    events, stats = engine.run(ids, max_tokens=max_tokens, prefill_mode=mode, logprobs=5)
    return [e.token_id for e in events], [e.top_logprobs for e in events], stats


@pytest.fixture(scope="module")
def fp8():
    """Started resident (so it also runs every streamed mode per request) with an FP8 bank."""
    return _engine(prefill_mode="resident", expert_dtype="fp8")


@pytest.fixture(scope="module")
def fp8_slots():
    """FP8, streamed, the smallest legal slot cache: decode's misses are copied and dequantized constantly."""
    return _engine(expert_dtype="fp8", expert_slots_per_layer=MINI.num_experts_per_tok)


def test_quantize_rows_bounds_the_error_by_e4m3s_precision() -> None:
    w = torch.randn(5, 48, 40, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, 48)[None, :, None]
    w[1, 7] = 0.0  # an all-zero row: scale 1, values exactly zero
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == w.shape[:2]
    amax = w.abs().amax(-1)
    assert torch.equal(scale[amax > 0], amax[amax > 0] / FP8_MAX) and scale[1, 7] == 1
    back = dequantize(q, scale, torch.float32)
    assert torch.equal(back[1, 7], torch.zeros(40))
    # e4m3: 3 mantissa bits, so a normal value is within 2^-4 of itself; below 2^-6 (the smallest normal) the
    # spacing is 2^-9 of the scale
    bound = torch.maximum(w.abs() * 2**-4, scale[..., None] * 2**-10)
    assert bool(((back - w).abs() <= bound * 1.0001).all())
    # each row's largest value maps to 448 and back (to within float32's rounding of amax / 448 x 448)
    assert torch.allclose(back.abs().amax(-1)[amax > 0], amax[amax > 0], rtol=2**-22, atol=0)
    assert bool(((back - w).abs() > 0).any())  # and it is a quantization, not a copy


def test_the_bank_stores_fp8_and_scales_at_their_exact_size() -> None:
    bank = ExpertBank(MINI, torch.float32, pin=False, check_memory=False, fp8=True)
    e, i, h, n = MINI.num_experts, MINI.moe_intermediate_size, MINI.hidden_size, MINI.num_hidden_layers
    assert bank.expert_bytes == 3 * h * i + 4 * (2 * i + h)
    assert bank.bank_bytes == n * e * bank.expert_bytes
    stored = sum(t.numel() * t.element_size() for t in bank.gate_up + bank.down + bank.gate_up_scale + bank.down_scale)
    assert stored == bank.bank_bytes and bank.gate_up[0].dtype == FP8 and bank.format.startswith("fp8-e4m3")
    plain = ExpertBank(MINI, torch.bfloat16, pin=False, check_memory=False)
    assert plain.expert_bytes == 3 * h * i * 2 and plain.format == "bfloat16"
    assert bank.device_expert_bytes == 3 * h * i * 4  # on the device it is the compute dtype's again


@pytest.mark.parametrize("n", [1, 33, 150])
def test_every_prefill_mode_gives_the_same_ids_and_logprobs_within_fp8(fp8, n) -> None:
    ids = _prompt(n, seed=n)
    ref = _run(fp8, ids, "chunked")
    for mode in MODES[1:]:
        got = _run(fp8, ids, mode)
        assert got[0] == ref[0] and got[1] == ref[1], mode


def test_where_the_dequantization_runs_changes_no_bit_nor_byte(fp8, fp8_slots) -> None:
    """``EngineConfig.fp8_dequant``: a streamed layer dequantized on the compute stream at its turn (the default:
    its copy fills the stage only) or on the copy stream right after its copy gives the same ids, logprobs and
    bytes in every streamed mode, and a primed first layer (staged, dequantized when taken) changes nothing."""
    copy = _engine(prefill_mode="resident", expert_dtype="fp8", fp8_dequant="copy")
    assert fp8.store.dequant_on_compute and not copy.store.dequant_on_compute
    ids = _prompt(150, seed=4)
    for mode in ("chunked", "layer-major", "demand"):
        a, b = _run(fp8, ids, mode), _run(copy, ids, mode)
        assert (a[0], a[1], a[2].prefill_h2d_bytes) == (b[0], b[1], b[2].prefill_h2d_bytes), mode
    ref = _run(fp8_slots, ids, "layer-major")
    assert fp8_slots.store.prime(0)
    got = _run(fp8_slots, ids, "layer-major")
    assert got[2].first_layer_primed and not ref[2].first_layer_primed
    assert (got[0], got[1], got[2].prefill_h2d_bytes) == (ref[0], ref[1], ref[2].prefill_h2d_bytes)
    with pytest.raises(ValueError, match="fp8_dequant"):
        EngineConfig(model=MINI, fp8_dequant="host").resolved()


@pytest.fixture(scope="module")
def fp8_gemm():
    """FP8 multiplied in the grouped GEMM (``fp8_dequant`` "gemm"), started resident: every mode per request."""
    return _engine(prefill_mode="resident", expert_dtype="fp8", fp8_dequant="gemm")


def _modes_equal_moving_the_defaults_bytes(engine: Engine, default: Engine, ids: list[int]):
    """Every prefill mode of ``engine`` gives chunked's ids and logprobs, each streamed mode moving the bytes
    ``default`` moves in it (150 tokens: five chunks, three layer-major windows); returns (chunked's run,
    ``default``'s layer-major run)."""
    ref = _run(engine, ids, "chunked")
    for mode in MODES[1:]:
        got = _run(engine, ids, mode)
        assert got[:2] == ref[:2], mode
        if mode != "resident":
            assert got[2].prefill_h2d_bytes == _run(default, ids, mode)[2].prefill_h2d_bytes, mode
    return ref, _run(default, ids, "layer-major")


def test_fp8_in_the_gemm_keeps_the_banks_values_on_the_device_and_the_modes_equal(fp8, fp8_gemm) -> None:
    """``fp8_dequant`` "gemm": the resident experts and both prefill buffers hold the bank's float8 values and row
    scales as they are (nothing dequantized into them, no stage), the copies move the same bytes, and every
    prefill mode gives the same ids and logprobs. Off CUDA the GEMM dequantizes a temporary, so it is bitwise the
    default engine; on CUDA it is Triton's kernel (another summation order): its logprobs stay close."""
    from abbench.engine.ops.moe import Fp8Experts

    store, bank = fp8_gemm.store, fp8_gemm.store.bank
    assert store.stage is None and not store.dequant_on_compute
    for gu, dn in [*store.resident, *zip(store.buf_gate_up, store.buf_down)]:
        assert isinstance(gu, Fp8Experts) and isinstance(dn, Fp8Experts) and gu.values.dtype == FP8
    for layer in range(MINI.num_hidden_layers):
        gu, dn = store.resident[layer]
        assert torch.equal(gu.values.cpu().view(torch.uint8), bank.gate_up[layer].view(torch.uint8))
        assert torch.equal(dn.scales.cpu(), bank.down_scale[layer])
    ref, default = _modes_equal_moving_the_defaults_bytes(fp8_gemm, fp8, _prompt(150, seed=11))
    if DEVICE == "cpu":
        assert default[:2] == ref[:2]
    else:
        first, want = dict(ref[1][0]), dict(default[1][0])  # the first token's top-5: (id, logprob) pairs
        assert first.keys() & want.keys() and max(abs(first[t] - want[t]) for t in first.keys() & want.keys()) < 0.1


@pytest.mark.parametrize("way", ["gemm", "w8a8"])
def test_fp8_in_the_gemm_decodes_from_fp8_slots_as_from_its_resident_experts(way) -> None:
    """A streamed engine multiplying FP8 in the GEMM (weight-only, or W8A8), its decode slots as small as legal
    (misses all the time): the same ids and logprobs as the resident one, prefill and decode (weight-only in
    both, from the slots or from the resident experts), and a primed first layer (its FP8 values copied as they
    are) changes nothing."""
    resident = _engine(prefill_mode="resident", expert_dtype="fp8", fp8_dequant=way)
    streamed = _engine(expert_dtype="fp8", fp8_dequant=way, expert_slots_per_layer=MINI.num_experts_per_tok)
    ids = _prompt(70, seed=12)
    want = _run(resident, ids, "resident", max_tokens=12)
    for mode in ("layer-major", "chunked", "demand"):
        got = _run(streamed, ids, mode, max_tokens=12)
        assert got[:2] == want[:2], mode
        assert got[2].slot_misses > 0
    assert streamed.store.prime(0)
    got = _run(streamed, ids, "layer-major", max_tokens=12)
    assert got[2].first_layer_primed and got[:2] == want[:2]


def test_w8a8_quantizes_the_activations_too_and_keeps_the_modes_equal(fp8) -> None:
    """``fp8_dequant`` "w8a8": the same FP8 buffers and resident experts, the GEMM's activations quantized per row
    and multiplied FP8 by FP8. Every prefill mode gives the same ids and logprobs, and the same bytes as the
    default; the numbers move by the activations' rounding only, so the first token's logprobs stay near the
    default's, and differ from them."""
    w8a8 = _engine(prefill_mode="resident", expert_dtype="fp8", fp8_dequant="w8a8")
    assert {gu.math for gu, _ in w8a8.store.resident} == {"fp8"} and w8a8.store.buf_down[1].math == "fp8"
    ref, default = _modes_equal_moving_the_defaults_bytes(w8a8, fp8, _prompt(150, seed=13))
    first, want = dict(ref[1][0]), dict(default[1][0])
    common = first.keys() & want.keys()
    assert common and max(abs(first[t] - want[t]) for t in common) < 0.2 and ref[1] != default[1]


def test_fp8_in_the_gemm_is_refused_where_there_is_no_fp8_bank_with_row_scales(fp8_checkpoint) -> None:
    for way in ("gemm", "w8a8"):
        with pytest.raises(ValueError, match="needs expert_dtype 'fp8'"):
            EngineConfig(model=MINI, fp8_dequant=way)
    with pytest.raises(ValueError, match="block scales"):
        _ckpt_engine(fp8_checkpoint[0], expert_dtype="fp8", fp8_dequant="gemm")


def test_copies_move_the_fp8_bytes_scales_included(fp8) -> None:
    bank = fp8.store.bank
    n = 150  # five 32-token chunks, three 64-token layer-major windows
    _, _, chunked = _run(fp8, _prompt(n, 9), "chunked", max_tokens=1)
    assert chunked.n_chunks == 5 and chunked.prefill_h2d_bytes == 5 * bank.bank_bytes
    _, _, lm = _run(fp8, _prompt(n, 9), "layer-major", max_tokens=1)
    assert lm.n_windows == 3 and lm.prefill_h2d_bytes == 3 * bank.bank_bytes
    plain = ExpertBank(MINI, bank.compute_dtype, pin=False, check_memory=False)
    assert bank.bank_bytes - plain.bank_bytes * bank.dtype.itemsize / plain.dtype.itemsize == \
        MINI.num_hidden_layers * MINI.num_experts * bank.scale_bytes  # the values' bytes in FP8, plus the scales


def _run_misses(engine: Engine, ids: list[int], misses: str | None, max_tokens: int = 12):
    engine.reset()
    events, stats = engine.run(ids, max_tokens=max_tokens, prefill_mode="layer-major", logprobs=5,
                               decode_misses=misses)
    return [e.token_id for e in events], [e.top_logprobs for e in events], stats


def test_decode_misses_dequantize_into_the_slots_bitwise_as_resident_experts(fp8, fp8_slots) -> None:
    """Every way decode's misses can be handled (the host's copy and dequantization; on CUDA with Triton also the
    experts' kernels reading the FP8 bank over PCIe and dequantizing as they go, the default there) leaves the
    same values in the slots as the resident experts hold: the same bits."""
    ids = _prompt(70, seed=4)
    want = _run(fp8, ids, "resident", max_tokens=12)
    device_side = fp8_slots.decoder.table is not None  # CUDA with Triton's experts: the default is "device"
    assert fp8_slots.decoder.misses == ("device" if device_side else "host")
    for misses in ("host", "device") if device_side else ("host",):
        got = _run_misses(fp8_slots, ids, misses)
        assert got[0] == want[0] and got[1] == want[1], misses
        d = got[2]
        assert d.slot_misses > 0 and d.decode_h2d_bytes == d.slot_misses * fp8_slots.store.bank.expert_bytes, misses


def _rounded_through_fp8(engine: Engine) -> Engine:
    """``engine`` (resident, a compute-dtype bank) with every expert's values rounded through FP8 in place."""
    bank = engine.store.bank
    for layer in range(engine.model_config.num_hidden_layers):
        for t in (bank.gate_up[layer], bank.down[layer]):
            t.copy_(dequantize(*quantize_rows(t), t.dtype))
    if engine.store.cuda:  # the resident copies were taken at start: overwrite them in place (the CUDA graphs
        # captured at start read these very tensors; new tensors would leave the graphs on the unrounded weights)
        for (g, d), gb, db in zip(engine.store.resident, bank.gate_up, bank.down):
            g.copy_(gb)
            d.copy_(db)
    return engine


def test_the_fp8_engine_computes_with_exactly_the_dequantized_weights(fp8) -> None:
    """The same model with a compute-dtype bank whose values were rounded through FP8 beforehand: bitwise the same
    outputs, so dequantizing on the device changes nothing but the bytes that cross."""
    ref = _rounded_through_fp8(_engine(prefill_mode="resident"))
    ids = _prompt(90, seed=5)
    for mode in ("resident", "layer-major"):
        assert _run(ref, ids, mode, max_tokens=8)[:2] == _run(fp8, ids, mode, max_tokens=8)[:2], mode
    unrounded = _engine(prefill_mode="resident")
    assert _run(unrounded, ids, "resident", max_tokens=8)[1] != _run(fp8, ids, "resident", max_tokens=8)[1]


def test_the_hybrids_fp8_engine_computes_with_exactly_the_dequantized_weights() -> None:
    """The hybrid (DeltaNet and full-attention layers, a shared expert) likewise: its FP8 engine, streamed or
    resident, is bitwise the bf16 engine over the FP8-rounded values. So where a full-scale run finds the FP8 arm's
    top tokens far from bf16's (random weights give a nearly flat distribution), the rounding moved the model,
    not the machinery."""
    from tests.engine.test_engine_hybrid import MINI as HYBRID

    knobs = dict(chunk_tokens=64, layer_major_window_tokens=128, demand_max_tokens=64, max_context=1024)
    ref = _rounded_through_fp8(_engine(HYBRID, prefill_mode="resident", **knobs))
    fp8 = _engine(HYBRID, prefill_mode="resident", expert_dtype="fp8", **knobs)
    ids = _prompt(130, seed=6)  # three chunks, two layer-major windows
    for mode in ("resident", "layer-major"):
        assert _run(ref, ids, mode, max_tokens=4)[:2] == _run(fp8, ids, mode, max_tokens=4)[:2], mode
    unrounded = _engine(HYBRID, prefill_mode="resident", **knobs)
    assert _run(unrounded, ids, "resident", max_tokens=4)[1] != _run(fp8, ids, "resident", max_tokens=4)[1]


@pytest.mark.parametrize("way", ["compute", "gemm", "w8a8"])
def test_a_hybrid_model_streams_fp8_experts_with_the_modes_equal(way) -> None:
    """The hybrid's FP8 experts, dequantized by a pass, read by the grouped GEMM (weight-only) or multiplied in a
    W8A8 GEMM: every mode the same bits."""
    from tests.engine.test_engine_hybrid import MINI as HYBRID

    engine = _engine(HYBRID, prefill_mode="resident", expert_dtype="fp8", fp8_dequant=way, chunk_tokens=64,
                     layer_major_window_tokens=128, demand_max_tokens=64, max_context=1024)
    ids = _prompt(130, seed=6)  # three chunks, two layer-major windows
    ref = _run(engine, ids, "chunked", max_tokens=3)
    for mode in MODES[1:]:
        assert _run(engine, ids, mode, max_tokens=3)[:2] == ref[:2], mode


def _hf_checkpoint(path, seed: int):
    """A tiny Qwen3-MoE checkpoint written by transformers into ``path`` (experts per expert, as on the hub)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                      max_position_embeddings=512, decoder_sparse_step=1, norm_topk_prob=True)
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def test_a_checkpoint_is_quantized_at_load_as_its_values_are(tmp_path) -> None:
    _hf_checkpoint(tmp_path, seed=0)
    knobs = dict(weights=str(tmp_path), model=None, max_context=256, bandwidth_probe_bytes=0, device="cpu")
    plain = Engine(EngineConfig(**knobs)).store.bank
    fp8 = Engine(EngineConfig(**knobs, expert_dtype="fp8")).store.bank
    for layer in range(2):
        for t, q, s in ((plain.gate_up[layer], fp8.gate_up[layer], fp8.gate_up_scale[layer]),
                        (plain.down[layer], fp8.down[layer], fp8.down_scale[layer])):
            want_q, want_s = quantize_rows(t)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def test_the_memory_plan_counts_the_staging_area() -> None:
    from abbench.engine import PRESETS

    cfg = dict(model=PRESETS["qwen3-30b-a3b"], device="cuda", dtype="bfloat16", max_context=32768, max_num_seqs=1,
               prefill_mode="layer-major")
    plain = plan_device_memory(EngineConfig(**cfg).resolved(), 16 * 2**30)
    fp8 = plan_device_memory(EngineConfig(**cfg, expert_dtype="fp8", slot_dtype="model").resolved(), 16 * 2**30)
    mc = PRESETS["qwen3-30b-a3b"]
    e, i, h = mc.num_experts, mc.moe_intermediate_size, mc.hidden_size
    assert fp8.staging_bytes == fp8_staging_bytes(mc) > e * 3 * h * i and plain.staging_bytes == 0
    assert fp8.fixed_bytes == plain.fixed_bytes + fp8.staging_bytes
    assert fp8.slots_per_layer < plain.slots_per_layer and "FP8 staging" in fp8.describe()
    assert fp8.total_bytes <= 16 * 2**30
    # on CUDA an FP8 bank's slots hold its float8 values and row scales by default: about half a slot's bytes
    slots8 = plan_device_memory(EngineConfig(**cfg, expert_dtype="fp8").resolved(), 16 * 2**30)
    assert slots8.slot_dtype == "fp8" and "(FP8)" in slots8.describe() and slots8.fixed_bytes == fp8.fixed_bytes
    assert slots8.slot_bytes == mc.num_hidden_layers * (3 * h * i + 4 * (2 * i + h))
    assert slots8.slots_per_layer >= 2 * fp8.slots_per_layer - 1 and slots8.total_bytes <= 16 * 2**30
    cpu = EngineConfig(**{**cfg, "device": "cpu"}, expert_dtype="fp8").resolved()  # CPU: torch's experts
    assert plan_device_memory(cpu, 16 * 2**30).slot_dtype == "bfloat16"
    # multiplied in the GEMM: the buffers hold FP8 values and row scales, nothing is staged
    gemm = plan_device_memory(EngineConfig(**cfg, expert_dtype="fp8", fp8_dequant="gemm").resolved(), 16 * 2**30)
    assert gemm.staging_bytes == 0 and gemm.prefill_buffer_bytes == 2 * e * (3 * h * i + 4 * (2 * i + h))
    assert gemm.slots_per_layer > slots8.slots_per_layer and gemm.total_bytes <= 16 * 2**30
    resident = dict(cfg, prefill_mode="resident", expert_dtype="fp8")
    assert (plan_device_memory(EngineConfig(**resident, fp8_dequant="gemm").resolved(), 80 * 2**30).resident_bytes
            == mc.num_hidden_layers * e * (3 * h * i + 4 * (2 * i + h)))


def test_fp8_slots_are_refused_where_nothing_reads_them() -> None:
    from abbench.engine.runtime.memory import fp8_slots

    with pytest.raises(ValueError, match="needs expert_dtype 'fp8'"):
        EngineConfig(model=MINI, slot_dtype="fp8")
    with pytest.raises(ValueError, match="slot_dtype must be one of"):
        EngineConfig(model=MINI, slot_dtype="fp4")
    cfg = EngineConfig(model=MINI, expert_dtype="fp8", slot_dtype="fp8", decode_experts="grouped").resolved()
    with pytest.raises(ValueError, match="decoded by Triton's experts"):
        fp8_slots(cfg)
    cfg = dataclasses.replace(cfg, decode_experts="triton")
    assert fp8_slots(cfg, triton=True)
    with pytest.raises(ValueError, match="block"):
        fp8_slots(cfg, block=(128, 128), triton=True)
    assert not fp8_slots(dataclasses.replace(cfg, slot_dtype="auto"), block=(128, 128), triton=True)


def test_fp8_slots_take_the_banks_bytes_and_scales_as_they_are() -> None:
    """FP8 slots (``slot_dtype`` "fp8"; decode's Triton experts read them): the host's lookup copies a miss's
    float8 values and row scales into its slot as they are, counted as the bank's bytes; a prefill copy from such
    a slot (``d2d_from_slot_cache``) is dequantized as a copy from the bank is."""
    from abbench.engine.models.bank import ExpertBank, dequantize_into
    from abbench.engine.runtime.experts import ExpertStore

    bank = ExpertBank(MINI, torch.float32, pin=False, fp8=True)
    gen = torch.Generator().manual_seed(5)
    e, i, h = MINI.num_experts, MINI.moe_intermediate_size, MINI.hidden_size
    for layer in range(MINI.num_hidden_layers):
        bank.put_layer(layer, torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen))
    store = ExpertStore(bank, torch.device("cpu"), 3, resident=False, d2d_from_slot_cache=True, fp8_slots=True)
    slots = store.slots
    assert slots.fp8 and slots.gate_up[1].dtype == torch.float8_e4m3fn
    assert store.decode_weights(1)[2] == (slots.gate_up_scale[1], slots.down_scale[1])
    got = store.decode_experts(1, [7, 2])
    for expert, s in zip([7, 2], got):
        assert torch.equal(slots.gate_up[1][s].view(torch.uint8), bank.gate_up[1][expert].view(torch.uint8))
        assert torch.equal(slots.down[1][s].view(torch.uint8), bank.down[1][expert].view(torch.uint8))
        assert torch.equal(slots.gate_up_scale[1][s], bank.gate_up_scale[1][expert])
        assert torch.equal(slots.down_scale[1][s], bank.down_scale[1][expert])
    assert store.lifetime.h2d_bytes == 2 * bank.expert_bytes and store.lifetime.expert_copies == 2
    gate_up, down = store.load_experts(1, [2, 7, 9])  # 2 and 7 from the slots, 9 from the bank
    assert store.lifetime.d2d_bytes == 2 * bank.expert_bytes and store.lifetime.h2d_bytes == 3 * bank.expert_bytes
    for expert in (2, 7, 9):
        want_gu, want_dn = torch.empty(1, 2 * i, h), torch.empty(1, h, i)
        dequantize_into(want_gu, bank.gate_up[1][expert:expert + 1], bank.gate_up_scale[1][expert:expert + 1])
        dequantize_into(want_dn, bank.down[1][expert:expert + 1], bank.down_scale[1][expert:expert + 1])
        assert torch.equal(gate_up[expert:expert + 1], want_gu) and torch.equal(down[expert:expert + 1], want_dn)
    with pytest.raises(ValueError, match="not one"):
        ExpertStore(ExpertBank(MINI, torch.float32, pin=False), torch.device("cpu"), 3, False, False, fp8_slots=True)


def test_the_configuration_refuses_what_fp8_cannot_do() -> None:
    with pytest.raises(ValueError, match="expert_dtype must be one of"):
        EngineConfig(model=MINI, expert_dtype="fp4")


def test_the_server_flag_and_what_the_engine_reports() -> None:
    from abbench.engine.serve import launch

    args = launch.build_arg_parser().parse_args(["--expert-dtype", "fp8", "--device", "cpu"])
    assert launch._engine_config(args).expert_dtype == "fp8"
    with pytest.raises(SystemExit):
        launch.build_arg_parser().parse_args(["--expert-dtype", "int4"])
    assert _engine(expert_dtype="fp8").info.expert_format == "fp8-e4m3 (per-row scales)"


# -- FP8 checkpoints (quantization_config: block-wise float8 e4m3 with weight_scale_inv) ------------------------

BLOCK = (32, 48)  # a partial last block along the columns (64 = 48 + 16, 32 < 48)


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As FP8 checkpoints are made: one scale per block (its largest magnitude / 448), the values divided by it."""
    br, bc = block
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    w32 = w.to(torch.float32)
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=FP8)
    for a in range(nr):
        for b in range(nc):
            blk = w32[a * br:(a + 1) * br, b * bc:(b + 1) * bc]
            s = max(float(blk.abs().max()) / FP8_MAX, 1e-12)
            scale[a, b] = s
            q[a * br:(a + 1) * br, b * bc:(b + 1) * bc] = (blk / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint written by transformers, then quantized as Qwen's -FP8 checkpoints are (every
    linear layer but the router and lm_head), and the same weights dequantized, unquantized: (fp8 dir, plain dir,
    {key: (q, scale)})."""
    import json

    from safetensors.torch import load_file, save_file

    src = _hf_checkpoint(tmp_path_factory.mktemp("src"), seed=1)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    fp8_dir, plain_dir = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("plain")
    quantized, plain, stored = {}, {}, {}
    for key, t in tensors.items():
        if t.dim() == 2 and key.endswith("proj.weight"):
            q, scale = _quantize_blocks(t, BLOCK)
            quantized[key], quantized[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
            plain[key] = (q.to(torch.float32).reshape(-1)
                          * scale.repeat_interleave(BLOCK[0], 0)[:t.shape[0]]
                          .repeat_interleave(BLOCK[1], 1)[:, :t.shape[1]].reshape(-1)).reshape(t.shape)
            stored[key] = (q, scale)
        else:
            quantized[key], plain[key] = t, t
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(plain, str(plain_dir / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    (plain_dir / "config.json").write_text(json.dumps(raw))
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(raw))
    return fp8_dir, plain_dir, stored


def _ckpt_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(weights=str(path), model=None, max_context=256, bandwidth_probe_bytes=0,
                               device="cpu", chunk_tokens=32, layer_major_window_tokens=64, **kw))


def test_an_fp8_checkpoint_keeps_its_values_and_block_scales_in_an_fp8_bank(fp8_checkpoint) -> None:
    fp8_dir, _, stored = fp8_checkpoint
    bank = _ckpt_engine(fp8_dir, expert_dtype="fp8").store.bank
    assert bank.block == BLOCK and bank.format == "fp8-e4m3 (32x48-block scales)"
    assert bank.gate_up_scale[0].shape == (8, 2, 2) and bank.down_scale[0].shape == (8, 2, 1)
    assert bank.expert_bytes == 3 * 64 * 32 + 4 * (2 * 2 + 2 * 1)
    for layer in range(2):
        for x in range(8):
            p = f"model.layers.{layer}.mlp.experts.{x}."
            (gq, gs), (uq, us), (dq, ds) = (stored[p + n + "_proj.weight"] for n in ("gate", "up", "down"))
            u8 = lambda t: t.view(torch.uint8)  # noqa: E731
            assert torch.equal(u8(bank.gate_up[layer][x]), u8(torch.cat([gq, uq])))
            assert torch.equal(u8(bank.down[layer][x]), u8(dq))
            assert torch.equal(bank.gate_up_scale[layer][x], torch.cat([gs, us])) and torch.equal(
                bank.down_scale[layer][x], ds)


def test_an_fp8_checkpoint_serves_as_its_dequantized_weights_do(fp8_checkpoint) -> None:
    """The FP8 checkpoint with its bank kept in FP8, or dequantized at load, and the same weights written
    dequantized in float32: bitwise the same outputs in every mode (every weight, dense ones included, is read
    through its block scales)."""
    fp8_dir, plain_dir, _ = fp8_checkpoint
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    want = _run(_ckpt_engine(plain_dir, prefill_mode="resident"), ids, "resident", max_tokens=6)
    for expert_dtype in ("fp8", "model"):
        engine = _ckpt_engine(fp8_dir, prefill_mode="resident", expert_dtype=expert_dtype)
        for mode in ("resident", "layer-major", "chunked"):
            assert _run(engine, ids, mode, max_tokens=6)[:2] == want[:2], (expert_dtype, mode)


def test_device_side_misses_are_refused_for_block_scales(fp8_checkpoint) -> None:
    """The experts' kernels dequantize misses with per-row scales; a bank that keeps an FP8 checkpoint's block
    scales has its misses copied by the host, and asking for the device's way says so."""
    with pytest.raises(ValueError, match="block scales has its misses copied and dequantized by the host"):
        _ckpt_engine(fp8_checkpoint[0], expert_dtype="fp8", expert_slots_per_layer=4, decode_misses="device")


@pytest.mark.skipif(DEVICE == "cpu", reason="the dequantization kernel is Triton's (CUDA)")
@pytest.mark.parametrize("block", [None, (128, 128), BLOCK])
def test_the_fused_dequantization_kernel_gives_the_torch_compositions_bits(block) -> None:
    from abbench.engine.models.bank import dequantize_into
    from abbench.engine.ops import kernels

    if not kernels.have_triton():
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(7)
    for shape in ((5, 96, 200), (3, 384, 64), (1, 1536, 2048)):
        w = (torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[1])[None, :, None]).to(DEVICE)
        if block is None:
            q, scale = quantize_rows(w)
        else:
            br, bc = block
            nr, nc = -(-shape[1] // br), -(-shape[2] // bc)
            scale = torch.rand(shape[0], nr, nc, generator=g).add_(0.01).to(DEVICE)
            q = (torch.randn(shape, generator=g) * 100).clamp_(-FP8_MAX, FP8_MAX).to(FP8).to(DEVICE)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want = dequantize_into(torch.empty(shape, dtype=dtype, device=DEVICE), q, scale, block)
            for programs in (None, 1, 7):  # the full grid, or few programs looping over the rows
                got = kernels.dequantize_fp8(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE), q, scale,
                                             block, programs=programs)
                assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got.view(torch.int32),
                                   want.view(torch.uint8) if dtype != torch.float32 else want.view(torch.int32)), \
                    (shape, dtype, programs)


def test_the_fp8_gpucheck_runs_on_cpu(capsys) -> None:
    """``tools.gpucheck_fp8`` (the copies, the dequantizations alone and beside the grouped GEMM) end to end at the
    tiny preset on CPU: every dequantization it times agrees with the reference, and it says so."""
    from abbench.engine.tools.gpucheck_fp8 import main

    assert main(["--device", "cpu", "--repeats", "1", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "torch composition" in out and "H2D fp8 layer + row scales" in out and "DISAGREES" not in out


def test_the_fp8_gpucheck_profiles_a_whole_prefill_on_three_engines(tmp_path) -> None:
    """``gpucheck_fp8 --prefill-tokens N``: one N-token prefill on resident, model-dtype-bank and FP8-bank
    engines, each the path asked for, the FP8 bank moving the bytes of its values and scales (a quarter of the
    float32 bank's, plus scales, at the tiny preset on CPU); the device's breakdown is None on CPU."""
    import json

    from abbench.engine import PRESETS
    from abbench.engine.tools.gpucheck_fp8 import main

    assert main(["--device", "cpu", "--tokens", "64", "--prefill-tokens", "150", "--out",
                 str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["engine"], r["path"]) for r in rows] == [
        ("resident", "resident"), ("layer-major, model-dtype bank", "layer-major"),
        ("layer-major, fp8 bank", "layer-major")]
    mc = PRESETS["tiny"]
    f32, fp8 = (ExpertBank(mc, torch.float32, pin=False, fp8=q).bank_bytes for q in (False, True))
    assert [r["prefill_h2d_bytes"] for r in rows] == [0, f32, fp8]  # one window: each bank streamed once
    assert all(r["prefill_s"] > 0 and r["first_prefill_s"] > 0 and r["compute_busy_s"] is None for r in rows)
    assert [r["windows"] for r in rows] == [0, 1, 1]
    # as a service has it: the streaming engines under a budget with longer caches, the same one window each
    assert main(["--device", "cpu", "--tokens", "64", "--prefill-tokens", "150", "--budget", "3", "--max-context",
                 "400", "--out", str(tmp_path / "b.json")]) == 0
    got = json.loads((tmp_path / "b.json").read_text())
    assert (got["budget_gib"], got["max_context"]) == (3.0, 400)
    assert [(r["path"], r["windows"], r["prefill_h2d_bytes"]) for r in got["rows"]] == [
        ("resident", 0, 0), ("layer-major", 1, f32), ("layer-major", 1, fp8)]
    # the engines asked for, in the order asked (a process's later engines run after the earlier ones)
    assert main(["--device", "cpu", "--tokens", "64", "--prefill-tokens", "150", "--engines",
                 "fp8,resident:eager,fp8:copy-dequant,resident:beside-copies,resident:beside-host,"
                 "resident-fp8:gemm,resident:moe-graphs,resident:beside-d2h", "--timed", "1", "--out",
                 str(tmp_path / "o.json")]) == 0
    got = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert [(r["engine"], r["prefill_h2d_bytes"], r["prefill_graphs"]) for r in got] == [
        ("layer-major, fp8 bank", fp8, "eager"), ("resident, no prefill graphs", 0, "eager"),  # no graphs on CPU
        ("layer-major, fp8 bank, dequantized on the copy stream", fp8, "eager"),
        ("resident, beside a bank's copies", 0, "eager"),  # the engine moves nothing; the copies beside it do
        ("resident, beside host-memory traffic", 0, "eager"), ("resident, fp8 bank, FP8 in the GEMM", 0, "eager"),
        ("resident, MoE halves from CUDA graphs", 0, "eager"),  # (on CUDA "cuda-graphs")
        ("resident, beside a bank's copies to the host", 0, "eager")]
    assert got[3]["beside_bytes"] == got[7]["beside_bytes"] == f32  # a bank, either way
    assert all("beside_bytes" not in r for r in (*got[:3], *got[5:7]))
    assert got[4]["beside_bytes"] > 0  # the host copies ran while the prefills did
    assert all(r["timed_prefill_s"] > 0 for r in got)
    for bad in ("fp8,bf16", "fp8:fast"):
        with pytest.raises(SystemExit):
            main(["--device", "cpu", "--prefill-tokens", "150", "--engines", bad])


def test_a_quantization_the_engine_cannot_read_is_refused(tmp_path) -> None:
    import json

    from abbench.engine.models.weights import fp8_block_size

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        fp8_block_size(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert fp8_block_size(tmp_path) is None


def test_stream_gaps_splits_the_compute_streams_idle_time_between_a_late_host_and_a_queued_wait() -> None:
    """``gpucheck_fp8.stream_gaps`` on a hand-made trace: stream 7 (the most kernel time) runs k0 [0, 10),
    k1 [15, 25) and k2 [40, 50) us; k1's launch returned at 12 (2 of its 5 us gap the host's), k2's at 20 (queued:
    all 15 us of its gap on the device). Stream 9's copy and a 150 us synchronisation are not the compute
    stream's; the synchronisation is a slow host call."""
    from abbench.engine.tools.gpucheck_fp8 import stream_gaps

    def dev(name, ts, dur, stream, corr, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}

    def call(name, ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [dev("k0", 0, 10, 7, 1), dev("k1", 15, 10, 7, 2), dev("k2", 40, 10, 7, 3),
              dev("Memcpy HtoD", 0, 30, 9, 4, cat="gpu_memcpy"),
              call("cudaLaunchKernel", -5, 2, 1), call("cudaLaunchKernel", 9, 3, 2), call("cudaLaunchKernel", 18, 2, 3),
              call("cudaMemcpyAsync", -3, 1, 4), call("cudaStreamSynchronize", 50, 150, 5), {"ph": "i", "name": "x"}]
    got = stream_gaps(events)
    assert got["stream"] == 7 and got["gaps"] == 2
    assert abs(got["span_s"] - 50e-6) < 1e-12 and abs(got["busy_s"] - 30e-6) < 1e-12
    assert abs(got["host_late_s"] - 2e-6) < 1e-12 and abs(got["queued_s"] - 18e-6) < 1e-12
    assert [(round(g * 1e6), round(late * 1e6), name) for g, late, name, _ in got["top_gaps"]] == [(15, 0, "k2"),
                                                                                                  (5, 2, "k1")]
    assert got["slow_calls"] == {"cudaStreamSynchronize": (1, 150e-6)}
    # the host: 2 + 3 + 2 + 1 + 150 us in calls over [-5, 200), the rest between them; launches' median 2 us
    assert abs(got["host_calls_s"] - 158e-6) < 1e-12 and abs(got["host_between_s"] - 47e-6) < 1e-12
    assert got["launch_median_us"] == 2
    # k1's gap [10, 15) lies inside stream 9's copy [0, 30); k2's [25, 40) a third: queued beside / apart from it
    assert got["beside_copies"][0] == 1 and abs(got["beside_copies"][1] - 3e-6) < 1e-12
    assert got["apart_from_copies"][0] == 1 and abs(got["apart_from_copies"][1] - 15e-6) < 1e-12
    assert list(got["queued_by_launch"]) == ["cudaLaunchKernel"] and got["queued_by_launch"]["cudaLaunchKernel"][0] == 2


def test_stream_gaps_tells_gaps_beside_a_bank_copy_and_graph_launches_apart() -> None:
    """The queued time split by the link's state (copies over it on other streams, either way, merged where they
    overlap; a device-to-device copy does not count) and by what launched the next kernel."""
    from abbench.engine.tools.gpucheck_fp8 import stream_gaps

    def dev(name, ts, dur, stream, corr, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}

    def call(name, ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": corr}}

    kernels = [dev(f"k{i}", 20 * i, 10, 7, i) for i in range(5)]  # gaps [10, 20), [30, 40), [50, 60), [70, 80)
    launch = [call("cudaGraphLaunch" if i % 2 else "cudaLaunchKernel", -10 + i, i) for i in range(5)]
    link = [dev("Memcpy HtoD (Pinned -> Device)", 5, 20, 9, 10, "gpu_memcpy"),  # [5, 25) and [22, 36): [5, 36)
            dev("Memcpy HtoD (Pinned -> Device)", 22, 14, 8, 11, "gpu_memcpy"),
            dev("Memcpy DtoD (Device -> Device)", 50, 30, 9, 12, "gpu_memcpy")]
    got = stream_gaps(kernels + launch + link)
    assert got["gaps"] == 4 and abs(got["queued_s"] - 40e-6) < 1e-12
    assert got["beside_copies"] == (2, 20e-6) and got["apart_from_copies"] == (2, 20e-6)
    # a copy to the host (``:beside-d2h``) over [68, 82) loads the link beside the gap [70, 80) too
    got = stream_gaps(kernels + launch + link + [dev("Memcpy DtoH (Device -> Pinned)", 68, 14, 9, 13, "gpu_memcpy")])
    assert got["beside_copies"][0] == 3 and abs(got["beside_copies"][1] - 30e-6) < 1e-12
    assert got["apart_from_copies"] == (1, 10e-6)
    assert got["queued_by_launch"] == {"cudaGraphLaunch": (2, 20e-6), "cudaLaunchKernel": (2, 20e-6)}
