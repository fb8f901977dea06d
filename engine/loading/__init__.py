"""Finding out what a checkpoint path holds, reading it, and building its model.

- errors.py: `CheckpointError` and `check_keys`, at the bottom: the readers import it, it
  imports nothing.
- checkpoint.py: format detection (built-in names, GGUF, Hugging Face, nanochat), device and
  dtype; `load_checkpoint` (model and tokenizer) and `load_model`.
- builtin.py: the built-in names `smollm2` and `tiny-random` (no torch: jobs/ reads it).
- hf_weights.py, hf_config.py: a Hugging Face directory's weights, and its config.json parsed
  into the config a model is built from.
- gpt2.py, llama.py, nanochat.py: one builder per model family (engine/models/), from a
  checkpoint's tensors; nanochat.py also builds `tiny-random`.
- gguf.py, gguf_config.py, gguf_rope.py: llama.cpp GGUF files (tensors, metadata, llama3 rope).
- weight_swap.py: another checkpoint's weights into a loaded model, in place.

Imports models/, tokenizers/ and kernels/; never the step loop (engine.engine, which imports
loading/ lazily to load a checkpoint, the scheduler, sequences, sampling).
"""
