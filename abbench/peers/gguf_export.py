"""A llama.cpp ``qwen3moe`` GGUF of the vendored engine's own random weights (``abbench export-gguf``).

Contract
--------
``export_gguf(model, weights, out, dtype, device, tokenizer)`` writes the model the vendored engine builds
for ``--model MODEL --weights random:SEED --dtype DTYPE`` on ``device`` as a GGUF that llama.cpp loads as
architecture ``qwen3moe``, so both engines compute the same model:

* The values come from the engine's own builder (:func:`abbench.engine.models.weights.random_layer`,
  ``random_embed``, ``random_lm_head``: the functions ``random_weights`` builds the engine's model with),
  drawn on ``device`` in ``dtype``. The draws depend on the device type (a CUDA generator is not a CPU one):
  export on the machine and device the engine will run on (``--device cuda`` for the H200 profile).
* Tensors, as llama.cpp's ``convert_hf_to_gguf.py`` writes a ``Qwen3MoeForCausalLM`` (GGUF lists a shape
  innermost first; the numpy shapes below are the engine's nn.Linear layouts):
  ``token_embd`` [V, H], ``output`` [V, H] (left out when the embeddings are tied), ``output_norm`` [H], and per
  layer ``blk.N.attn_norm`` [H], ``attn_q`` [Hq*D, H], ``attn_k``/``attn_v`` [Hkv*D, H], ``attn_output``
  [H, Hq*D], ``attn_q_norm``/``attn_k_norm`` [D], ``ffn_norm`` [H], ``ffn_gate_inp`` [E, H], and the experts
  merged per layer: ``ffn_gate_exps`` = gate_up[:, :I] and ``ffn_up_exps`` = gate_up[:, I:] [E, I, H],
  ``ffn_down_exps`` [E, H, I] (the engine's bank halves, no transpose). No Q/K permutation: Qwen3 uses
  NEOX-style RoPE (rotate_half), which llama.cpp applies to ``qwen3moe``.
* Types: with ``dtype="float32"`` every tensor is F32. With ``"bfloat16"`` the matrices are BF16 (the
  engine's bf16 values, bit for bit); norms and the router stay F32 as ``convert_hf_to_gguf.py`` keeps
  them (1-D tensors and ``ffn_gate_inp``): an exact up-cast of the engine's bf16 values.
* Metadata: ``qwen3moe.*`` (context length, embedding length, block count, heads, KV heads, key/value
  length = head_dim, RoPE base, RMS epsilon, expert count, experts used, expert feed-forward length),
  ``general.file_type`` (ALL_F32 or MOSTLY_BF16), and ``abbench.*`` provenance (model, weights, device,
  dtype, exporter version). llama.cpp's ``qwen3moe`` always renormalises the top-k router weights, so a
  model with ``norm_topk_prob = false`` is refused, as are the hybrid and Qwen4 models (other architectures).
* Tokenizer (:func:`gguf_vocab`): ``tokenizer.ggml.model = gpt2``, ``pre = qwen2`` (the Qwen2/3 pre-token
  regex), one token per embedding row (rows the vocabulary does not use are ``[PAD{i}]``, type UNUSED;
  special tokens CONTROL; others NORMAL), the merges of the harness's tokenizer, ``bos`` and ``padding`` =
  ``<|endoftext|>``, ``eos`` = the model config's EOS, ``add_bos_token = false`` (the harness never adds
  one): the same fields ``convert_hf_to_gguf.py`` writes for Qwen3-MoE (``get_vocab_base`` and
  ``SpecialVocab``).
* Streaming: tensor infos are declared from the shapes alone, then each tensor is drawn, written and freed
  in that order: at most one layer's experts (and the embedding) exist at a time, so the 30 GB
  ``qwen3-30b-a3b-half`` bf16 file needs a few GB of memory. The file is written to ``OUT.partial`` and
  renamed at the end.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EXPORTER_VERSION", "GGUF_ARCH", "TensorPlan", "export_gguf", "gguf_vocab", "tensor_plan"]

GGUF_ARCH = "qwen3moe"
EXPORTER_VERSION = 1
_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: its name, numpy shape and whether it is stored as F32 whatever the file type."""

    name: str
    shape: tuple[int, ...]
    f32: bool


def _check_model(cfg: Any) -> None:
    if cfg.is_hybrid or cfg.is_qwen4:
        raise ValueError(f"model {cfg.name!r} is not a Qwen3-MoE decoder; the GGUF export writes llama.cpp's "
                         "qwen3moe architecture only")
    if not cfg.norm_topk_prob:
        raise ValueError(f"model {cfg.name!r} has norm_topk_prob = false, but llama.cpp's qwen3moe always "
                         "renormalises the top-k router weights: the two engines would compute different models")


def tensor_plan(cfg: Any) -> list[TensorPlan]:
    """Every tensor of the GGUF, in file order."""
    h, d, e, i, v = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    plan = [TensorPlan("token_embd.weight", (v, h), False)]
    for l in range(cfg.num_hidden_layers):
        b = f"blk.{l}."
        plan += [
            TensorPlan(b + "attn_norm.weight", (h,), True),
            TensorPlan(b + "attn_q.weight", (hq * d, h), False),
            TensorPlan(b + "attn_k.weight", (hkv * d, h), False),
            TensorPlan(b + "attn_v.weight", (hkv * d, h), False),
            TensorPlan(b + "attn_output.weight", (h, hq * d), False),
            TensorPlan(b + "attn_q_norm.weight", (d,), True),
            TensorPlan(b + "attn_k_norm.weight", (d,), True),
            TensorPlan(b + "ffn_norm.weight", (h,), True),
            TensorPlan(b + "ffn_gate_inp.weight", (e, h), True),
            TensorPlan(b + "ffn_gate_exps.weight", (e, i, h), False),
            TensorPlan(b + "ffn_up_exps.weight", (e, i, h), False),
            TensorPlan(b + "ffn_down_exps.weight", (e, h, i), False),
        ]
    plan.append(TensorPlan("output_norm.weight", (h,), True))
    if not cfg.tie_word_embeddings:
        plan.append(TensorPlan("output.weight", (v, h), False))
    return plan


def _tensors(cfg: Any, seed: int, device: Any, dtype: Any) -> Iterator[tuple[str, Any]]:
    """(name, torch tensor) in :func:`tensor_plan` order, drawn by the engine's own builder."""
    import torch

    from abbench.engine.models.weights import Draw, random_embed, random_layer, random_lm_head

    draw = Draw(seed, device, dtype)
    yield "token_embd.weight", random_embed(cfg, draw)
    i = cfg.moe_intermediate_size
    for l in range(cfg.num_hidden_layers):
        lw, gate_up, down = random_layer(cfg, draw, l)
        b = f"blk.{l}."
        yield b + "attn_norm.weight", lw.input_norm
        yield b + "attn_q.weight", lw.q_proj
        yield b + "attn_k.weight", lw.k_proj
        yield b + "attn_v.weight", lw.v_proj
        yield b + "attn_output.weight", lw.o_proj
        yield b + "attn_q_norm.weight", lw.q_norm
        yield b + "attn_k_norm.weight", lw.k_norm
        yield b + "ffn_norm.weight", lw.post_norm
        yield b + "ffn_gate_inp.weight", lw.router
        yield b + "ffn_gate_exps.weight", gate_up[:, :i]
        yield b + "ffn_up_exps.weight", gate_up[:, i:]
        yield b + "ffn_down_exps.weight", down
        del lw, gate_up, down
    yield "output_norm.weight", torch.ones(cfg.hidden_size, device=device, dtype=dtype)
    if not cfg.tie_word_embeddings:
        yield "output.weight", random_lm_head(cfg, draw)


def _to_numpy(t: Any, f32: bool) -> np.ndarray:
    """A tensor as the array the GGUF stores: float32, or bf16 bits as uint16."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if f32 or t.dtype == torch.float32:
        return t.to(torch.float32).numpy()
    if t.dtype != torch.bfloat16:
        raise ValueError(f"cannot store a {t.dtype} tensor (float32 or bfloat16 only)")
    return t.view(torch.int16).numpy().view(np.uint16)


def gguf_vocab(tok: Any, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a Hugging Face fast tokenizer for a model of ``vocab_size`` rows, as
    ``convert_hf_to_gguf.py``'s ``get_vocab_base`` + ``SpecialVocab`` write them."""
    from gguf import TokenType

    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)  # token -> id
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())}, the model only {vocab_size} rows")
    reverse = {i: t for t, i in vocab.items()}
    added = tok.added_tokens_decoder  # id -> AddedToken
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            continue
        token = reverse[i]
        if i in added:
            types.append(int(TokenType.CONTROL) if added[i].special else int(TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
        tokens.append(token)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def _special_ids(tok: Any, cfg: Any) -> dict[str, int]:
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    eot = vocab.get("<|endoftext|>")
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else (
        cfg.eos_token_id[0] if cfg.eos_token_id else tok.eos_token_id)
    out = {"eos": int(eos)} if eos is not None else {}
    if eot is not None:
        out["bos"] = out["pad"] = int(eot)
    return out


def default_tokenizer(cfg: Any) -> str:
    """The built-in vocabulary whose ids fit the model: qwen3 (151,936 rows) or qwen3.6 (248,320)."""
    return "qwen3.6" if cfg.vocab_size >= 248_044 else "qwen3"


def _add_metadata(w: Any, cfg: Any, tok: Any, vocab: tuple[list[str], list[int], list[str]], dtype: str,
                  provenance: dict[str, Any]) -> None:
    """The GGUF's key-value header: ``qwen3moe``'s hyperparameters from ``cfg``, the file type, the tokenizer
    (GPT-2 BPE with the qwen2 pre-tokenizer: ``vocab`` is :func:`gguf_vocab`'s tokens, types and merges), the
    special ids, and the ``abbench.*`` provenance keys."""
    import gguf

    tokens, types, merges = vocab
    w.add_name(f"abbench {cfg.name} {provenance['weights']} {dtype}")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType.MOSTLY_BF16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = _special_ids(tok, cfg)
    if "bos" in ids:
        w.add_bos_token_id(ids["bos"])
        w.add_pad_token_id(ids["pad"])
    if "eos" in ids:
        w.add_eos_token_id(ids["eos"])
    w.add_add_bos_token(False)
    for k, v in provenance.items():
        if isinstance(v, int):
            w.add_uint32(f"abbench.{k}", v)
        else:
            w.add_string(f"abbench.{k}", str(v))


def _add_tensor_infos(w: Any, plan: list[TensorPlan], *, bf16: bool) -> None:
    """Every tensor's name, shape and type, in :func:`tensor_plan`'s order (float32, or bf16 stored as uint16)."""
    import gguf

    for tp in plan:
        n = int(np.prod(tp.shape))
        if tp.f32 or not bf16:
            w.add_tensor_info(tp.name, tp.shape, np.dtype(np.float32), n * 4)
        else:
            w.add_tensor_info(tp.name, tp.shape, np.dtype(np.uint16), n * 2, raw_dtype=gguf.GGMLQuantizationType.BF16)


def export_gguf(model: str, out: str | Path, *, weights: str = "random:0", dtype: str = "float32",
                device: str = "cpu", tokenizer: str | None = None, progress=None) -> dict[str, Any]:
    """Write the GGUF (see the module docstring); returns a summary (path, bytes, tensors, seconds, ...)."""
    import gguf
    import torch

    from abbench.engine.config import EngineConfig
    from abbench.tokenizers import load_tokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if not weights.startswith("random:"):
        raise ValueError(f"weights must be 'random:SEED' (the engine's random weights), got {weights!r}")
    ec = EngineConfig(model=model, weights=weights, device=device, dtype=dtype).resolved()
    cfg = ec.model_config()
    _check_model(cfg)
    seed = int(weights.split(":", 1)[1])
    dev = torch.device(device)
    tdtype = getattr(torch, dtype)
    tok_name = tokenizer or default_tokenizer(cfg)
    tok = load_tokenizer(tok_name)
    tokens, types, merges = gguf_vocab(tok, cfg.vocab_size)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    started = time.time()
    w = gguf.GGUFWriter(str(partial), GGUF_ARCH)
    provenance = {"model": cfg.name, "weights": weights, "dtype": dtype, "device": dev.type,
                  "tokenizer": tok_name, "exporter_version": EXPORTER_VERSION}
    _add_metadata(w, cfg, tok, (tokens, types, merges), dtype, provenance)
    plan = tensor_plan(cfg)
    _add_tensor_infos(w, plan, bf16=dtype == "bfloat16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    written = 0
    try:
        with torch.no_grad():
            for tp, (name, t) in zip(plan, _tensors(cfg, seed, dev, tdtype), strict=True):
                if name != tp.name or tuple(t.shape) != tp.shape:
                    raise AssertionError(f"tensor {name} {tuple(t.shape)} does not match the plan's {tp.name} {tp.shape}")
                arr = _to_numpy(t, tp.f32)
                w.write_tensor_data(arr)
                written += arr.nbytes
                if progress is not None:
                    progress(name, arr.nbytes)
                del t, arr
        w.close()
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return {
        "path": str(out),
        "bytes": out.stat().st_size,
        "tensor_bytes": written,
        "tensors": len(plan),
        "architecture": GGUF_ARCH,
        "seconds": round(time.time() - started, 2),
        **provenance,
    }
