"""The compiled CPU kernels and the attention that runs on them.

- native.py, csrc/: the compiled CPU library (GEMM, prefill and decode attention, a Llama
  layer's fused operations, the sampler's passes over the vocabulary) and its binding, built
  on first use for the CPU's instruction set.
- kv_layout.py: where each row of a step keeps its keys and values in the KV arena, and how
  its attention is grouped.
- attention.py: attention on CPU (the compiled kernel, torch's CPU flash kernel as its
  fallback, batch-invariant) and the log-sum-exp merge of parts; batched_attention.py: the
  decode GPUs run (plain tensor ops, a fixed number of calls per step).
- attention_backend.py: which of them a KV cache runs, chosen once when the cache is made.

Imports nothing from the rest of the engine (models, loading, tokenizers, the step loop).
"""
