"""Device self-checks and what only they and the tests use: ``gpucheck`` (Qwen3-MoE at full width),
``gpucheck_hybrid`` (the hybrids), ``gpucheck_decode_kernels`` (each decode kernel against torch's),
``gpucheck_policy`` (auto prefill's crossover). Nothing of the runtime imports them.
"""
