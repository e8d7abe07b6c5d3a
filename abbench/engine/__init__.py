"""The vendored engine: an offloaded Mixture-of-Experts runtime for Qwen3-MoE, Qwen3.5/3.6-MoE and Qwen4-Exp models.

Every layer's experts live in host memory (page-locked on CUDA) and are streamed to the compute device;
the dense weights, the KV cache, a double buffer of two layer banks and a decode slot cache live on the
device. Prefill runs in one of four modes that produce bitwise-identical results on one device and differ
only in how often the expert bank crosses PCIe:

- ``chunked``: every chunk through every layer, one bank copy per chunk (the usual offloaded engine);
- ``layer-major``: every chunk through one layer before the next, one bank copy per prompt (or window);
- ``demand``: short chunks copy only the experts they are routed to;
- ``resident``: all experts on the device (the compute floor, not an offload mode).

The same code runs on CPU (tests, CI) and CUDA. Modules: ``config`` (ModelConfig, PRESETS, EngineConfig; ``memory``: the device-memory plan;
no torch), ``weights`` (random init and HF safetensors loading), ``experts`` (bank, buffers, slot cache,
byte accounting), ``model`` (the decoder), ``hybrid`` and ``gdn`` (the Qwen3.5/3.6-MoE Gated DeltaNet hybrid
and its delta-rule math), ``qwen4`` and ``qwen4_weights`` (Qwen4-Exp: hyper-connections, per-layer n-gram
embeddings, indexed attention, on the hybrid's DeltaNet), ``factory`` (the right model and cache for a
config), ``prefill``, ``decode`` (static-shape steps, CUDA graphs), ``runtime`` (``Engine``, the API the HTTP server calls), ``gpucheck`` and
``gpucheck_hybrid`` (device self-checks at full width); the HTTP server is ``api`` (request schema, errors,
response pieces), ``serving`` (the FIFO worker queue, metrics) and ``server`` (routes, the command line);
``stats`` (no torch) is the per-request ``abbench`` object, which the harness reads too. It imports nothing
from the rest of abbench.

``Engine`` is imported lazily so that ``abbench.engine.config`` works without torch.
"""

from abbench.engine.config import PRESETS, EngineConfig, ModelConfig

__all__ = ["PRESETS", "Engine", "EngineConfig", "ModelConfig"]


def __getattr__(name: str):
    if name == "Engine":
        from abbench.engine.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
