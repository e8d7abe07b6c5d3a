"""A token from logits: ``Sampler(temperature, seed, device, logprobs)(logits [V] float32)`` -> (token id, its
logprob or None, the top (id, logprob) pairs or None).

Temperature 0 is argmax (lowest id on ties); otherwise softmax(logits / temperature) sampled with a per-request
``torch.Generator`` seeded by ``seed`` (a fresh random seed when None), so a seeded request is reproducible on
one device. With ``logprobs`` (0..V) it also returns the chosen token's log-probability and the top-``logprobs``
(id, logprob) pairs, from log_softmax of the raw float32 logits (before temperature, as vLLM reports them by
default). Both backends choose their tokens with it, so their margins compare like for like. With ``full`` it
keeps the whole log_softmax row of its first call (the first output position), as base64 float32 little-endian
(:meth:`Sampler.first_full_b64`): the full distribution a numerics probe compares exactly.
"""

from __future__ import annotations

import base64
import secrets

import torch


class Sampler:
    """One request's token choice (module docstring)."""

    def __init__(self, temperature: float, seed: int | None, device: torch.device, logprobs: int | None,
                 full: bool = False):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature, self.logprobs = float(temperature), logprobs
        self.full = full
        self.first_full: torch.Tensor | None = None  # ``full``: the first call's log_softmax row, on the host
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
        keep = self.full and self.first_full is None
        if self.logprobs is None and not keep:
            return int(tok.item()), None, None
        lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        if keep:
            self.first_full = lp.cpu()
        if self.logprobs is None:
            return int(tok.item()), None, None
        top_v, top_i = torch.topk(lp, self.logprobs) if self.logprobs else (lp[:0], tok[:0])  # [n], [n]
        packed = torch.cat([tok.to(lp.dtype), lp[tok], top_i.to(lp.dtype), top_v]).tolist()  # one host sync
        n = self.logprobs  # ids travel as float32: exact below 2**24, far above any vocabulary
        return int(packed[0]), packed[1], [(int(i), v) for i, v in zip(packed[2:2 + n], packed[2 + n:], strict=True)]

    def first_full_b64(self) -> str | None:
        """``full``: the first output position's log-probabilities over the whole vocabulary, base64 float32
        little-endian (-inf where a probability is 0); None without ``full`` or before the first token."""
        if self.first_full is None:
            return None
        return base64.b64encode(self.first_full.numpy().astype("<f4").tobytes()).decode("ascii")
