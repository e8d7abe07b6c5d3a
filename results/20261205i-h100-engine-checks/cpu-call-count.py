"""The Python calls of one prefill, resident against layer-major, on CPU: the tiny preset at 8 layers, a 1,024-token
prompt in 64-token chunks (16 chunks, one window). Run from the repository root:
python results/20261205i-h100-engine-checks/cpu-call-count.py > results/20261205i-h100-engine-checks/cpu-call-count.txt
"""

import cProfile
import dataclasses
import pstats

import torch

from abbench.engine.config import PRESETS, EngineConfig
from abbench.engine.runtime.engine import Engine

mc = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=8)
prompt = torch.randint(10, mc.vocab_size - 10, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
for mode in ("resident", "layer-major"):
    engine = Engine(EngineConfig(model=mc, weights="random:0", device="cpu", dtype="float32", chunk_tokens=64,
                                 max_context=1100, layer_major_window_tokens=1024, prefill_mode=mode,
                                 bandwidth_probe_bytes=0))
    with torch.no_grad():
        engine.run(prompt, 1, ignore_eos=True)  # first sighting
        engine.reset()
        prof = cProfile.Profile()
        prof.enable()
        engine.run(prompt, 1, ignore_eos=True)
        prof.disable()
    stats = pstats.Stats(prof)
    print(f"{mode}: {stats.total_calls} function calls ({stats.prim_calls} primitive)")
