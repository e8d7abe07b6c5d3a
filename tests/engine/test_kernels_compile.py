"""Every variant of decode's Triton kernels compiles for the H200 (sm_90) where Triton is installed, GPU or not:
what Triton's interpreter on CPU cannot check (types, branches on compile-time flags, pointer selects, a jitted
function's tuple return), and what compiled Triton decides that the interpreter has no notion of: the layouts
of the experts' weight tiles, one for every way of reading them (a row's sum follows its tile's layout).
Qwen3-30B-A3B's shapes, bfloat16, 8 sequence caches. Skipped without Triton (the CPU build of torch ships none);
`.ci/run` installs Triton 3.6.0 (the device's) last and runs this file."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from abbench.engine.ops import batch_attention as ba  # noqa: E402
from abbench.engine.ops import kernels as dk  # noqa: E402

CASES: list[tuple[str, object, dict, dict]] = []
EXPERTS: dict[tuple[str, bool, bool, bool], tuple[dict, dict]] = {}  # (kernel, fetch, fp8, slot_fp8) -> sig, consts


def comp(fn, sig: dict, consts: dict, label: str) -> None:
    CASES.append((label, fn, sig, consts))


H, I, K, M, E, S = 2048, 768, 8, 8, 128, 38
PP = 64
for fetch, fp8, slot_fp8 in [(False, False, False), (True, False, False), (True, True, False), (True, True, True),
                             (False, False, True)]:
    w = "*fp8e4nv" if slot_fp8 else "*bf16"
    host = "*fp8e4nv" if fp8 else "*bf16"
    comp(dk._gate_up_group, dict(h_ptr="*bf16", w_ptr=w, slots_ptr="*i64", src_ptr="*i32", members_ptr="*i32",
                                 out_ptr="*fp32", host_ptr=host, scale_ptr="*fp32", wscale_ptr="*fp32",
                                 stride_we="i64", stride_wn="i64"),
         dict(H=H, I=I, K=K, M=M, BLOCK_N=4, BLOCK_K=1024, FETCH=fetch, FP8=fp8, SLOT_FP8=slot_fp8, VEC=8),
         f"_gate_up_group fetch={fetch} fp8={fp8} slot_fp8={slot_fp8}")
    comp(dk._down_group, dict(a_ptr="*fp32", w_ptr=w, slots_ptr="*i64", src_ptr="*i32", members_ptr="*i32",
                              y_ptr="*fp32", host_ptr=host, scale_ptr="*fp32", wscale_ptr="*fp32", h_ptr="*bf16",
                              stride_we="i64", stride_wn="i64"),
         dict(H=H, I=I, M=M, BLOCK_N=4, BLOCK_K=1024, FETCH=fetch, FP8=fp8, SLOT_FP8=slot_fp8, VEC=8),
         f"_down_group fetch={fetch} fp8={fp8} slot_fp8={slot_fp8}")
    for label, fn, sig, consts in CASES[-2:]:
        EXPERTS[(fn.__name__, fetch, fp8, slot_fp8)] = sig, consts
for lookup, identity, pp in [(False, False, PP), (True, False, PP), (True, True, PP), (True, False, K)]:
    # (PP = K: one token's step, the grouping sized to its k pairs while M stays the 8 caches')
    comp(dk._group_experts, dict(ids_ptr="*i64", given_src_ptr="*i32", slots_ptr="*i64", src_ptr="*i32",
                                 members_ptr="*i32", tok_counts_ptr="*i64", slot_of_ptr="*i32",
                                 expert_of_ptr="*i32", stamp_ptr="*i64", tick_ptr="*i64", counts_ptr="*i64",
                                 P="i32"),
         dict(K=K, PP=pp, M=M, LOOKUP=lookup, HAS_SRC=False, TOK_COUNTS=lookup, S=E if identity else S,
              SP=E if identity else 64, IDENTITY=identity, STEP=dk.STAMP_STEP, NEVER=dk.STAMP_NEVER),
         f"_group_experts lookup={lookup} identity={identity} pairs={pp}")
comp(dk._group_experts, dict(ids_ptr="*i64", given_src_ptr="*i32", slots_ptr="*i64", src_ptr="*i32",
                             members_ptr="*i32", tok_counts_ptr="*i64", slot_of_ptr="*i64", expert_of_ptr="*i64",
                             stamp_ptr="*i64", tick_ptr="*i64", counts_ptr="*i64", P="i32"),
     dict(K=K, PP=8, M=1, LOOKUP=False, HAS_SRC=True, TOK_COUNTS=False, S=1, SP=1, IDENTITY=False,
          STEP=dk.STAMP_STEP, NEVER=dk.STAMP_NEVER), "_group_experts host src, one token")
comp(dk._combine, dict(y_ptr="*fp32", tw_ptr="*bf16", res_ptr="*bf16", out_ptr="*bf16"),
     dict(H=H, K=K, BLOCK=1024, HAS_RES=True), "_combine")
for lookup in (False, True):
    comp(dk._route_topk, dict(logits_ptr="*bf16", bias_ptr="*fp32", w_ptr="*bf16", ids_ptr="*i64",
                              slot_of_ptr="*i32", expert_of_ptr="*i32", stamp_ptr="*i64", tick_ptr="*i64",
                              counts_ptr="*i64", slots_ptr="*i64", src_ptr="*i32"),
         dict(E=E, EP=128, K=K, KP=8, HAS_BIAS=True, NORM=True, LOOKUP=lookup, S=S, SP=64, IDENTITY=False,
              STEP=dk.STAMP_STEP, NEVER=dk.STAMP_NEVER), f"_route_topk lookup={lookup}")
comp(ba._linear_rows, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", N="i32", stride_xb="i64",
                           stride_wn="i64", stride_ob="i64"), dict(K=H, BLOCK_N=4, BLOCK_K=1024), "_linear_rows")
comp(ba._qk_norm_rope_store_rows, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qn_ptr="*bf16", kn_ptr="*bf16",
                                       cos_ptr="*bf16", sin_ptr="*bf16", pos_ptr="*i64", cidx_ptr="*i64",
                                       kc_ptr="*bf16", vc_ptr="*bf16", qout_ptr="*bf16", stride_kc="i64",
                                       stride_kh="i64", stride_kl="i64", eps="fp32"),
     dict(HQ=32, HKV=4, D=128), "_qk_norm_rope_store_rows")
comp(ba._attn_rows_split, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", cidx_ptr="*i64",
                               plan_ptr="*i32", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", stride_kc="i64",
                               stride_kh="i64", stride_kl="i64", scale="fp32"),
     dict(HKV=4, G=8, GP=16, D=128, MAX_SPLIT=2048, BLOCK_L=64, MAX_SPLITS=64), "_attn_rows_split")
comp(ba._attn_rows_combine, dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", pos_ptr="*i64", plan_ptr="*i32",
                                 out_ptr="*bf16"), dict(HQ=32, HKV=4, G=8, D=128, MAX_SPLITS=64),
     "_attn_rows_combine")

for fp8_math in (False, True):  # the prefill's grouped GEMM over an FP8 layer: weight-only, and FP8 by FP8
    for bm, bn, bk, _, _ in dk.GROUPED_FP8_CONFIGS[:2]:
        comp(dk._grouped_mm_fp8, dict(x_ptr="*fp8e4nv" if fp8_math else "*bf16", xs_ptr="*fp32", q_ptr="*fp8e4nv",
                                      s_ptr="*fp32", offs_ptr="*i32", tiles_ptr="*i32", y_ptr="*bf16", N="i32",
                                      K="i32"),
             dict(G=E, G_POW2=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FP8_MATH=fp8_math),
             f"_grouped_mm_fp8 fp8_math={fp8_math} {bm}x{bn}x{bk}")
comp(dk._quantize_rows_fp8, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K="i32"), dict(BLOCK_K=1024),
     "_quantize_rows_fp8")

@pytest.mark.parametrize("label,fn,sig,consts", CASES, ids=[c[0] for c in CASES])
def test_the_kernel_compiles_for_sm90(label, fn, sig, consts):
    signature = {k: ("constexpr" if k in consts else sig[k]) for k in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"]


def _ttgir(fn, sig: dict, consts: dict) -> str:
    """The kernel's TritonGPU IR for sm_90, its pointers 16-byte aligned and its strides multiples of 16, as the
    launcher specializes them when the engine calls it (the layouts follow from that alignment)."""
    signature = {k: ("constexpr" if k in consts else sig[k]) for k in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in fn.arg_names
             if k not in consts and (sig[k].startswith("*") or k.startswith("stride"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32))
    return kernel.asm["ttgir"]


def _tile_layouts(ttgir: str) -> tuple[set[str], set[str]]:
    """(the layouts of the loads of a [4, 1024] weight tile, the layouts of the float32 products summed along
    its rows) in a TritonGPU module."""
    named = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<[^>]*>)", ttgir, re.M))
    loads = {named[m] for m in re.findall(r"tt\.load .*: tensor<4x1024x!tt\.ptr<\w+>, (#\w+)>", ttgir)}
    products = {named[m] for m in re.findall(r"arith\.mulf .*: tensor<4x1024xf32, (#\w+)>", ttgir)}
    return loads, products


@pytest.mark.parametrize("kernel", ["_gate_up_group", "_down_group"])
def test_every_way_of_reading_the_weights_lays_a_tile_out_alike(kernel):
    """Resident or slot weights in bfloat16, FP8 slots (hits; misses from an FP8 bank), bfloat16 slots filled
    from an FP8 bank: one layout for every weight tile and every product summed along its rows, the bfloat16
    tile's (8 columns a thread). A row's sum follows its layout, so this is what keeps the ways of reading the
    same weights bit for bit alike on a GPU (``test_decode_kernels``' full-width test checks the bits there).
    Before e12fb6e a float8 tile took 16 columns a thread over 2 x 2 warps, against bfloat16's 8 over 1 x 4."""
    want = _tile_layouts(_ttgir(dk.__dict__[kernel], *EXPERTS[(kernel, False, False, False)]))
    assert len(want[0]) == 1 and want[0] == want[1] and "sizePerThread = [1, 8]" in next(iter(want[0]))
    for (name, fetch, fp8, slot_fp8), (sig, consts) in EXPERTS.items():
        if name == kernel:
            assert _tile_layouts(_ttgir(dk.__dict__[kernel], sig, consts)) == want, (fetch, fp8, slot_fp8)
