"""Device self-checks and what only they and the tests use: ``gpucheck`` (Qwen3-MoE at full width),
``gpucheck_hybrid`` (the hybrids), ``gpucheck_decode_kernels`` (each decode kernel against torch's),
``gpucheck_policy`` (auto prefill's crossover), ``gpucheck_batch`` (many sequences at once), ``gpucheck_fp8``
(FP8 banks), ``gpucheck_bits`` (the same bits in every repeat and process; the distance between configurations),
``gpucheck_memory`` (a budgeted engine's memory as torch and the driver see it). Nothing of the runtime imports
them.

``release(cuda)``: what a check does after dropping an engine, before building the next one.
"""

from __future__ import annotations

import gc

import torch


def release(cuda: bool) -> None:
    """Free what a dropped engine held: an engine's reference cycles keep its device memory and its pinned host
    bank until the garbage collector runs (on an 80 GB card the next engine's start ran out of memory), and
    the caching allocator keeps the freed blocks until emptied."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
