"""How well the decode prefetch's guess (``Model.predict_experts``: a layer's router applied to the residual
stream one layer early) names the experts the layer then routes to, on the engine's random weights at a model's
full width, for its first layers.

``python -m abbench.engine.tools.predict_check [--model qwen3-30b-a3b] [--layers 8] [--tokens 256] [--batch 8]
[--router-skew 0] [--device cpu] [--out JSON]``

The first ``--layers`` layers of ``--model`` (Qwen3-MoE; the engine's ``random:0`` weights drawn layer by layer, the
same values as the engine's, so a truncated model's layers are the full model's) run ``--tokens`` random token
ids as one causal prefill, in float32 (the weights drawn in the model dtype, bfloat16). A prefill token's routing
is what a decode token at its position would see, so no decode is needed. Per layer from the second:

- ``guessed``: the share of a token's k routed experts that the guess from the layer before (the residual stream
  after that layer's attention, where the decoder makes it) names: what the prefetch would have brought in;
- ``batch_union_guessed``: for ``--batch`` tokens at once (spread over the prompt), the share of the union of
  their experts that the union of their guesses covers (a batched step's copies);
- ``chance``: k / E, what a guess without information names;
- ``previous_token``: the share of a token's experts the token before it routed to (how much the slots keep
  from one step to the next without any guess).

It says how much of a step's misses the prefetch can take off the step's critical path with these weights; the
copy time it hides depends on the GPU (``gpucheck_batch --decode-prefetch``). Random weights, not a trained
model's routing: a trained model's residual stream changes less from layer to layer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from abbench.engine.config import EngineConfig, ModelConfig


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a_row ∩ b_row| / k (a, b [T, k] expert ids)."""
    return float((a[:, :, None] == b[:, None, :]).any(-1).float().sum(-1).mean()) / a.shape[1]


def check(model: str, layers: int, tokens: int, batch: int, router_skew: float, device: str,
          seed: int = 1) -> dict:
    from abbench.engine.models.weights import Draw, random_embed, random_layer
    from abbench.engine.ops.dense import rms_norm, rope_tables, rotate_half
    from abbench.engine.ops.moe import route, router_skew_bias

    cfg = EngineConfig(model=model, weights="random:0", device=device).resolved().model
    if type(cfg) is not ModelConfig:
        raise SystemExit(f"predict_check: {model} is not a Qwen3-MoE model (the prefetch's guess is Qwen3-MoE's)")
    layers = min(layers, cfg.num_hidden_layers)
    dev = torch.device(device)
    draw = Draw(0, dev, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).to(dev)
    x = random_embed(cfg, draw)[ids].float()
    k, e_n, eps = cfg.num_experts_per_tok, cfg.num_experts, cfg.rms_norm_eps
    hq, hkv, d, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.moe_intermediate_size
    cos, sin = rope_tables(d, cfg.rope_theta, tokens, dev, torch.float32)
    rows = torch.linspace(tokens // 4, tokens - 1, batch).round().long().tolist()  # a batch of tokens, spread out
    out: list[dict] = []
    guess = None
    biases = router_skew_bias(e_n, layers, router_skew, 0, dev) if router_skew else None
    drawn = random_layer(cfg, draw, 0)
    for layer in range(layers):
        lw, gate_up, down = drawn
        w = {f: getattr(lw, f).float() for f in ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                   "k_norm", "post_norm", "router")}
        bias = biases[layer] if biases else None
        h = rms_norm(x, w["input_norm"], eps)
        q = rms_norm(F.linear(h, w["q_proj"]).view(tokens, hq, d), w["q_norm"], eps).transpose(0, 1)
        kk = rms_norm(F.linear(h, w["k_proj"]).view(tokens, hkv, d), w["k_norm"], eps).transpose(0, 1)
        v = F.linear(h, w["v_proj"]).view(tokens, hkv, d).transpose(0, 1)
        q, kk = q * cos + rotate_half(q) * sin, kk * cos + rotate_half(kk) * sin
        a = F.scaled_dot_product_attention(q[None], kk[None], v[None], is_causal=True, enable_gqa=hq != hkv)[0]
        x = x + F.linear(a.transpose(0, 1).reshape(tokens, hq * d), w["o_proj"])
        hh = rms_norm(x, w["post_norm"], eps)
        top_w, top = route(hh, w["router"], k, cfg.norm_topk_prob, bias)
        row = {"layer": layer, "previous_token": _overlap(top[:-1], top[1:])}
        if guess is not None:
            got, want = set(guess[rows].flatten().tolist()), set(top[rows].flatten().tolist())
            row.update(guessed=_overlap(guess, top), batch_union=len(want),
                       batch_union_guessed=len(got & want) / len(want), batch_guesses=len(got))
        out.append(row)
        x_mid = x
        if layer + 1 < layers:  # the guess of the next layer's experts, from here (after this attention)
            drawn = random_layer(cfg, draw, layer + 1)
            nxt = drawn[0]
            guess = route(rms_norm(x_mid, nxt.post_norm.float(), eps), nxt.router.float(), k, cfg.norm_topk_prob,
                          biases[layer + 1] if biases else None)[1]
        gu, dn = gate_up.float(), down.float()  # the routed experts, computed: the next layer's input
        y = torch.zeros_like(x)
        for e in top.unique().tolist():
            r, slot = (top == e).nonzero(as_tuple=True)
            act = hh[r] @ gu[e].T
            act = F.silu(act[:, :inter]) * act[:, inter:]
            y.index_add_(0, r, (act @ dn[e].T) * top_w[r, slot, None].float())
        del gu, dn, gate_up, down
        x = x + y
    scored = [r for r in out if "guessed" in r]
    mean = (lambda key: sum(r[key] for r in scored) / len(scored)) if scored else (lambda key: math.nan)
    return {"model": cfg.name, "layers": layers, "tokens": tokens, "batch": batch, "router_skew": router_skew,
            "top_k": k, "experts": e_n, "chance": k / e_n, "device": device, "per_layer": out,
            "guessed_mean": mean("guessed"), "batch_union_guessed_mean": mean("batch_union_guessed"),
            "previous_token_mean": sum(r["previous_token"] for r in out) / len(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m abbench.engine.tools.predict_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="the first N layers (default 8)")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens, random ids (default 256)")
    ap.add_argument("--batch", type=int, default=8, help="tokens of a batched step for the union figure (default 8)")
    ap.add_argument("--router-skew", type=float, default=0.0, help="the engine's --router-skew (default 0)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    rep = check(args.model, args.layers, args.tokens, args.batch, args.router_skew, args.device)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    for r in rep["per_layer"]:
        extra = (f"  guessed {r['guessed']:.3f}  batch of {args.batch}: {r['batch_union_guessed']:.3f} of "
                 f"{r['batch_union']} ({r['batch_guesses']} guessed)") if "guessed" in r else ""
        print(f"layer {r['layer']:3d}: previous token {r['previous_token']:.3f}{extra}")
    print(f"{rep['model']}: guessed {rep['guessed_mean']:.3f} of top-{rep['top_k']} (chance {rep['chance']:.3f}); "
          f"a batch of {args.batch}'s union {rep['batch_union_guessed_mean']:.3f}; previous token "
          f"{rep['previous_token_mean']:.3f}; {rep['seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
