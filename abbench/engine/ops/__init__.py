"""Ops: the tensor functions the models are built from, no model and no state. ``dense`` (norms, RoPE, masks,
attention), ``moe`` (router, grouped-GEMM experts), ``kernels`` (decode's Triton kernels), ``gdn`` (the gated
delta rule), ``sampling`` (a token from logits), ``trace`` (the layer trace's entries).
"""
