"""Text <-> token ids: the tokenizers of every checkpoint format, chat templates and stop strings.

Inside this package `import tokenizers` / `from tokenizers import ...` is absolute: it is
Hugging Face's `tokenizers` library, never this package.
"""
