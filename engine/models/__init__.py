"""The architectures, forward pass only: one file per family (gpt2.py, llama.py, nanochat.py),
the `CausalLM` interface and the projections every family shares (base.py), and what the Llama
family shares (layers.py: RMSNorm, rotary embeddings, SwiGLU).

Reading checkpoints and building these models from them is engine/loading/'s work: models/
imports nothing from it, nor from tokenizers/ or the step loop. A model attends through the
KV cache it is handed (engine/kv_cache.py) and runs the compiled kernels (engine/kernels/).
"""
