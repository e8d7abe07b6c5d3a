"""The host expert bank: every layer's experts in host memory, allocated at their exact size, and the check
that refuses a bank the host cannot hold.

- ``ExpertBank`` keeps two tensors a layer: ``gate_up[l]`` [E, 2I, H] (gate rows then up rows, nn.Linear
  layout) and ``down[l]`` [E, H, I]. ``torch._grouped_mm`` takes them as transposed views (K-contiguous B
  operand), so a layer crosses PCIe in two copies and nothing is transposed in the hot loop. On CUDA the memory
  is page-locked with ``cudaHostRegister`` on an exact-size allocation: ``torch.empty(..., pin_memory=True)``
  goes through the caching host allocator, which rounds every block up to a power of two (measured on an H200
  host, torch 2.11: a 1.21 GB Qwen3-30B-A3B layer grew the process by 2.00 GiB that way, by 1.13 GiB = 1.21 GB
  registered). Copies from registered memory run at full speed (54.7 GB/s measured, layer by layer). On CPU it
  is ordinary memory.
- ``check_host_memory(bank_bytes, available, dense_bytes)``: a clear error instead of an OOM kill when the bank
  and its headroom (``host_memory_headroom``: the dense weights plus a twentieth of the bank, at least 256 MiB)
  do not fit the host's available memory (``host_memory_available``: MemAvailable, lowered to the cgroup's room).
"""

from __future__ import annotations

import weakref

import torch

from abbench.engine.config import ModelConfig


_PAGE = 4096


def _unregister(ptrs: list[int]) -> None:
    if torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)


def host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations: /proc/meminfo's MemAvailable, lowered to the
    cgroup's limit minus its usage where one is set. None where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max", encoding="ascii").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read().strip())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


HEADROOM_FLOOR = 256 * 2**20  # at least this much is left for the process itself (torch, the tokenizer)
HEADROOM_BANK_FRACTION = 0.05  # and a twentieth of the bank: the allocator's slack and transient copies


def host_memory_headroom(bank_bytes: int, dense_bytes: int = 0) -> int:
    """Host memory the engine needs beside the bank: the dense weights (``dense_bytes``; in host memory on CPU,
    passing through it on the way to a device) plus a twentieth of the bank, at least :data:`HEADROOM_FLOOR`. It
    grows with what the engine allocates, so a tiny model asks for a few hundred MB, not gigabytes."""
    return max(HEADROOM_FLOOR, int(HEADROOM_BANK_FRACTION * bank_bytes) + int(dense_bytes))


def check_host_memory(bank_bytes: int, available: int | None, dense_bytes: int = 0) -> None:
    """Refuse a bank that does not fit the host's available memory with its headroom
    (:func:`host_memory_headroom`): a clear error instead of an OOM kill. ``available`` None: nothing to check."""
    headroom = host_memory_headroom(bank_bytes, dense_bytes)
    if available is not None and bank_bytes + headroom > available:
        raise ValueError(f"the expert bank needs {bank_bytes / 1e9:.2f} GB of host memory (+{headroom / 1e9:.2f} "
                         f"GB headroom: the dense weights and a twentieth of the bank) but {available / 1e9:.2f} GB "
                         "is available; use a machine with more memory, a smaller model (e.g. a -half preset), or "
                         "--no-host-memory-check if the host grows its memory on demand")


class ExpertBank:
    """All layers' experts in host memory (page-locked when the compute device is CUDA)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pin: bool, check_memory: bool = True,
                 dense_bytes: int = 0):
        self.cfg, self.dtype, self.pinned = cfg, dtype, pin
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.expert_bytes = 3 * h * i * dtype.itemsize
        self.layer_bytes = e * self.expert_bytes
        self.bank_bytes = cfg.num_hidden_layers * self.layer_bytes
        if check_memory:
            check_host_memory(self.bank_bytes, host_memory_available(), dense_bytes)
        self._registered: list[int] = []
        weakref.finalize(self, _unregister, self._registered)
        self.gate_up = [self._alloc((e, 2 * i, h)) for _ in range(cfg.num_hidden_layers)]  # [E, 2I, H] each
        self.down = [self._alloc((e, h, i)) for _ in range(cfg.num_hidden_layers)]  # [E, H, I] each

    def _alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=self.dtype)
        nbytes = self.dtype.itemsize * shape[0] * shape[1] * shape[2]  # exact: no power-of-two rounding
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)  # exact size plus alignment slack
        off = (-raw.data_ptr()) % _PAGE
        t = raw[off:off + nbytes].view(self.dtype).view(shape)
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
        self._registered.append(t.data_ptr())
        return t
