"""Finding out what a checkpoint path holds, reading it, and building its model.

- errors.py: `CheckpointError` and `check_keys`, at the bottom: every reader imports it.
- checkpoint.py: format detection (built-in names, GGUF, Hugging Face, nanochat), device and
  dtype; `load_checkpoint` (model and tokenizer) and `load_model`.
- builtin.py: the built-in names `smollm2` and `tiny-random` (no torch: jobs/ reads it).
- hf_config.py, hf_weights.py: a Hugging Face directory's config.json and weights.
- gguf.py, gguf_rope.py: llama.cpp GGUF files.
- weight_swap.py: another checkpoint's weights into a loaded model, in place.

Imports models/, tokenizers/ and kernels/; never the step loop (engine.engine, the
scheduler, the KV cache), which imports it lazily to load.
"""
