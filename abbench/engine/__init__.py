"""The vendored engine: an offloaded Mixture-of-Experts runtime for Qwen3-MoE, Qwen3.5/3.6-MoE and Qwen4-Exp models.

Every layer's experts live in host memory (page-locked on CUDA) and are streamed to the compute device;
the dense weights, the KV cache, a double buffer of two layer banks and a decode slot cache live on the
device. Prefill runs in one of four modes that produce bitwise-identical results on one device and differ
only in how often the expert bank crosses PCIe:

- ``chunked``: every chunk through every layer, one bank copy per chunk (the usual offloaded engine);
- ``layer-major``: every chunk through one layer before the next, one bank copy per prompt (or window);
- ``demand``: short chunks copy only the experts they are routed to;
- ``resident``: all experts on the device (the compute floor, not an offload mode).

The same code runs on CPU (tests, CI) and CUDA. The folders are the layers, lowest first, and every import
points down (``tests/harness/test_import_layers.py``): ``contract`` (the backend contract: ``GenerateRequest``,
``Backend``, ``TokenEvent``, ``RequestStats``), ``config`` and ``shapes`` (ModelConfig, PRESETS, EngineConfig) and
``stats`` (the per-request ``abbench`` object, which the harness reads too), none of them importing torch;
``ops/`` (tensor functions and kernels); ``models/`` (one file per family, the model interface, weights, the
host expert bank); ``runtime/`` (``Engine``, prefill, decode, slot caches, the memory plan, the auto policy);
``serve/`` (the HTTP API, queue and server, the tokenizer, the transformers reference on the contract alone, the
launcher); ``tools/`` (device self-checks and reference kernels). It imports nothing from the rest of abbench.

``Engine`` is imported lazily so that ``abbench.engine.config`` works without torch.
"""

from abbench.engine.config import PRESETS, EngineConfig, ModelConfig

__all__ = ["PRESETS", "Engine", "EngineConfig", "ModelConfig"]


def __getattr__(name: str):
    if name == "Engine":
        from abbench.engine.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
