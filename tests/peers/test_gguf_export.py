"""The GGUF exporter (abbench/peers/gguf_export.py): read back with gguf's own reader, every tensor has the
name, GGML shape, type and values llama.cpp's qwen3moe loader expects, equal to the weights the vendored
engine builds; the metadata and the tokenizer are what convert_hf_to_gguf.py writes for Qwen3-MoE.

The model is a Qwen3-MoE shape whose every dimension differs (hidden 80, head_dim 16, 4 query / 2 KV heads,
expert FFN 48, 12 experts top-3), so no transpose or swapped dimension can pass by coincidence."""

from __future__ import annotations

import json
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf", reason="the GGUF exporter needs the gguf package (pip install 'abbench[peer]')")

from abbench.engine.config import EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.models.bank import ExpertBank  # noqa: E402
from abbench.engine.models.weights import random_weights  # noqa: E402
from abbench.peers.gguf_export import export_gguf, gguf_vocab, tensor_plan  # noqa: E402
from abbench.tokenizers import load_tokenizer  # noqa: E402

H, D, HQ, HKV, I, E, K, LAYERS = 80, 16, 4, 2, 48, 12, 3, 2
CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": H, "num_hidden_layers": LAYERS,
    "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "moe_intermediate_size": I,
    "num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
    "rope_theta": 250000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "eos_token_id": 151645, "intermediate_size": 96,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("shape")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def _export(model_dir: Path, tmp: Path, dtype: str) -> Path:
    out = tmp / f"m-{dtype}.gguf"
    summary = export_gguf(str(model_dir), out, weights="random:7", dtype=dtype)
    assert summary["tensors"] == 3 + 12 * LAYERS and out.stat().st_size == summary["bytes"]
    assert not out.with_name(out.name + ".partial").exists()
    return out


@pytest.fixture(scope="module")
def f32_file(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(model_dir, tmp_path_factory.mktemp("f32"), "float32")


@pytest.fixture(scope="module")
def bf16_file(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(model_dir, tmp_path_factory.mktemp("bf16"), "bfloat16")


_READERS: dict[Path, object] = {}


def _reader(path: Path):
    """gguf.GGUFReader of ``path``, parsed once, over the file's bytes read into memory: the reader's own parsing
    of the same bytes, where np.memmap's Python hooks on each of the ~1.5M slices it takes of 300K vocabulary
    strings made a parse take ~7.5 s instead of ~2 s."""
    if path not in _READERS:
        in_memory = types.ModuleType("numpy")  # numpy as gguf_reader sees it, np.memmap reading the whole file
        in_memory.__getattr__ = lambda name: getattr(np, name)  # type: ignore[method-assign]
        in_memory.memmap = lambda file, mode="r": np.fromfile(file, dtype=np.uint8)  # type: ignore[attr-defined]
        with mock.patch.object(gguf.gguf_reader, "np", in_memory):
            _READERS[path] = gguf.GGUFReader(str(path))
    return _READERS[path]


def _engine_tensors(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The engine's own weights (random_weights into an ExpertBank), under the GGUF names they must have."""
    cfg = EngineConfig(model=str(model_dir), weights="random:7").resolved().model_config()
    bank = ExpertBank(cfg, dtype, pin=False)
    w = random_weights(cfg, 7, bank, torch.device("cpu"), dtype)
    out = {"token_embd.weight": w.embed, "output.weight": w.lm_head, "output_norm.weight": w.norm}
    for l, lw in enumerate(w.layers):
        b = f"blk.{l}."
        out.update({
            b + "attn_norm.weight": lw.input_norm, b + "attn_q.weight": lw.q_proj, b + "attn_k.weight": lw.k_proj,
            b + "attn_v.weight": lw.v_proj, b + "attn_output.weight": lw.o_proj, b + "attn_q_norm.weight": lw.q_norm,
            b + "attn_k_norm.weight": lw.k_norm, b + "ffn_norm.weight": lw.post_norm,
            b + "ffn_gate_inp.weight": lw.router,
            b + "ffn_gate_exps.weight": bank.gate_up[l][:, :I], b + "ffn_up_exps.weight": bank.gate_up[l][:, I:],
            b + "ffn_down_exps.weight": bank.down[l],
        })
    return out


# llama.cpp's qwen3moe loader (src/models/qwen3moe.cpp, create_tensor): GGML ne, innermost first.
def _expected_ne(name: str) -> list[int]:
    v = CONFIG["vocab_size"]
    if name in ("token_embd.weight", "output.weight"):
        return [H, v]
    if name == "output_norm.weight":
        return [H]
    kind = name.split(".")[2]
    return {
        "attn_norm": [H], "attn_q": [H, HQ * D], "attn_k": [H, HKV * D], "attn_v": [H, HKV * D],
        "attn_output": [HQ * D, H], "attn_q_norm": [D], "attn_k_norm": [D], "ffn_norm": [H],
        "ffn_gate_inp": [H, E], "ffn_gate_exps": [H, I, E], "ffn_up_exps": [H, I, E], "ffn_down_exps": [I, H, E],
    }[kind]


def _values(t) -> np.ndarray:  # a ReaderTensor as float32 in numpy layout (outermost first)
    shape = [int(x) for x in reversed(t.shape)]
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        bits = np.asarray(t.data).view(np.uint16).reshape(shape).astype(np.uint32) << 16
        return bits.view(np.float32)
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    return np.asarray(t.data, dtype=np.float32).reshape(shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tensor_is_the_engines_weight_in_llamacpps_layout(dtype: str, model_dir: Path, f32_file: Path,
                                                               bf16_file: Path) -> None:
    path = f32_file if dtype == "float32" else bf16_file
    tdtype = getattr(torch, dtype)
    engine = _engine_tensors(model_dir, tdtype)
    reader = _reader(path)
    names = [t.name for t in reader.tensors]
    assert sorted(names) == sorted(engine), "the GGUF holds exactly the engine's tensors"
    assert names == [tp.name for tp in tensor_plan(EngineConfig(model=str(model_dir)).model_config())]
    for t in reader.tensors:
        assert [int(x) for x in t.shape] == _expected_ne(t.name), t.name
        f32_kept = t.name.endswith("norm.weight") or "ffn_gate_inp" in t.name
        want_type = (gguf.GGMLQuantizationType.F32 if dtype == "float32" or f32_kept
                     else gguf.GGMLQuantizationType.BF16)
        assert t.tensor_type == want_type, t.name
        ref = engine[t.name].float().numpy()
        got = _values(t)
        assert got.shape == ref.shape, t.name
        assert np.array_equal(got, ref), f"{t.name}: values differ from the engine's"
    # the check would see a transpose: gate and up are different draws, and no matrix is symmetric here
    assert not np.array_equal(engine["blk.0.ffn_gate_exps.weight"].float().numpy(),
                              engine["blk.0.ffn_up_exps.weight"].float().numpy())


def test_metadata_is_qwen3moe_with_the_engines_shape(f32_file: Path, bf16_file: Path) -> None:
    for path, file_type in ((f32_file, gguf.LlamaFileType.ALL_F32), (bf16_file, gguf.LlamaFileType.MOSTLY_BF16)):
        f = {k: v.contents() for k, v in _reader(path).fields.items()
             if not k.startswith("tokenizer.ggml.") or k.endswith(("_id", "model", "pre", "add_bos_token"))}
        arch = "qwen3moe"
        assert f["general.architecture"] == arch
        assert f["general.file_type"] == int(file_type)
        assert f[f"{arch}.block_count"] == LAYERS
        assert f[f"{arch}.context_length"] == CONFIG["max_position_embeddings"]
        assert f[f"{arch}.embedding_length"] == H
        assert f[f"{arch}.attention.head_count"] == HQ
        assert f[f"{arch}.attention.head_count_kv"] == HKV
        assert f[f"{arch}.attention.key_length"] == D and f[f"{arch}.attention.value_length"] == D
        assert f[f"{arch}.rope.freq_base"] == pytest.approx(CONFIG["rope_theta"])
        assert f[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(CONFIG["rms_norm_eps"])
        assert f[f"{arch}.expert_count"] == E
        assert f[f"{arch}.expert_used_count"] == K
        assert f[f"{arch}.expert_feed_forward_length"] == I
        assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "qwen2"
        assert f["tokenizer.ggml.bos_token_id"] == 151643 and f["tokenizer.ggml.padding_token_id"] == 151643
        assert f["tokenizer.ggml.eos_token_id"] == CONFIG["eos_token_id"]
        assert f["tokenizer.ggml.add_bos_token"] is False
        assert f["abbench.weights"] == "random:7" and f["abbench.device"] == "cpu"
        assert f["abbench.dtype"] == ("float32" if file_type == gguf.LlamaFileType.ALL_F32 else "bfloat16")


def test_tokenizer_is_the_harness_tokenizer(f32_file: Path) -> None:
    """Tokens, types and merges in the file equal the harness's qwen3 tokenizer (what its prompts are built
    with), and every multi-byte token has a merge: llama.cpp's BPE (no ignore_merges for qwen2) can reach it."""
    tok = load_tokenizer("qwen3")
    fields = _reader(f32_file).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    assert len(tokens) == len(types) == CONFIG["vocab_size"]
    for token, i in vocab.items():
        assert tokens[i] == token
    known = set(vocab.values())
    unused = [i for i in range(len(tokens)) if i not in known]
    assert unused == list(range(len(vocab), CONFIG["vocab_size"]))  # the model's padded rows
    assert all(tokens[i] == f"[PAD{i}]" and types[i] == gguf.TokenType.UNUSED for i in unused)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL} == special
    assert {tokens[i] for i in special} >= {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert sum(1 for t in types if t == gguf.TokenType.NORMAL) == len(vocab) - len(special)
    hf_merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert merges == [m if isinstance(m, str) else " ".join(m) for m in hf_merges]
    byte_level = [t for t, i in vocab.items() if i not in special]
    assert len(merges) == sum(1 for t in byte_level if len(t) > 1)  # 151,387: one per multi-byte token
    for m in merges[:2000]:  # each merge joins two tokens into a token
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab


def test_gguf_vocab_refuses_a_model_smaller_than_the_tokenizer() -> None:
    with pytest.raises(ValueError, match="only 1000 rows"):
        gguf_vocab(load_tokenizer("qwen3"), 1000)


def test_models_llamacpp_would_compute_differently_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "nonorm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, "norm_topk_prob": False}))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        export_gguf(str(d), tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="qwen3moe architecture only"):
        export_gguf("qwen3.5-tiny", tmp_path / "y.gguf")
    with pytest.raises(ValueError, match="random:SEED"):
        export_gguf("tiny", tmp_path / "z.gguf", weights=str(tmp_path))
    assert not list(tmp_path.glob("*.gguf*"))
    assert isinstance(ModelConfig.from_hf_config(d), ModelConfig)  # the config itself is a valid engine model


def test_cli_export_gguf(tmp_path: Path, model_dir: Path, f32_file: Path) -> None:
    """`abbench export-gguf` writes the same file as the function (byte for byte)."""
    from typer.testing import CliRunner

    from abbench.cli import app

    out = tmp_path / "cli.gguf"
    r = CliRunner().invoke(app, ["export-gguf", "--model", str(model_dir), "--weights", "random:7",
                                 "--dtype", "float32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == f32_file.read_bytes()
    bad = CliRunner().invoke(app, ["export-gguf", "--model", "qwen3.5-tiny", "--out", str(tmp_path / "h.gguf")])
    assert bad.exit_code == 2 and "qwen3moe" in bad.output
