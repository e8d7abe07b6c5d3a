"""Decode: one token at a time through the decode slot cache (or resident experts), then sampling.

Contract:
- ``decode_step(model, store, kv, token_id, pos, cancel) -> logits [V] float32`` runs the token at position
  ``pos`` through every layer, writing its KV. Per layer the router's choice is read back to the host (one
  sync per layer: an offloaded decode must know which experts to fetch), the routed experts are made
  resident in the slot cache (misses copied from the host bank and counted), and the same grouped-GEMM
  expert code as prefill runs over the slot tensors with slot indices. In resident mode the experts are
  read in place and nothing is copied.
- ``Sampler``: temperature 0 is argmax (lowest id on ties); otherwise softmax(logits / temperature)
  sampled with a per-request ``torch.Generator`` seeded by ``seed`` (a fresh random seed when None), so a
  seeded request is reproducible on one device. With ``logprobs`` (0..V) it also returns the chosen token's
  log-probability and the top-``logprobs`` (id, logprob) pairs, from log_softmax of the raw float32 logits
  (before temperature, as vLLM reports them by default).
"""

from __future__ import annotations

import secrets

import torch

from .experts import ExpertStore
from .model import KVCache, Model, attention_backends
from .prefill import CancelLike, check_cancel


@torch.no_grad()
def decode_step(model: Model, store: ExpertStore, kv: KVCache, token_id: int, pos: int,
                cancel: CancelLike = None) -> torch.Tensor:
    ids = torch.tensor([token_id], device=model.device)  # [1]
    x = model.embed(ids)  # [1, H]
    if store.cuda and store.resident is None:  # slot writes below go after any prefill copy still queued
        torch.cuda.current_stream(store.device).wait_stream(store.copy_stream)
    with attention_backends():
        for layer in range(model.cfg.num_hidden_layers):
            check_cancel(cancel)
            x, h, top_w, top_ids = model.attn_block(layer, x, kv, pos)  # [1, H], [1, H], [1, k], [1, k]
            if store.resident is not None:
                gate_up, down = store.resident[layer]  # [E, 2I, H], [E, H, I]
                group_ids = top_ids
            else:
                slot_ids, gate_up, down = store.decode_experts(layer, top_ids.tolist())  # [N, 2I, H], [N, H, I]
                group_ids = torch.tensor(slot_ids, device=model.device)  # [1, k] slot of each routed expert
            x = model.moe_block(x, h, top_w, group_ids, gate_up, down)  # [1, H]
        return model.logits(x)  # [V]


class Sampler:
    def __init__(self, temperature: float, seed: int | None, device: torch.device, logprobs: int | None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature, self.logprobs = float(temperature), logprobs
        self.generator = None
        if self.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(secrets.randbits(63) if seed is None else int(seed))

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """logits [V] float32 -> (token id, its logprob or None, top (id, logprob) pairs or None)."""
        if self.temperature == 0:
            tok = torch.argmax(logits).view(1)  # [1]
        else:
            probs = torch.softmax(logits / self.temperature, dim=-1)  # [V]
            tok = torch.multinomial(probs, 1, generator=self.generator)  # [1]
        if self.logprobs is None:
            return int(tok.item()), None, None
        lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        top_v, top_i = torch.topk(lp, self.logprobs) if self.logprobs else (lp[:0], tok[:0])  # [n], [n]
        packed = torch.cat([tok.to(lp.dtype), lp[tok], top_i.to(lp.dtype), top_v]).tolist()  # one host sync
        n = self.logprobs  # ids travel as float32: exact below 2**24, far above any vocabulary
        return int(packed[0]), packed[1], [(int(i), v) for i, v in zip(packed[2:2 + n], packed[2 + n:], strict=True)]
