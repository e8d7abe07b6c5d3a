"""Where a budgeted engine's device memory goes, as torch and the driver see it.

``python -m abbench.engine.tools.gpucheck_memory [--model qwen3.5-35b-a3b] [--budget 16] [--max-context 33024]
[--tokens 4096] [--engines NAME:field=value,... ...]``

Each engine (``gpucheck_bits``' ``NAME:field=value`` specs over a base of the preset, random weights, layer-major
under ``--budget`` GiB) is built in turn, in this process, and after its start, after a request of ``--tokens``
tokens, after ``torch.cuda.empty_cache()`` and after a second request it records torch's allocated and reserved
memory (now and their peaks) and the driver's view of this process (NVML's used memory, what a card must hold),
beside the engine's memory plan (``MemoryPlan``: its total is the budget, its reserve what it leaves for all that
torch does not allocate as a tensor). So a process over its budget says whether its tensors outgrew the plan
(allocated), the allocator kept more than they need (reserved over allocated: fragmentation), or the driver
counts memory torch never sees (NVML over reserved: the CUDA context, cuBLAS, Triton and fla).

Prints one line per point; writes them to ``--out`` (JSON). On CPU it runs with no memory figures (the tests).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from abbench.engine.config import PRESETS, EngineConfig
from abbench.engine.tools import release
from abbench.engine.tools.gpucheck_bits import model_and_engines

GIB = 2**30


def _nvml_process_gib() -> float | None:
    """This process's device memory as the driver counts it (None without NVML or CUDA)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return proc.usedGpuMemory / GIB
    except Exception:  # noqa: BLE001 - no NVML here
        return None
    return None


def point(at: str, cuda: bool) -> dict:
    """The memory figures now, in GiB (None on CPU)."""
    if not cuda:
        return {"at": at, "allocated": None, "reserved": None, "max_allocated": None, "max_reserved": None,
                "nvml_process": None}
    torch.cuda.synchronize()
    return {"at": at, "allocated": torch.cuda.memory_allocated() / GIB, "reserved": torch.cuda.memory_reserved() / GIB,
            "max_allocated": torch.cuda.max_memory_allocated() / GIB,
            "max_reserved": torch.cuda.max_memory_reserved() / GIB, "nvml_process": _nvml_process_gib()}


def measure(model: str, budget: float, max_context: int, tokens: int, engines: list[tuple[str, dict]],
            device: str) -> list[dict]:
    from abbench.engine.runtime.engine import Engine

    cuda = device == "cuda"
    mc = PRESETS[model]
    base = dict(model=mc, weights="random:0", device=device, dtype="bfloat16" if cuda else "float32",
                prefill_mode="layer-major", gpu_memory_budget_gib=budget, max_context=max_context, max_num_seqs=1,
                layer_major_window_tokens=max(tokens, 2048))
    prompt = torch.randint(10, mc.vocab_size - 10, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    out = []
    for name, fields in engines:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        engine = Engine(EngineConfig(**{**base, **fields}))
        plan = engine.memory_plan
        row = {"engine": name, "fields": fields, "plan_total_gib": plan.total_bytes / GIB if plan else None,
               "plan_reserve_gib": plan.reserve_bytes / GIB if plan else None,
               "plan": plan.describe() if plan else None, "points": [point("start", cuda)]}
        for label in ("a request", "empty_cache", "a second request"):
            if label == "empty_cache":
                if cuda:
                    torch.cuda.empty_cache()
            else:
                engine.reset()
                engine.run(prompt, 8)
            row["points"].append(point(f"after {label}", cuda))
        out.append(row)
        del engine
        release(cuda)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_memory",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="preset (default: qwen3.5-35b-a3b on cuda, qwen3.5-tiny on cpu)")
    p.add_argument("--budget", type=float, default=16.0, help="--gpu-memory-budget, GiB")
    p.add_argument("--max-context", type=int, default=33024)
    p.add_argument("--tokens", type=int, default=None, help="the requests' prompt length (default 4096; 256 on cpu)")
    p.add_argument("--engines", nargs="+", default=["shared:slots_share_buffers=on",
                                                    "beside:slots_share_buffers=off"],
                   help="NAME:field=value,... (EngineConfig fields over the base), built in this order")
    p.add_argument("--out", type=Path, default=None, help="write every figure as JSON")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    model, engines = model_and_engines(p, args)
    with torch.no_grad():
        rows = measure(model, args.budget, args.max_context, args.tokens or (4096 if cuda else 256), engines,
                       args.device)
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"{model}, {args.device}, budget {args.budget:g} GiB, max context {args.max_context} (GiB below)")
    for r in rows:
        print(f"{r['engine']}: plan total {f(r['plan_total_gib'])}, reserve {f(r['plan_reserve_gib'])}: {r['plan']}")
        print(f"  {'at':<26} {'allocated':>9} {'reserved':>9} {'max alloc':>9} {'max resv':>9} {'NVML':>7}")
        for pt in r["points"]:
            print(f"  {pt['at']:<26} {f(pt['allocated']):>9} {f(pt['reserved']):>9} {f(pt['max_allocated']):>9} "
                  f"{f(pt['max_reserved']):>9} {f(pt['nvml_process']):>7}")
    if args.out:
        args.out.write_text(json.dumps({"model": model, "device": args.device, "budget_gib": args.budget,
                                        "max_context": args.max_context, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
