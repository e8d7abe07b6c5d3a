"""Other engines as arms on the vendored engine's own weights: llama.cpp (docs/llamacpp.md) and vLLM
(docs/vllm.md).

``gguf_export``: the engine's random weights as a llama.cpp ``qwen3moe`` GGUF (``abbench export-gguf``).
``llamacpp_build``: the recipe that builds ``llama-server`` (CPU or CUDA) from a trimmed source tarball;
``llamacpp_cuda``: what a CUDA build links besides the toolkit (cuBLAS, the driver library) and where the
server finds its CUDA libraries at run time.
``llamacpp_serve``: a profile's launch command: export the GGUF if needed, then exec ``llama-server`` on it.
``vllm_env``: the recipe for vLLM's CPU build in a virtual environment of its own, recorded.
``vllm_serve``: a profile's launch command: write the tiny checkpoint if needed, then exec vLLM's OpenAI
server from that environment.
"""
