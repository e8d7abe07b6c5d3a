"""``chunk_tokens`` "auto": the engine takes the largest of AUTO_CHUNK_TOKENS whose device-memory plan fits when
it starts (larger chunks launch fewer kernels; their workspace comes out of decode's slots), 2048 where there is no
plan (the CPU without a budget) or where only 2048 fits. The full-scale cells are the CUDA plan's arithmetic (a
budget given, so no device is asked); the small model runs on the CPU."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from abbench.engine import EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.config import AUTO_CHUNK_TOKENS, CHUNK_AUTO  # noqa: E402
from abbench.engine.runtime.engine import Engine, _chunk_chosen, check_plan  # noqa: E402
from abbench.engine.runtime.memory import GIB, least_budget, plan_device_memory  # noqa: E402

MINI = ModelConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                   max_position_embeddings=8192, eos_token_id=None, name="mini-chunk-auto")
KNOBS = dict(model=MINI, weights="random:3", max_context=8192, layer_major_window_tokens=8192,
             bandwidth_probe_bytes=0, device="cpu")


@pytest.mark.parametrize(("max_context", "window", "chosen"), [
    (33024, 32768, 4096),    # 16K-32K at 16 GiB (results/20261206h: 17 slots a layer)
    (131328, 131072, 4096),  # 64K-128K at 16 GiB (results/20261206k: 20 slots in the buffers' memory)
    (262144, 65536, 2048),   # 256K at 16 GiB: 4096 leaves no decode slot (results/20261206b ran 2048)
])
def test_auto_takes_the_largest_chunk_whose_plan_fits_the_hybrid_at_16_gib(max_context: int, window: int,
                                                                            chosen: int) -> None:
    cfg = EngineConfig(model="qwen3.5-35b-a3b", device="cuda", dtype="bfloat16", gpu_memory_budget_gib=16,
                       max_context=max_context, layer_major_window_tokens=window, chunk_tokens=CHUNK_AUTO).resolved()
    got = _chunk_chosen(cfg, torch.device("cuda"), False)  # with a budget the plan asks no device
    assert got.chunk_tokens == chosen and dataclasses.replace(got, chunk_tokens=CHUNK_AUTO) == cfg
    for larger in (c for c in AUTO_CHUNK_TOKENS if c > chosen):  # each larger one is refused by its plan
        with pytest.raises(ValueError, match="expert slots per layer but decode needs"):
            plan_device_memory(dataclasses.replace(cfg, chunk_tokens=larger), 16 * GIB)


def test_without_a_plan_auto_is_2048_and_a_number_is_kept() -> None:
    assert check_plan(EngineConfig(**KNOBS, chunk_tokens=CHUNK_AUTO))[0].chunk_tokens == 2048
    assert check_plan(EngineConfig(**KNOBS, chunk_tokens=1024, gpu_memory_budget_gib=8))[0].chunk_tokens == 1024
    with pytest.raises(ValueError, match="a positive number of tokens or 'auto'"):
        EngineConfig(**KNOBS, chunk_tokens="big")


def test_an_engine_started_with_auto_prefills_in_the_chunks_its_budget_allows() -> None:
    """A budget between what 2048- and 4096-token chunks need gives 2048; one above both gives 4096; the engine's
    config holds the number, and a prefill runs in those chunks."""
    base = EngineConfig(**KNOBS, chunk_tokens=2048, gpu_memory_budget_gib=8).resolved()  # one sequence, as budgeted
    k = MINI.num_experts_per_tok  # the fewest slots decode runs with
    need = {c: least_budget(dataclasses.replace(base, chunk_tokens=c), k)[0] for c in (2048, 4096)}
    assert need[2048] < need[4096]
    for budget, chosen in (((need[2048] + need[4096]) / 2, 2048), (need[4096] + GIB, 4096)):
        engine = Engine(EngineConfig(**KNOBS, chunk_tokens=CHUNK_AUTO, gpu_memory_budget_gib=budget / GIB))
        assert engine.config.chunk_tokens == chosen
        ids = torch.randint(0, MINI.vocab_size, (chosen + 5,), generator=torch.Generator().manual_seed(1)).tolist()
        events, stats = engine.run(ids, 1)
        assert len(events) == 1 and (stats.n_chunks, stats.chunk_tokens) == (2, chosen), stats
