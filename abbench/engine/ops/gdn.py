"""Gated DeltaNet math: the depthwise causal conv with state and the gated delta rule, for one request.

Contract:
- ``causal_conv(x, state, weight) -> (y, new_state)``: depthwise causal conv of kernel K over x [T, C] (the
  pre-split q/k/v projection, model dtype) continuing from ``state`` [C, K-1] (the last K-1 input columns
  before x; zeros at the start of a sequence), then SiLU. ``new_state`` holds the last K-1 input columns
  of [state, x] (exact copies of inputs, so the model dtype loses nothing).
- ``gated_delta_rule(q, k, v, g, beta, state) -> (o, new_state)``: q, k [T, Hk, Dk], v [T, Hv, Dv] (model
  dtype, not normalised), g [T, Hv] float32 (log decay, <= 0), beta [T, Hv]; ``state`` [Hv, Dk, Dv] float32
  or None (zeros). Key head j serves value heads [j*r, (j+1)*r), r = Hv / Hk. q and k are L2-normalised in
  float32 and q scaled by Dk^-0.5 inside. Returns o [T, Hv, Dv] in v's dtype and the float32 final state:
  the recurrent state never leaves float32.
  * T == 1: one recurrent step (``recurrent_step``), static shapes, no host sync (decode, CUDA graphs).
  * T > 1: the chunked (WY/UT) form in ``BLOCK`` = 64-token blocks, the blocks counted from the first
    token of x and the last one zero-padded (padding has k = 0, beta = 0, g = 0: it changes neither the
    outputs nor the state). So a split of a sequence at a multiple of 64 gives the blocks of the unsplit
    sequence; callers keep their chunk lengths multiples of 64 (the engine enforces it for hybrid models).
  * On CUDA, when ``fla`` (flash-linear-attention / fla-core) imports, its ``chunk_gated_delta_rule`` and
    ``fused_recurrent_gated_delta_rule`` run instead (same arguments, fp32 state in and out); otherwise the
    torch code below, which is the CPU path. ``backend(device)`` says which one a device gets. In one
    process Triton's autotuning settles once per shape, so every mode (same chunk shapes) gets the same
    kernel configs after a warm-up. Across processes fla keeps each choice in Triton's on-disk cache
    (``FLA_CACHE_RESULTS``, on by default: Triton's ``cache_results``; the cache is ``TRITON_CACHE_DIR``,
    ``~/.triton/cache`` by default), so every later process on a machine runs the configs the first one
    measured: on an H100 a second process autotuned nothing and gave the same bits
    (results/20261206s-h100-bits-memory, ``tools.gpucheck_bits --autotune-cache``).
- Pure functions: nothing is written in place; the caller stores the returned states.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK = 64


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], state [C, K-1], weight [C, K] -> (silu(conv) [T, C], new state [C, K-1])."""
    T, C = x.shape
    K = weight.shape[1]
    xs = torch.cat([state, x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    y = F.conv1d(xs[None], weight[:, None, :], groups=C)[0]  # [C, T]
    return F.silu(y).transpose(0, 1), xs[:, T:T + K - 1]  # [T, C], [C, K-1]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # [..., D]


def _prepare(q, k, v, beta, g):
    """Value-head layout in float32: q, k [Hv, T, Dk] (normalised, q scaled), v [Hv, T, Dv], beta, g [Hv, T]."""
    r = v.shape[1] // k.shape[1]
    if r > 1:
        q = q.repeat_interleave(r, dim=1)  # [T, Hv, Dk]
        k = k.repeat_interleave(r, dim=1)  # [T, Hv, Dk]
    q, k, v = (t.transpose(0, 1).float().contiguous() for t in (q, k, v))  # [Hv, T, D]
    beta, g = (t.transpose(0, 1).float().contiguous() for t in (beta, g))  # [Hv, T]
    q = l2norm(q) * q.shape[-1] ** -0.5  # [Hv, T, Dk]
    k = l2norm(k)  # [Hv, T, Dk]
    return q, k, v, beta, g


def recurrent_step(q, k, v, g, beta, state):
    """The delta rule for T == 1 (torch): shapes as ``gated_delta_rule``; ``state`` must not be None."""
    dtype = v.dtype
    q, k, v, beta, g = _prepare(q, k, v, beta, g)
    q, k, v, beta, g = q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0]  # [Hv, Dk] x2, [Hv, Dv], [Hv] x2
    s = state * g.exp()[:, None, None]  # [Hv, Dk, Dv] decayed
    kv_mem = (s * k[:, :, None]).sum(dim=1)  # [Hv, Dv] what the state predicts for k
    delta = (v - kv_mem) * beta[:, None]  # [Hv, Dv]
    s = s + k[:, :, None] * delta[:, None, :]  # [Hv, Dk, Dv]
    o = (s * q[:, :, None]).sum(dim=1)  # [Hv, Dv]
    return o[None].to(dtype), s  # [1, Hv, Dv], [Hv, Dk, Dv]


def chunk_rule(q, k, v, g, beta, state):
    """The delta rule in 64-token blocks (torch): shapes as ``gated_delta_rule``."""
    dtype, T = v.dtype, v.shape[0]
    q, k, v, beta, g = _prepare(q, k, v, beta, g)
    Hv, _, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % BLOCK
    n = (T + pad) // BLOCK
    q, k, v = (F.pad(t, (0, 0, 0, pad)).view(Hv, n, BLOCK, -1) for t in (q, k, v))  # [Hv, n, 64, D]
    beta, g = (F.pad(t, (0, pad)).view(Hv, n, BLOCK) for t in (beta, g))  # [Hv, n, 64]
    kb = k * beta[..., None]  # [Hv, n, 64, Dk]
    vb = v * beta[..., None]  # [Hv, n, 64, Dv]
    gc = g.cumsum(dim=-1)  # [Hv, n, 64] log decay from the block start to each position (inclusive)
    upper = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=q.device).triu(1)  # [64, 64]
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, n, 64, 64] i>=j
    a = (kb @ k.transpose(-1, -2)) * decay  # [Hv, n, 64, 64]; solve reads its strict lower part, unit diagonal
    u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)  # [Hv, n, 64, Dv]
    w = torch.linalg.solve_triangular(a, kb * gc.exp()[..., None], upper=False,
                                      unitriangular=True)  # [Hv, n, 64, Dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [Hv, n, 64, 64] intra-block, causal
    q_dec = q * gc.exp()[..., None]  # [Hv, n, 64, Dk] reads the state entering the block
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]  # [Hv, n, 64, Dk] decayed to the block end
    block_decay = gc[..., -1].exp()  # [Hv, n]
    s = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty(Hv, n, BLOCK, Dv, dtype=torch.float32, device=q.device)  # [Hv, n, 64, Dv]
    for i in range(n):  # blocks in order: the state carries from each to the next
        v_new = u[:, i] - w[:, i] @ s  # [Hv, 64, Dv]
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ v_new  # [Hv, 64, Dv]
        s = s * block_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new  # [Hv, Dk, Dv]
    o = out.view(Hv, n * BLOCK, Dv)[:, :T].transpose(0, 1)  # [T, Hv, Dv]
    return o.to(dtype).contiguous(), s


@functools.cache
def _fla():
    """fla's (chunk, fused_recurrent) gated delta rule kernels, or None when fla does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - not installed, or no Triton for this device
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def backend(device: torch.device) -> str:
    """Which implementation ``gated_delta_rule`` uses on ``device``."""
    return "fla" if device.type == "cuda" and _fla() is not None else "torch"


def _fla_rule(q, k, v, g, beta, state):
    """fla-core >= 0.6 takes Hv > Hk itself (grouped value attention: value head h reads key head h // r, as
    ``repeat_interleave`` above), the state as [N, Hv, Dk, Dv] float32 and scale Dk^-0.5 by default."""
    chunk, recurrent = _fla()
    if state is None:
        state = torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=v.device)
    fn = recurrent if v.shape[0] == 1 else chunk
    o, s = fn(q[None], k[None], v[None], g=g[None].float(), beta=beta[None], initial_state=state[None].float(),
              output_final_state=True, use_qk_l2norm_in_kernel=True)  # [1, T, Hv, Dv], [1, Hv, Dk, Dv]
    return o[0].to(v.dtype), s[0].float()


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. -> (o [T, Hv, Dv], final state [Hv, Dk, Dv] float32)."""
    if backend(v.device) == "fla":
        return _fla_rule(q, k, v, g, beta, state)
    if v.shape[0] == 1:
        if state is None:
            state = torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=v.device)
        return recurrent_step(q, k, v, g, beta, state)
    return chunk_rule(q, k, v, g, beta, state)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., Dv] (float32, weight applied in x's dtype) times silu(gate) in
    float32, back to x's dtype (transformers' Qwen3_5MoeRMSNormGated; its weight is not zero-centred)."""
    xf = x.float()  # [..., Dv]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., Dv]
    y = weight * xf.to(x.dtype)  # [..., Dv]
    return (y * F.silu(gate.float())).to(x.dtype)  # [..., Dv]
