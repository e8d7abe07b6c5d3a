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
- **FP8 banks** (``ExpertBank(..., fp8=True)``, the engine's ``--expert-dtype fp8``): the same two tensors a layer
  in float8 e4m3 (``torch.float8_e4m3fn``) with one float32 scale per output row, the per-channel convention of
  FP8 checkpoints on Hugging Face (``gate_up_scale[l]`` [E, 2I], ``down_scale[l]`` [E, H]): an expert crosses
  PCIe as 3HI bytes plus 4(2I + H) bytes of scales, a little over half its bf16 size. Writers hand the bank a
  whole layer in any precision (``put_layer``), which quantizes it there (:func:`quantize_rows`: scale = the
  row's largest magnitude / 448, e4m3's largest normal, round to nearest); the device dequantizes what it copies
  (:func:`dequantize_into`: ``(q as float32 x scale)`` rounded once to the compute dtype, elementwise, so every
  path that reads an expert sees the same values on a device and the prefill modes stay bitwise equal among
  themselves). Weights are quantized, activations are not: the arithmetic is the compute dtype's.
"""

from __future__ import annotations

import math
import weakref

import torch

from abbench.engine.config import ModelConfig
from abbench.engine.ops.fp8 import FP8, FP8_MAX, quantize_rows  # noqa: F401 (the bank's format, re-exported)


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


DEQUANT_PIECE = 2**24  # elements dequantized at a time: bounds the float32 temporary (64 MiB)


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """Scales [N, R] (one per row, ``block`` None) or [N, ceil(R / br), ceil(C / bc)] (one per ``block`` (br, bc),
    the last blocks possibly partial) as a tensor that multiplies [N, R, C] elementwise: [N, R, 1] or [N, R, C]."""
    if block is None:
        return scale.unsqueeze(-1)
    br, bc = block
    return scale.repeat_interleave(br, dim=1)[:, :rows].repeat_interleave(bc, dim=2)[:, :, :cols]


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """``out[...] = q * scale`` per row or per block (:func:`expand_scale`), computed in float32 and rounded once
    to ``out``'s dtype; ``q`` [N, R, C] and ``scale`` on ``out``'s device, in pieces of about
    :data:`DEQUANT_PIECE` elements along the first dimension (elementwise: the pieces do not change a value).
    Returns ``out``."""
    n, rows, cols = q.shape
    step = max(1, DEQUANT_PIECE // max(1, q[0].numel()))
    for a in range(0, n, step):
        b = min(n, a + step)
        out[a:b].copy_(q[a:b].to(torch.float32).mul_(expand_scale(scale[a:b], rows, cols, block)))
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`dequantize_into` a new tensor of ``dtype`` on ``q``'s device."""
    return dequantize_into(torch.empty(q.shape, dtype=dtype, device=q.device), q, scale, block)


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


class ExpertBank:
    """All layers' experts in host memory (page-locked when the compute device is CUDA), in the compute dtype or
    (``fp8``) in float8 e4m3 with float32 scales: one per output row, or (``block`` (br, bc), an FP8 checkpoint's
    ``weight_block_size`` kept as it is) one per br x bc block, ``gate_up_scale`` [E, 2I / br, H / bc] and
    ``down_scale`` [E, ceil(H / br), ceil(I / bc)]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pin: bool, check_memory: bool = True,
                 dense_bytes: int = 0, fp8: bool = False, block: tuple[int, int] | None = None):
        self.cfg, self.compute_dtype, self.pinned, self.fp8 = cfg, dtype, pin, fp8
        self.dtype = FP8 if fp8 else dtype  # what the bank stores
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.block = tuple(block) if (fp8 and block) else None
        if self.block is not None:
            br, bc = self.block
            if i % br:
                raise ValueError(f"FP8 block scales of {br} rows: moe_intermediate_size {i} is not a multiple, so the "
                                 "gate and up projections' blocks would mix in the fused gate_up rows")
            gu_scale, dn_scale = (e, _blocks(2 * i, br), _blocks(h, bc)), (e, _blocks(h, br), _blocks(i, bc))
        else:
            gu_scale, dn_scale = (e, 2 * i), (e, h)
        self.scale_bytes = 4 * (math.prod(gu_scale[1:]) + math.prod(dn_scale[1:])) if fp8 else 0  # one expert's
        self.expert_bytes = 3 * h * i * self.dtype.itemsize + self.scale_bytes  # what one expert's copy moves
        self.device_expert_bytes = 3 * h * i * dtype.itemsize  # one expert on the device (compute dtype)
        self.layer_bytes = e * self.expert_bytes
        self.bank_bytes = cfg.num_hidden_layers * self.layer_bytes
        if check_memory:
            check_host_memory(self.bank_bytes, host_memory_available(), dense_bytes)
        self._registered: list[int] = []
        weakref.finalize(self, _unregister, self._registered)
        n = cfg.num_hidden_layers
        self.gate_up = [self._alloc((e, 2 * i, h), self.dtype) for _ in range(n)]  # [E, 2I, H] each
        self.down = [self._alloc((e, h, i), self.dtype) for _ in range(n)]  # [E, H, I] each
        self.gate_up_scale = [self._alloc(gu_scale, torch.float32) for _ in range(n)] if fp8 else []
        self.down_scale = [self._alloc(dn_scale, torch.float32) for _ in range(n)] if fp8 else []

    @property
    def format(self) -> str:
        """What the bank stores, as the engine reports it: ``fp8-e4m3 (per-row scales)``, ``fp8-e4m3
        (128x128-block scales)`` or the dtype's name."""
        if not self.fp8:
            return str(self.dtype).removeprefix("torch.")
        return "fp8-e4m3 (per-row scales)" if self.block is None else \
            f"fp8-e4m3 ({self.block[0]}x{self.block[1]}-block scales)"

    def put_expert_fp8(self, layer: int, e: int, gate: tuple[torch.Tensor, torch.Tensor],
                       up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Expert ``e`` of ``layer`` as an FP8 checkpoint holds it, each projection (float8 e4m3 [rows, cols],
        float32 block scales [ceil(rows / br), ceil(cols / bc)]) with this bank's ``block``: stored as it is."""
        assert self.block is not None, "put_expert_fp8 needs a bank with the checkpoint's block scales"
        i, br = self.cfg.moe_intermediate_size, self.block[0]
        (gq, gs), (uq, us), (dq, ds) = gate, up, down
        self.gate_up[layer][e, :i].copy_(gq)
        self.gate_up[layer][e, i:].copy_(uq)
        self.gate_up_scale[layer][e, :i // br].copy_(gs)
        self.gate_up_scale[layer][e, i // br:].copy_(us)
        self.down[layer][e].copy_(dq)
        self.down_scale[layer][e].copy_(ds)

    def put_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Layer ``layer``'s experts, gate_up [E, 2I, H] and down [E, H, I] in any float dtype on any device,
        into the bank: cast to the bank's dtype, or quantized (per row, on the tensors' device) for FP8."""
        if self.block is not None:
            raise ValueError("an FP8 bank with block scales takes an FP8 checkpoint's experts as they are "
                             "(put_expert_fp8); quantizing to blocks at load is not built")
        if not self.fp8:
            self.gate_up[layer].copy_(gate_up)
            self.down[layer].copy_(down)
            return
        for w, q_out, s_out in ((gate_up, self.gate_up[layer], self.gate_up_scale[layer]),
                                (down, self.down[layer], self.down_scale[layer])):
            for a in range(w.shape[0]):  # an expert at a time: the float32 temporaries stay small
                q, scale = quantize_rows(w[a])
                q_out[a].copy_(q)
                s_out[a].copy_(scale)

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=dtype)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d  # exact: no power-of-two rounding
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)  # exact size plus alignment slack
        off = (-raw.data_ptr()) % _PAGE
        t = raw[off:off + nbytes].view(dtype).view(shape)
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
        self._registered.append(t.data_ptr())
        return t
