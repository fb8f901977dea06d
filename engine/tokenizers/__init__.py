"""Text <-> token ids: one `Tokenizer` interface, the tokenizers behind it, chat templates and
stop strings.

- base.py: the `Tokenizer` interface, and `Tokenizer.load`, `demo`, `find_nanochat`.
- loader.py: which tokenizer a path holds (the dispatch behind `Tokenizer.load`).
- tiktoken_tokenizer.py: `TiktokenTokenizer` (GPT-2 files, .tiktoken ranks, nanochat's
  tokenizer.pkl, the demo tokenizer); nanochat_chat.py: nanochat's chat layout.
- hf_tokenizer.py: `HFTokenizer` over Hugging Face `tokenizers`, built from a tokenizer.json
  directory (hf_tokenizer_dir.py) or a GGUF file's vocabulary (gguf_tokenizer.py);
  chat_template.py: a model's Jinja chat template.
- byte_level.py: GPT-2's byte-level alphabet, shared by all three.
- stop_strings.py: stop strings matched on token bytes, a sample's text.

Imports nothing from the rest of the engine. Inside this package `import tokenizers` /
`from tokenizers import ...` is absolute: it is Hugging Face's `tokenizers` library, never
this package.
"""
