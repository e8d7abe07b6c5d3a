"""The model families, one file each (``qwen3_moe``, ``hybrid``: Qwen3.5/3.6-MoE, ``qwen4``: Qwen4-Exp), their
weights (``weights``, ``qwen4_weights``), the host expert bank (``bank``) and ``factory`` (the model and cache
for a config). Built on :mod:`abbench.engine.ops`; nothing of the runtime.
"""
