"""Random transformers checkpoints for the hybrid families' reference tests (Qwen3.5-MoE, Qwen4-Exp)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_hybrid(model_cls, cfg, tmp: Path, seed: int = 0, unit: tuple[str, ...] = ("embed_tokens",)):
    """``model_cls(cfg)`` with every tensor redrawn so that it matters, saved with save_pretrained into
    ``tmp``: matrices N(0, 1/fan_in), tensors whose name contains one of ``unit`` (embeddings, PLE tables)
    N(0, 1), convs N(0, 0.25), zero-centred norm weights N(0, 0.2^2), the gated norm and dt_bias
    1 + N(0, 0.2^2), A_log = log U(1, 16)."""
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif p.dim() == 1:
                centre = 1.0 if ("linear_attn.norm" in name or "dt_bias" in name) else 0.0
                p.copy_(centre + 0.2 * torch.randn_like(p))
            elif any(u in name for u in unit):
                p.normal_(0, 1.0)
            elif "conv1d" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(tmp)
    return model
