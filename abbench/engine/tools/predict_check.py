"""How well the decode prefetch's guess (``Model.predict_experts``: a layer's norm and router applied to the
residual stream one layer early) names the experts the layer then routes to, on the engine's random weights at a
model's full width, for its first layers.

``python -m abbench.engine.tools.predict_check [--model qwen3-30b-a3b] [--layers 8] [--tokens 256] [--batch 8]
[--router-skew 0] [--device cpu] [--dtype bfloat16] [--out JSON]``

The engine itself, built with the first ``--layers`` layers of ``--model`` (a model whose decode guesses:
Qwen3-MoE, the Qwen3.5/3.6 hybrid; the ``random:0`` weights are drawn layer by layer, so a truncated model's
layers are the full model's), prefills ``--tokens`` random token ids as one chunk, and each layer's first half
(``Model.attn_block``) is recorded: the residual stream it hands on (what the decode step hands the guess) and
the experts it routes to. A prefill token's routing is what a decode token at its position would see. Per layer
from the second:

- ``guessed``: the share of a token's k routed experts that ``predict_experts`` names from the layer before's
  stream: what the prefetch would have brought in;
- ``batch_union_guessed``: for ``--batch`` tokens at once (spread over the prompt), the share of the union of
  their experts that the union of their guesses covers (a batched step's copies), with both unions' sizes;
- ``chance``: k / E, what a guess without information names;
- ``previous_token``: the share of a token's experts the token before it routed to (how much the slots keep
  from one step to the next without any guess).

It says how much of a step's misses the prefetch can take off the step's critical path with these weights; the
time it hides depends on the GPU (``gpucheck_batch --decode-prefetch``). Random weights, not a trained model's
routing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from abbench.engine.config import EngineConfig


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a_row & b_row| / k (a, b [T, k] expert ids)."""
    return float((a[:, :, None] == b[:, None, :]).any(-1).float().sum(-1).mean()) / a.shape[1]


def check(model: str, layers: int, tokens: int, batch: int, router_skew: float, device: str, dtype: str,
          seed: int = 1) -> dict:
    from abbench.engine.runtime.engine import Engine

    try:
        mc = EngineConfig(model=model, device=device).resolved().model
    except ValueError as exc:
        raise SystemExit(f"predict_check: {exc}") from None
    layers = min(layers, mc.num_hidden_layers)
    try:
        mc = mc.first_layers(layers, name=mc.name)
        engine = Engine(EngineConfig(model=mc, weights="random:0", device=device, dtype=dtype,
                                     prefill_mode="chunked", chunk_tokens=tokens, max_context=tokens + 8,
                                     bandwidth_probe_bytes=0, router_skew=router_skew, warm_prefill=False,
                                     expert_slots_per_layer=mc.num_experts_per_tok))  # (no decode: few slots)
    except ValueError as exc:  # a model whose first layers alone are no model (Qwen4-Exp's PLE layers)
        raise SystemExit(f"predict_check: {model}'s first {layers} layers: {exc}") from None
    m = engine.model
    if not m.guesses_experts:
        raise SystemExit(f"predict_check: {model}'s decode makes no guess of a layer's experts")
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    first_half = m.attn_block

    def record(layer, x, cache, start):
        out = first_half(layer, x, cache, start)
        seen[layer] = (out[0].detach().clone(), out[3].detach().clone())  # the stream handed on, the experts
        return out

    m.attn_block = record
    ids = torch.randint(0, mc.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    engine.run(ids, 1)
    if sorted(seen) != list(range(layers)):
        raise SystemExit(f"predict_check: the prefill recorded layers {sorted(seen)}, not 0..{layers - 1}")
    k, e_n = mc.num_experts_per_tok, mc.num_experts
    rows = torch.linspace(tokens // 4, tokens - 1, batch).round().long().tolist()  # a batch of tokens, spread out
    out: list[dict] = []
    for layer in range(layers):
        top = seen[layer][1]
        row = {"layer": layer, "previous_token": _overlap(top[:-1], top[1:])}
        if getattr(mc, "layer_types", ()):
            row["kind"] = mc.layer_types[layer]
        if layer:
            guess = m.predict_experts(layer, seen[layer - 1][0])
            got, want = set(guess[rows].flatten().tolist()), set(top[rows].flatten().tolist())
            row.update(guessed=_overlap(guess, top), batch_union=len(want),
                       batch_union_guessed=len(got & want) / len(want), batch_guesses=len(got))
        out.append(row)
    scored = [r for r in out if "guessed" in r]

    def mean(key: str) -> float:
        return sum(r[key] for r in scored) / len(scored) if scored else math.nan

    return {"model": mc.name, "layers": layers, "tokens": tokens, "batch": batch, "router_skew": router_skew,
            "top_k": k, "experts": e_n, "chance": k / e_n, "device": device, "dtype": dtype, "per_layer": out,
            "guessed_mean": mean("guessed"), "batch_union_guessed_mean": mean("batch_union_guessed"),
            "previous_token_mean": sum(r["previous_token"] for r in out) / len(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m abbench.engine.tools.predict_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="the first N layers (default 8)")
    ap.add_argument("--tokens", type=int, default=256,
                    help="prompt tokens, random ids, prefilled as one chunk (a hybrid's: a multiple of 64; "
                    "default 256)")
    ap.add_argument("--batch", type=int, default=8, help="tokens of a batched step for the union figure (default 8)")
    ap.add_argument("--router-skew", type=float, default=0.0, help="the engine's --router-skew (default 0)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's --dtype (default bfloat16, the weights' own)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    rep = check(args.model, args.layers, args.tokens, args.batch, args.router_skew, args.device, args.dtype)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    for r in rep["per_layer"]:
        extra = (f"  guessed {r['guessed']:.3f}  batch of {args.batch}: {r['batch_union_guessed']:.3f} of "
                 f"{r['batch_union']} ({r['batch_guesses']} guessed)") if "guessed" in r else ""
        kind = f" {r['kind']}" if "kind" in r else ""
        print(f"layer {r['layer']:3d}{kind}: previous token {r['previous_token']:.3f}{extra}")
    print(f"{rep['model']}: guessed {rep['guessed_mean']:.3f} of top-{rep['top_k']} (chance {rep['chance']:.3f}); "
          f"a batch of {args.batch}'s union {rep['batch_union_guessed_mean']:.3f}; previous token "
          f"{rep['previous_token_mean']:.3f}; {rep['seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
