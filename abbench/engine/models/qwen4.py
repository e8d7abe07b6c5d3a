"""The Qwen4-Exp text decoder (transformers' ``Qwen4ExpForCausalLM``, ``qwen4_exp``), one request at a time.

Contract:
- ``Qwen4Model`` has the interface of ``model.Model`` that ``prefill`` and ``decode`` drive, with these
  differences: the activations between layers are the ``hc_count`` hyper-connection residual streams,
  x [T, hc*H] (``cfg.stream_width``; layer-major parks them), and ``attn_block`` returns as its first element
  a ``Pending`` (streams, shared expert output, injection weights) that ``moe_block`` finishes; callers only
  pass it through. The cache (``Qwen4Cache``) keeps the token ids by position in host memory:
  ``prefill`` calls ``cache.write_tokens(start, ids)`` before the layers run, and the decoder calls
  ``model.prepare_decode(cache, token_id, pos)`` on the host before each step (it records the token and
  stages each PLE layer's gathered table rows in a pinned host buffer that the step copies up, so the step's
  pieces stay static-shape and sync-free, CUDA graphs included).
- A layer (the order of transformers' decoder layer):
  * PLE (``cfg.ple_layers``, linear layers only): hashed 2..n-grams of the token ids, hashed on the host
    (the history before a chunk read from ``cache.host_tokens``; positions before 0 and any n-gram
    crossing an EOS use EOS, as transformers' "shift right ignoring EOS"); each of the 2 x
    ``heads_per_ngram`` heads gathers rows of its own part of the table, which stays on the host (only the
    T x heads rows a chunk needs are gathered and copied up, from pinned memory on CUDA, without a host
    sync); key/value projections, a sign-sqrt sigmoid gate per stream against the grouped-normed streams,
    a grouped norm and a dilated (dilation ``ngram_size``) depthwise causal conv with SiLU continuing from
    the layer's PLE conv state; the output is added to the streams.
  * attention mixer: grouped zero-centred RMSNorm of the streams (groups of H), mixing weights
    sigmoid(up(silu(down(normed) / hc))), the streams' weighted mean is the block input; injection weights
    2 * sigmoid(inject(normed) / hc). The block: Gated DeltaNet (``hybrid.HybridModel.linear_mixer``,
    output gate silu or sigmoid) or indexed gated attention (below). streams += out * weight, per stream.
  * MoE mixer (the same with its own weights); block = routed experts + sigmoid-gated shared expert (that
    order, as transformers); streams += block * weight.
  * After the last layer a final mixer (no injection) replaces the final norm, then lm_head.
- Indexed attention: the indexer projects the block input to ``indexer_n_heads`` queries (zero-centred
  norm, RoPE at their positions) and one raw key per token, kept in ``cache.ik`` [S, Di] like a KV cache.
  Keys are mean-pooled (float32) over complete blocks of ``indexer_compress_ratio`` tokens, normed and
  rotated at the block's first position, into ``cache.ck`` [S/c, Di] (written when the block completes,
  by the chunk or decode step that completes it; a prefill resumed mid-block recomputes that block). A
  query at position p scores the blocks complete at p (those ending at or before p) by sum over heads of
  relu(q . k) / sqrt(Di), keeps the ``budget / c`` best (ties: the lower block index first, by a stable
  sort, the same rule in every mode and in decode) and attends to their tokens plus its unfinished tail
  (the tokens after the last complete block, up to p). With at most budget/c complete blocks that is
  plain causal attention. transformers picks with ``torch.topk``, whose order among exactly equal scores
  is unspecified (it varies with the length), so the two agree unless two blocks tie exactly at the cut
  (a score of exactly 0, every head's relu zero, is the likely case).
- ``Qwen4Cache`` (a ``hybrid.HybridCache``): KV of the attention layers, ``ik``/``ck`` per attention layer,
  ``host_tokens`` [S] (host), GDN conv/recurrent states and per PLE layer a conv state
  [hc*H, (K-1)*ngram_size] in the model dtype. ``snapshot()``/``restore()`` copy the states (GDN and PLE
  conv; KV, indexer keys and token ids are per position and stay valid for a prefix) for the prefix cache.
- Bitwise equality across prefill modes holds under the hybrid's rules (chunks of one layer in order,
  chunk lengths multiples of 64): every mode calls the same functions with the same shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from abbench.engine.config import Qwen4Config
from abbench.engine.models.hybrid import AttnWeights, HybridCache, HybridModel, LinearWeights, zc_rms_norm
from abbench.engine.ops.dense import decode_gqa, rotate_half
from abbench.engine.ops.moe import moe_experts, route

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd per-position hash multipliers of PLE layer number ``ple_index`` (as transformers derives them)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ngram_head_sizes(cfg: Qwen4Config, ple_index: int) -> list[int]:
    """Rows of each n-gram head's part of PLE layer ``ple_index``'s table: the (g+1)-th prime after
    ``ngram_vocab_size_base - 1`` for the global head number g."""
    sizes, p, g0 = [], cfg.ngram_vocab_size_base - 1, ple_index * cfg.ngram_heads
    for _ in range(g0):  # skip the heads of the PLE layers before this one
        p += 1
        while not _is_prime(p):
            p += 1
    for _ in range(cfg.ngram_heads):
        p += 1
        while not _is_prime(p):
            p += 1
        sizes.append(p)
    return sizes


def ple_table_rows(cfg: Qwen4Config, ple_index: int) -> int:
    """Rows of a PLE table, padded to ``make_ngram_vocab_size_divisible_by``."""
    d = cfg.make_ngram_vocab_size_divisible_by
    return -(-sum(ngram_head_sizes(cfg, ple_index)) // d) * d


@dataclass
class MixerWeights:
    """A hyper-connection mixer (``inject`` None for the final one)."""

    norm: torch.Tensor  # [hc*H] zero-centred, groups of H
    down: torch.Tensor  # [R, hc*H]
    up: torch.Tensor  # [hc*H, R]
    inject: torch.Tensor | None  # [hc, hc*H]


@dataclass
class IndexedAttnWeights(AttnWeights):
    index_qk: torch.Tensor = None  # [(Hi+1)*Di, H] Hi query heads then one key head
    index_q_norm: torch.Tensor = None  # [Di] zero-centred
    index_k_norm: torch.Tensor = None  # [Di] zero-centred


@dataclass
class PLEWeights:
    table: torch.Tensor  # [Vp, P/heads] on the host
    multipliers: torch.Tensor  # [n] int64, on the host like the next two (PLE hashes there)
    head_sizes: torch.Tensor  # [heads] int64
    head_offsets: torch.Tensor  # [heads] int64
    key_proj: torch.Tensor  # [hc*H, P]
    value_proj: torch.Tensor  # [H, P]
    norm_key: torch.Tensor  # [hc*H] zero-centred, groups of H
    norm_query: torch.Tensor  # [hc*H]
    norm_conv: torch.Tensor  # [hc*H]
    conv: torch.Tensor  # [hc*H, K] depthwise, dilation ngram_size


@dataclass
class Qwen4LayerWeights:
    attn_mix: MixerWeights
    mixer: IndexedAttnWeights | LinearWeights
    mlp_mix: MixerWeights
    router: torch.Tensor  # [E, H]
    shared_gate_up: torch.Tensor  # [2Is, H]
    shared_down: torch.Tensor  # [H, Is]
    shared_gate: torch.Tensor  # [1, H]
    ple: PLEWeights | None


@dataclass
class Qwen4Weights:
    embed: torch.Tensor  # [V, H]
    layers: list[Qwen4LayerWeights]
    final_mix: MixerWeights
    lm_head: torch.Tensor  # [V, H]


class Pending(NamedTuple):
    """What ``attn_block`` hands to ``moe_block``: the streams, the shared expert's output and the MoE
    injection weights."""

    streams: torch.Tensor  # [T, hc*H]
    shared: torch.Tensor  # [T, H]
    inject: torch.Tensor  # [T, hc]


class Qwen4Cache(HybridCache):
    """See the module docstring. ``ple_slot[layer]`` indexes ``ple_conv``."""

    def __init__(self, cfg: Qwen4Config, max_context: int, device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, max_context, device, dtype)
        di, c = cfg.indexer_head_dim, cfg.indexer_compress_ratio
        n_attn = len(cfg.attention_layers)
        self.ik = [torch.zeros(max_context, di, device=device, dtype=dtype) for _ in range(n_attn)]
        self.ck = [torch.zeros(max_context // c + 1, di, device=device, dtype=dtype) for _ in range(n_attn)]
        self.host_tokens = torch.zeros(max_context, dtype=torch.long)  # [S] on the host: PLE hashes there
        self.ple_slot = {l: i for i, l in enumerate(cfg.ple_layers)}
        pin = device.type == "cuda"
        # a decode step's gathered PLE rows per PLE layer: staged on the host (pinned), copied up by the step
        self.ple_stage = [torch.zeros(1, cfg.ple_embed_dim, dtype=dtype, pin_memory=pin) for _ in cfg.ple_layers]
        self.ple_rows = [torch.zeros(1, cfg.ple_embed_dim, device=device, dtype=dtype) for _ in cfg.ple_layers]
        width = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
        self.ple_conv = [torch.zeros(cfg.stream_width, width, device=device, dtype=dtype) for _ in cfg.ple_layers]
        self._saved_ple = [torch.zeros_like(t) for t in self.ple_conv]
        # layer-major: (PLE layer, chunk start) -> the chunk's gathered rows [T, P] on the device, uploaded
        # ahead of the layer's bank (Qwen4Model.prepare_layer_window); emptied at every prefill's start
        self.ple_ready: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        extra = self.ik + self.ck + self.ple_conv + self.ple_rows
        return super().nbytes + sum(t.numel() * t.element_size() for t in extra)

    def write_tokens(self, start: int, ids: torch.Tensor) -> None:
        """Record the token ids [T] at positions [start, start+T) (prefill calls it before the layers); rows
        uploaded ahead for an earlier prefill (one cancelled mid-layer) are dropped."""
        self.host_tokens[start:start + ids.shape[0]] = ids.cpu()
        self.ple_ready.clear()

    def states(self) -> list[torch.Tensor]:
        return self.conv + self.rec + self.ple_conv

    def snapshot(self) -> None:
        super().snapshot()
        for dst, src in zip(self._saved_ple, self.ple_conv, strict=True):
            dst.copy_(src)

    def restore(self) -> None:
        super().restore()
        for dst, src in zip(self.ple_conv, self._saved_ple, strict=True):
            dst.copy_(src)

    def clear(self) -> None:
        super().clear()
        for t in self.ple_conv + self._saved_ple:
            t.zero_()
        self.ple_ready.clear()


def group_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over groups of ``group`` features of x [T, G*group] (transformers' grouped
    Qwen4ExpTextRMSNorm): float32, scale (1 + w), cast back."""
    T, n = x.shape
    xf = x.float().view(T, n // group, group)  # [T, G, g]
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).view(T, n)  # [T, G*g]
    return (xf * (1.0 + weight.float())).to(x.dtype)  # [T, G*g]


def mix(x: torch.Tensor, mw: MixerWeights, hc: int, eps: float):
    """Hyper-connection mixer of the streams x [T, hc*H] -> (block input [T, H], injection weights [T, hc] or
    None)."""
    T = x.shape[0]
    h = x.shape[1] // hc
    xn = group_norm(x, mw.norm, h, eps)  # [T, hc*H]
    w = F.silu(F.linear(xn, mw.down) / hc)  # [T, R]
    w = torch.sigmoid(F.linear(w, mw.up)).view(T, hc, h)  # [T, hc, H]
    mixed = (w * xn.view(T, hc, h)).mean(dim=-2)  # [T, H]
    if mw.inject is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(F.linear(xn, mw.inject) / hc)  # [T, H], [T, hc]


def inject(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """streams x [T, hc*H] + out [T, H] times each stream's weight [T, hc]."""
    return x + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)  # [T, hc*H]


def dilated_causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                        dilation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], state [C, (K-1)*dilation], weight [C, K] -> (silu(dilated depthwise conv) [T, C], new state)."""
    T, C = x.shape
    w = state.shape[1]
    xs = torch.cat([state, x.transpose(0, 1)], dim=1)  # [C, w+T]
    y = F.conv1d(xs[None], weight[:, None, :], groups=C, dilation=dilation)[0]  # [C, T]
    return F.silu(y).transpose(0, 1), xs[:, T:T + w]  # [T, C], [C, w]


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """transformers' Qwen4ExpTextRMSNormGated: RMSNorm (weight in x's dtype) times act(gate) in float32."""
    xf = x.float()  # [..., Dv]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., Dv]
    g = gate.float()  # [..., Dv]
    g = torch.sigmoid(g) if act == "sigmoid" else F.silu(g)  # [..., Dv]
    return ((weight * xf.to(x.dtype)) * g).to(x.dtype)  # [..., Dv]


class Qwen4Model(HybridModel):
    """Dense weights, RoPE tables and the layer functions of a ``Qwen4Config`` model; stateless between calls
    except for the cache passed in."""

    triton_decode = False  # its MoE block adds a shared expert and streams; its decode attends through an indexer
    guesses_experts = False  # (its decode's experts are torch's: no device-side slot lookup to prefetch into)

    def __init__(self, cfg: Qwen4Config, weights: Qwen4Weights, max_context: int, device: torch.device,
                 dtype: torch.dtype):
        super().__init__(cfg, weights, max_context, device, dtype)
        # its first halves read per-chunk PLE uploads and its streams are wider: every step runs eagerly
        self.prefill_graph_layers = frozenset()  # and cfg.prefill_graph_moe is False

    attention_batching = False  # indexed attention has no joint call
    prefill_kernels_apply = False  # its halves hand pending work over (their own norms and routing)

    def new_cache(self, max_context: int | None = None) -> Qwen4Cache:
        return Qwen4Cache(self.cfg, max_context or self.max_context, self.device, self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w.embed).repeat(1, self.cfg.hc_count)  # [T, hc*H] every stream the same

    # -- PLE ----------------------------------------------------------------------------------------------
    def ngram_ids(self, pw: PLEWeights, hist: torch.Tensor) -> torch.Tensor:
        """Token history hist [n-1+T] on the host (the n-1 tokens before the chunk first) -> table rows
        [T, heads] (int64 arithmetic as transformers': products wrap, remainders are non-negative)."""
        cfg = self.cfg
        n, eos, T = cfg.ngram_size, cfg.ple_eos, hist.shape[0] - (cfg.ngram_size - 1)
        is_eos = hist == eos  # [n-1+T]
        cur = hist[n - 1:]  # [T]
        shifted, crossed = [cur], torch.zeros_like(cur, dtype=torch.bool)  # [T] x2
        for s in range(1, n):
            src = hist[n - 1 - s:n - 1 - s + T]  # [T] the token s before
            shifted.append(torch.where(crossed, torch.full_like(src, eos), src))  # [T] EOS past a segment start
            crossed = crossed | is_eos[n - 1 - s:n - 1 - s + T]  # [T]
        blocks = []
        hp = cfg.heads_per_ngram
        mixed = shifted[0] * pw.multipliers[0]  # [T] int64, wraps like transformers' int64 product
        for g in range(2, n + 1):
            mixed = torch.bitwise_xor(mixed, shifted[g - 1] * pw.multipliers[g - 1])  # [T]
            lo = (g - 2) * hp
            ids = torch.remainder(mixed[:, None], pw.head_sizes[lo:lo + hp][None])  # [T, hp]
            blocks.append(ids + pw.head_offsets[lo:lo + hp][None])  # [T, hp]
        return torch.cat(blocks, dim=-1)  # [T, heads]

    def gather(self, layer: int, hist: torch.Tensor) -> torch.Tensor:
        """PLE layer ``layer``'s table rows for the token history hist [n-1+T] (host) -> [T, P] on the host."""
        pw = self.w.layers[layer].ple
        rows = self.ngram_ids(pw, hist)  # [T, heads]
        return pw.table.index_select(0, rows.reshape(-1)).view(rows.shape[0], -1)  # [T, P]

    def prepare_decode(self, cache: Qwen4Cache, token_id: int, pos: int) -> None:
        """Host side of a decode step at ``pos``, before its pieces run: record the token and stage each PLE
        layer's rows in ``cache.ple_stage`` (the step copies them up)."""
        cache.host_tokens[pos] = token_id
        for layer, j in cache.ple_slot.items():
            cache.ple_stage[j].copy_(self.gather(layer, self._history(cache, pos, 1)))

    def _upload(self, emb: torch.Tensor) -> torch.Tensor:
        """Host rows [T, P] -> the device, without a host sync on CUDA (through pinned memory)."""
        if self.device.type == "cuda":
            return emb.pin_memory().to(self.device, non_blocking=True)
        return emb.to(self.device)  # [T, P]

    def prepare_layer_window(self, layer: int, cache: Qwen4Cache, spans: list[tuple[int, int]]) -> None:
        """Streamed prefill (chunked: one chunk; layer-major: the window): upload a PLE layer's rows for every
        chunk [a, b) of ``spans`` at once (into ``cache.ple_ready``; ``attn_block`` takes them). Prefill calls
        it through the bank stream's ``before_next`` hook: once ``layer``'s bank copy is queued and before the
        next layer's is, which orders after these uploads. Uploaded inside the layer, an upload queued behind
        the next layer's whole bank copy (layer-major on the H200, Qwen4-Exp shape at 32K: ~100 ms per request
        over 2 PLE layers that no copy wait counted). The same rows as the resident path's per-chunk uploads,
        so the results are bitwise the same; one PLE layer's rows for one window are on the device at a time
        (the memory plan counts them)."""
        if layer not in cache.ple_slot:
            return
        for a, b in spans:
            cache.ple_ready[(layer, a)] = self._upload(self.gather(layer, self._history(cache, a, b - a)))

    def ple(self, layer: int, x: torch.Tensor, emb: torch.Tensor,
            conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PLE of the streams x [T, hc*H] given the gathered rows emb [T, P] (device) -> (x + PLE [T, hc*H],
        new conv state)."""
        cfg, pw = self.cfg, self.w.layers[layer].ple
        T, h, hc = x.shape[0], cfg.hidden_size, cfg.hc_count
        emb = emb.to(x.dtype)  # [T, P]
        key = group_norm(F.linear(emb, pw.key_proj), pw.norm_key, h, cfg.rms_norm_eps).view(T, hc, h)  # [T, hc, H]
        value = F.linear(emb, pw.value_proj)  # [T, H]
        query = group_norm(x, pw.norm_query, h, cfg.rms_norm_eps).view(T, hc, h)  # [T, hc, H]
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(h)  # [T, hc, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # [T, hc, 1]
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [T, hc*H]
        normed = group_norm(gated, pw.norm_conv, h, cfg.rms_norm_eps)  # [T, hc*H]
        conv, conv_state = dilated_causal_conv(normed, conv_state, pw.conv, cfg.ngram_size)  # [T, hc*H]
        return x + (gated + conv), conv_state  # [T, hc*H]

    def _history(self, cache: Qwen4Cache, start: int, T: int) -> torch.Tensor:
        """cache.host_tokens at [start-(n-1), start+T), EOS before position 0 -> [n-1+T] (host)."""
        ctx = self.cfg.ngram_size - 1
        lo = max(0, start - ctx)
        hist = cache.host_tokens[lo:start + T]  # [<= n-1+T]
        pad = ctx - (start - lo)
        if pad:
            hist = torch.cat([torch.full((pad,), self.cfg.ple_eos, dtype=hist.dtype, device=hist.device), hist])
        return hist  # [n-1+T]

    # -- indexed attention -------------------------------------------------------------------------------
    def _index_q(self, aw: IndexedAttnWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> indexer queries [T, Hi, Di] (normed, rotated) and raw keys [T, Di]."""
        cfg = self.cfg
        T, hi, di, rd = x.shape[0], cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.rotary_dim
        qk = F.linear(x, aw.index_qk)  # [T, (Hi+1)*Di]
        q, k = qk[:, :hi * di].reshape(T, hi, di), qk[:, hi * di:]  # [T, Hi, Di], [T, Di]
        q = zc_rms_norm(q, aw.index_q_norm, cfg.rms_norm_eps)  # [T, Hi, Di]
        c, s = cos[:, None], sin[:, None]  # [T, 1, R] x2
        q = torch.cat((q[..., :rd] * c + rotate_half(q[..., :rd]) * s, q[..., rd:]), dim=-1)  # [T, Hi, Di]
        return q, k

    def _compress(self, aw: IndexedAttnWeights, raw: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Raw keys of whole blocks raw [nb*c, Di] -> compressed keys [nb, Di] (mean, norm, RoPE at ``first``
        [nb], the blocks' first positions)."""
        cfg = self.cfg
        c, di, rd = cfg.indexer_compress_ratio, cfg.indexer_head_dim, cfg.rotary_dim
        pooled = raw.view(-1, c, di).float().mean(dim=1).to(raw.dtype)  # [nb, Di]
        k = zc_rms_norm(pooled, aw.index_k_norm, cfg.rms_norm_eps)  # [nb, Di]
        cos, sin = self.cos.index_select(0, first), self.sin.index_select(0, first)  # [nb, R] x2
        return torch.cat((k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]), dim=-1)  # [nb, Di]

    def _select(self, q: torch.Tensor, ck: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Queries q [T, Hi, Di] at positions pos [T], compressed keys ck [nb, Di] -> which of the keys
        [0, kv_len) each query attends to [T, kv_len] bool (selected blocks, unfinished tail, causal)."""
        cfg = self.cfg
        c, k = cfg.indexer_compress_ratio, cfg.block_topk
        nb = ck.shape[0]
        scores = torch.relu(torch.einsum("thd,bd->thb", q.float(), ck.float())).sum(dim=1)  # [T, nb]
        scores = scores / math.sqrt(cfg.indexer_head_dim)  # [T, nb]
        n_done = torch.div(pos + 1, c, rounding_mode="floor")  # [T] complete blocks per query
        blocks = torch.arange(nb, device=q.device)  # [nb]
        valid = blocks[None] < n_done[:, None]  # [T, nb]
        scores = scores.masked_fill(~valid, float("-inf"))  # [T, nb]
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, <=k] ties: lower index
        chosen = torch.zeros_like(valid).scatter_(1, order, True) & valid  # [T, nb]
        keys = torch.arange(kv_len, device=q.device)  # [L]
        kb = torch.div(keys, c, rounding_mode="floor")  # [L] each key's block
        in_chosen = chosen.index_select(1, kb.clamp_max(max(nb - 1, 0))) if nb else torch.zeros(
            q.shape[0], kv_len, dtype=torch.bool, device=q.device)  # [T, L]
        tail = kb[None] >= n_done[:, None]  # [T, L] the unfinished block (and later, masked below)
        return (in_chosen | tail) & (keys[None] <= pos[:, None])  # [T, L]

    def indexed_attention(self, layer: int, x: torch.Tensor, cache: Qwen4Cache, start: int) -> torch.Tensor:
        """Indexed gated attention of x [T, H] at positions [start, start+T); writes KV and indexer keys."""
        cfg, aw = self.cfg, self.w.layers[layer].mixer
        i, c = cache.slot[layer], cfg.indexer_compress_ratio
        T = x.shape[0]
        end = start + T
        cos, sin = self.cos[start:end], self.sin[start:end]  # [T, R] x2
        q, k, v, gate = self._qkv(aw, x, cos, sin)
        cache.k[i][:, start:end] = k
        cache.v[i][:, start:end] = v
        iq, ik = self._index_q(aw, x, cos, sin)  # [T, Hi, Di], [T, Di]
        cache.ik[i][start:end] = ik
        b0, b1 = start // c, end // c  # blocks completing in this chunk: [b0, b1)
        if b1 > b0:
            first = torch.arange(b0, b1, device=x.device) * c  # [nb]
            cache.ck[i][b0:b1] = self._compress(aw, cache.ik[i][b0 * c:b1 * c], first)
        pos = torch.arange(start, end, device=x.device)  # [T]
        visible = self._select(iq, cache.ck[i][:b1], pos, end)  # [T, end]
        # One call per key/value head, its query heads against its keys and values copied out to each of
        # them: with a mask, SDPA's grouped-query path is the math kernel, which materialises float32 scores
        # for every query head ([Hq, T, end], 4.3 GB per 2048-token chunk at 32K at full width); the
        # memory-efficient kernel takes the mask but not grouped heads. Peak: 2 x (Hq/Hkv) x end x D copies.
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        mask = visible[None, None]  # [1, 1, T, end]
        out = torch.cat([F.scaled_dot_product_attention(
            q[None, h * g:(h + 1) * g], cache.k[i][h, :end].expand(g, end, -1).contiguous()[None],
            cache.v[i][h, :end].expand(g, end, -1).contiguous()[None], attn_mask=mask, scale=self.scale)
            for h in range(cfg.num_key_value_heads)], dim=1)  # [1, Hq, T, D]
        return self._attn_out(aw, out, gate)  # [T, H]

    # -- Gated DeltaNet (the hybrid's, with the configured output gate) -----------------------------------
    def gated_output_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.cfg.output_gate_type == "silu":
            return super().gated_output_norm(o, z, weight)
        return gated_norm(o, z, weight, self.cfg.rms_norm_eps, "sigmoid")  # [T, Hv, Dv]

    # -- the layer halves ---------------------------------------------------------------------------------
    def _post_mixer(self, layer: int, x: torch.Tensor):
        """Streams after the attention block [T, hc*H] -> (Pending, MoE input h [T, H], top_w, top_ids)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        h, inj = mix(x, lw.mlp_mix, cfg.hc_count, cfg.rms_norm_eps)  # [T, H], [T, hc]
        top_w, top_ids = route(h, lw.router, cfg.num_experts_per_tok, True, self.bias_of(layer))  # [T, k] x2
        gu = F.linear(h, lw.shared_gate_up)  # [T, 2Is]
        i_s = gu.shape[-1] // 2
        shared = F.linear(F.silu(gu[:, :i_s]) * gu[:, i_s:], lw.shared_down)  # [T, H]
        shared = torch.sigmoid(F.linear(h, lw.shared_gate)) * shared  # [T, H]
        return Pending(x, shared, inj), h, top_w, top_ids

    def attn_block(self, layer: int, x: torch.Tensor, cache: Qwen4Cache, start: int):
        """First half of a layer: streams x [T, hc*H] at positions [start, start+T) -> (Pending, MoE input
        h [T, H], router weights [T, k], router expert ids [T, k])."""
        cfg = self.cfg
        T = x.shape[0]
        if layer in cache.ple_slot:
            j = cache.ple_slot[layer]
            state = torch.zeros_like(cache.ple_conv[j]) if start == 0 else cache.ple_conv[j]
            emb = cache.ple_ready.pop((layer, start), None)  # [T, P] uploaded ahead (layer-major)
            if emb is None:
                emb = self._upload(self.gather(layer, self._history(cache, start, T)))  # [T, P]
            x, state = self.ple(layer, x, emb, state)  # [T, hc*H]
            cache.ple_conv[j].copy_(state)
        hn, inj = mix(x, self.w.layers[layer].attn_mix, cfg.hc_count, cfg.rms_norm_eps)  # [T, H], [T, hc]
        if cfg.layer_types[layer] == "full_attention":
            out = self.indexed_attention(layer, hn, cache, start)  # [T, H]
        else:
            out = self.linear_attention(layer, hn, cache, start)  # [T, H]
        return self._post_mixer(layer, inject(x, out, inj))

    def decode_attn_block(self, layer: int, x: torch.Tensor, cache: Qwen4Cache, pos_t: torch.Tensor,
                          kv_len: int):
        """``attn_block`` for one token x [1, hc*H] at the position held by ``pos_t`` (LongTensor [1]),
        after ``prepare_decode`` for that token; static shapes, no host sync: attention over cache positions
        [0, kv_len) with the indexer's selection; the block completed by this token (if any) is compressed
        into ``ck``; linear and PLE layers step their states."""
        cfg, lw = self.cfg, self.w.layers[layer]
        if layer in cache.ple_slot:
            j = cache.ple_slot[layer]
            emb = cache.ple_rows[j].copy_(cache.ple_stage[j], non_blocking=True)  # [1, P] staged by prepare_decode
            x, state = self.ple(layer, x, emb, cache.ple_conv[j])  # [1, hc*H]
            cache.ple_conv[j].copy_(state)
        hn, inj = mix(x, lw.attn_mix, cfg.hc_count, cfg.rms_norm_eps)  # [1, H], [1, hc]
        i = cache.slot[layer]
        if cfg.layer_types[layer] == "full_attention":
            aw, c = lw.mixer, cfg.indexer_compress_ratio
            cos, sin = self.cos.index_select(0, pos_t), self.sin.index_select(0, pos_t)  # [1, R] x2
            q, k, v, gate = self._qkv(aw, hn, cos, sin)  # [Hq, 1, D], [Hkv, 1, D] x2, [1, Hq*D]
            cache.k[i].index_copy_(1, pos_t, k)
            cache.v[i].index_copy_(1, pos_t, v)
            iq, ik = self._index_q(aw, hn, cos, sin)  # [1, Hi, Di], [1, Di]
            cache.ik[i].index_copy_(0, pos_t, ik)
            done = torch.div(pos_t + 1, c, rounding_mode="floor")  # [1] complete blocks
            b = (done - 1).clamp_min(0)  # [1] the last complete block
            rows = b * c + torch.arange(c, device=pos_t.device)  # [c]
            new = self._compress(aw, cache.ik[i].index_select(0, rows), b * c)  # [1, Di]
            completes = (pos_t + 1) % c == 0  # [1] this token ends a block
            cache.ck[i].index_copy_(0, b, torch.where(completes[:, None], new, cache.ck[i].index_select(0, b)))
            visible = self._select(iq, cache.ck[i][:kv_len // c], pos_t, kv_len)  # [1, L]
            out = decode_gqa(q, cache.k[i][:, :kv_len], cache.v[i][:, :kv_len], ~visible[0], self.scale)[None]
            # [1, Hq, 1, D]
            out = self._attn_out(aw, out, gate)  # [1, H]
        else:
            out, conv, rec = self.linear_mixer(layer, hn, cache.conv[i], cache.rec[i])  # [1, H]
            cache.conv[i].copy_(conv)
            cache.rec[i].copy_(rec)
        return self._post_mixer(layer, inject(x, out, inj))

    def moe_block(self, x: Pending, h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Second half of a layer: streams + (routed experts(h) + shared) per stream's weight -> [T, hc*H]."""
        out = moe_experts(h, top_w, top_ids, gate_up, down, self._mm) + x.shared  # [T, H]
        return inject(x.streams, out, x.inject)  # [T, hc*H]

    def logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """Final mixer and lm_head of the streams x_last [1, hc*H] -> float32 logits [V]."""
        h, _ = mix(x_last, self.w.final_mix, self.cfg.hc_count, self.cfg.rms_norm_eps)  # [1, H]
        return F.linear(h, self.w.lm_head)[0].float()  # [V]
