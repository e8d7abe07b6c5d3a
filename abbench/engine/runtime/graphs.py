"""CUDA graphs of engine pieces, keyed, sharing one memory pool: what decode steps and prefill layer steps replay.

Contract:
- ``GraphCache(device).run(key, fn)`` runs the piece ``fn`` (a closure over static buffers: it reads and writes
  only tensors whose addresses stay fixed between calls). The first time ``key`` is seen ``fn`` runs eagerly
  (that run is the real work and warms lazy initialisation, workspaces and Triton autotuning); the second time
  it is captured (capture executes nothing) and replayed at once; from then on it is replayed. So every call
  executes the piece exactly once, which matters for pieces that update state in place (a DeltaNet recurrent
  state), and eager and replayed pieces run the same kernels.
- A key must name everything the piece's addresses depend on (the buffers it reads and writes).
- ``replays`` counts pieces replayed, ``eager`` pieces run eagerly (first sightings), for the stats.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


class GraphCache:
    """CUDA graphs keyed by piece; see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.seen: set[tuple] = set()
        self.stream = torch.cuda.Stream(device)
        self.replays = 0
        self.eager = 0

    def run(self, key: tuple, fn: Callable[[], None]) -> None:
        g = self.graphs.get(key)
        if g is None:
            if key not in self.seen:
                self.seen.add(key)
                self.eager += 1
                fn()
                return
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            g = torch.cuda.CUDAGraph()
            # No cyclic garbage collection inside a capture: a collection that frees another CUDA graph (an
            # engine dropped earlier in the process) destroys it mid-capture, which CUDA does not permit and
            # which invalidates this capture (seen on the H200: the decode warm-up of a second engine in one
            # test process failed with cudaErrorStreamCaptureInvalidated)
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(g, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    fn()
            finally:
                if collecting:
                    gc.enable()
            current.wait_stream(self.stream)
            self.graphs[key] = g
        self.replays += 1
        g.replay()
