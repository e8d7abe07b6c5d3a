"""Which op invalidates the decode-graph capture of Qwen4-Exp's 'attn' piece (CUDA)?"""
import ctypes, dataclasses, sys, traceback
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from abbench.engine import decode as D, gdn
from abbench.engine.config import EngineConfig, PRESETS
from abbench.engine.runtime import Engine

cuda = ctypes.CDLL("libcuda.so.1")
def status():
    s = ctypes.c_int(-1)
    cuda.cuStreamIsCapturing(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.byref(s))
    return s.value  # 0 none, 1 active, 2 invalidated

class Tracer(TorchDispatchMode):
    def __init__(self): super().__init__(); self.log = []; self.first_bad = None
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = status()
        out = func(*args, **(kwargs or {}))
        after = status()
        self.log.append((str(func), before, after))
        if after == 2 and self.first_bad is None:
            self.first_bad = (str(func), before, "".join(traceback.format_stack(limit=12)[:-1]))
        return out

real_rule = gdn._fla_rule
def traced_rule(*a):
    b = status(); out = real_rule(*a); print(f"    fla rule: status {b} -> {status()}", flush=True); return out
gdn._fla_rule = traced_rule

real_run = D._Graphs.run
def run(self, key, fn):
    if key in self.graphs or key not in self.seen:
        return real_run(self, key, fn)
    current = torch.cuda.current_stream(self.device); self.stream.wait_stream(current)
    g = torch.cuda.CUDAGraph(); t = Tracer()
    try:
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream, capture_error_mode=MODE):
            with t:
                fn()
    except Exception as e:
        print(f"  capture {key} FAILED ({type(e).__name__}); first op with status 2: "
              f"{t.first_bad[0] if t.first_bad else None} (before {t.first_bad[1] if t.first_bad else None})", flush=True)
        if t.first_bad: print(t.first_bad[2], flush=True)
        print("  last ops:", [(f, b, a) for f, b, a in t.log[:60]], flush=True)
        raise
    current.wait_stream(self.stream); self.graphs[key] = g; g.replay()
D._Graphs.run = run

def engine(preset, layers=None):
    mc = PRESETS[preset]
    if layers:
        extra = {"ple_layer_ids": tuple(i for i in mc.ple_layer_ids if i <= layers)} if mc.is_qwen4 else {}
        mc = dataclasses.replace(mc, num_hidden_layers=layers, layer_types=mc.layer_types[:layers],
                                 name=f"{mc.name}[:{layers}]", **extra)
    return Engine(EngineConfig(model=mc, weights="random:0", chunk_tokens=64 if not layers else 2048,
                               layer_major_window_tokens=128 if not layers else 4096, bandwidth_probe_bytes=0,
                               max_context=2100, expert_slots_per_layer=mc.num_experts_per_tok + 2,
                               warm_decode_graphs=False, device="cuda"))

for MODE in ("thread_local", "relaxed"):
    for preset, layers in (("qwen4-exp-tiny", None), ("qwen3.5-tiny", None), ("qwen4-exp-half", 3)):
        for how in ("lazy", "warm"):
            print(f"== {preset} layers={layers} {how} capture_error_mode={MODE}", flush=True)
            e = None
            try:
                e = engine(preset, layers)
                print("   dtype", e.dtype, "graphs", e.decoder.mode, flush=True)
                if how == "warm":
                    e._warm_decode(); print("   warm ok", e.decode_warmup, flush=True)
                prompt = torch.randint(0, 400, (70,), generator=torch.Generator().manual_seed(2)).tolist()
                ev, st = e.run(prompt, 6, ignore_eos=True)
                print("   run ok", [x.token_id for x in ev], flush=True)
            except Exception as ex:
                print("   ERROR", type(ex).__name__, str(ex)[:300], flush=True)
            del e; torch.cuda.empty_cache()
