"""The runtime: ``engine`` (``Engine``, one request at a time, the backend contract), ``prefill`` (the four
modes), ``steps`` (a chunk through a layer, prefill graphs), ``decode`` (static-shape steps, CUDA graphs),
``graphs``, ``experts`` (the device side of the offload: double buffer, slot caches, accounting), ``memory``
(the device-memory plan) and ``policy`` (auto prefill's cost model). Imports neither ``serve`` nor ``tools``.
"""
