"""Text <-> token ids for Hugging Face tokenizers (`tokenizer.json`) and GGUF files' tokenizers.

`HFTokenizer` implements the `Tokenizer` interface (engine/tokenizers/base.py: encode, decode,
special tokens, stop tokens, render_chat, pickling) over the `tokenizers` library, and renders
the model's own Jinja chat template (engine/tokenizers/chat_template.py). It is built by:

- `HFTokenizer.from_dir(path)`: a Hugging Face directory with tokenizer.json, plus
  tokenizer_config.json (special tokens as strings or AddedToken dicts, added_tokens_decoder,
  chat_template as a string or a list of named templates, split_special_tokens,
  clean_up_tokenization_spaces), special_tokens_map.json (older directories), and
  chat_template.jinja / additional_chat_templates/*.jinja, which win over the config's template.
- `HFTokenizer.from_gguf(path or gguf.GGUFReader)`: the `tokenizer.ggml.*` metadata of a GGUF
  file (engine/tokenizers/gguf_tokenizer.py).

Behaviour follows transformers 5.x (`AutoTokenizer.from_pretrained(dir)`, the reference):
- `encode(text)` is `tokenizer.encode(text, add_special_tokens=False)`: no BOS, and text that
  spells an added token ("<|im_end|>") encodes to that token, as in transformers. (The
  `TiktokenTokenizer` encodes such text as plain text instead; it follows nanochat.)
- `decode(ids)` is `tokenizer.decode(ids)`: special tokens kept, invalid UTF-8 as U+FFFD, the
  "clean_up_tokenization_spaces" rewrite only where transformers applies it (not for BPE).
- `prepend_bos` is True when `tokenizer.encode(text)` (add_special_tokens=True) starts with the
  BOS token (Llama 3 and Llama 2 do; Qwen and SmolLM2 do not). jobs/ prepends `bos_token_id` to
  text prompts when it is set.
- `render_chat(messages)` is `apply_chat_template(messages, add_generation_prompt=True,
  tokenize=True)`: the template's text encoded as by `encode`.

tokenizer.json is used as written. transformers 5 instead rebuilds the pipeline of some
`tokenizer_class`es from the vocabulary (Qwen2Tokenizer, GPT2Tokenizer, LlamaTokenizer); for
files those classes wrote the result is the same (tested for Qwen2Tokenizer and for
LlamaTokenizerFast with a "▁"-metaspace file), but an older SentencePiece file whose normalizer
prepends "▁" (Llama 2 era) can differ from transformers 5 on text that starts with a space
or follows a special token.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from engine.tokenizers.byte_level import UNICODE_TO_BYTE
from engine.tokenizers.chat_template import ChatTemplateError, render_chat_template
from engine.tool_calls import template_reads_tools, with_hermes_system

# decode(): transformers' clean_up_tokenization (applied only to non-BPE models that ask for it)
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the model's special tokens and chat template.

    Build one with `from_dir` or `from_gguf` (or `engine.tokenizers.base.Tokenizer.load`).
    Immutable after construction; pickles by value (Ray ships it to workers).

    Args:
        backend: the tokenizers.Tokenizer, with every added/special token already in it.
        special_tokens_map: template variable -> token text, e.g. {"bos_token": "<s>",
            "eos_token": "</s>"}; "bos_token" and "eos_token" also give bos_token_id and the stop
            token. Each must be a token of `backend`.
        chat_template: the Jinja source, a {name: source} dict (its "default" is used, its
            "tool_use" when tools are given), or None.
        clean_up_tokenization_spaces: transformers' decode() flag (ignored for BPE models, as there).
        name: where it came from, for messages.
        stop_token_ids: the tokens that end generation when a request names none; None: the
            eos token alone. (GGUF files: llama.cpp's end-of-generation set, see
            engine/tokenizers/gguf_tokenizer.py `end_of_generation`.)
    Raises ValueError naming the token for a special token the backend does not know, or a
    post-processor that puts something other than the BOS token before the text.
    """

    def __init__(self, backend: Backend, *, special_tokens_map: Mapping[str, str],
                 chat_template: str | Mapping[str, str] | None = None,
                 clean_up_tokenization_spaces: bool = False, name: str = "tokenizer.json",
                 stop_token_ids: Any = None):
        self.backend = backend
        self.name = name
        self._map = {k: v for k, v in special_tokens_map.items() if v is not None}
        for key, text in self._map.items():
            if backend.token_to_id(text) is None:
                raise ValueError(f"{name}: {key} {text!r} is not a token of the tokenizer")
        self._template_source = chat_template
        self._template = chat_template.get("default") if isinstance(chat_template, Mapping) else chat_template
        self._cleanup = bool(clean_up_tokenization_spaces) and type(backend.model).__name__ != "BPE"
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._gaps = len(set(vocab.values())) != self._vocab_size  # ids without a token
        added = backend.get_added_tokens_decoder()
        self._specials = {tok.content: i for i, tok in sorted(added.items()) if tok.special}
        self._bos = self._id("bos_token")
        self._eos = self._id("eos_token")
        self._stops = None if stop_token_ids is None else tuple(int(i) for i in stop_token_ids)
        self._prepend_bos = self._probe_bos()
        decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
        self._byte_level = '"ByteLevel"' in decoder
        self._byte_fallback = '"ByteFallback"' in decoder

    def _id(self, key: str) -> int | None:
        text = self._map.get(key)
        return None if text is None else self.backend.token_to_id(text)

    def _probe_bos(self) -> bool:
        """Whether encode with add_special_tokens=True puts exactly the BOS token before the text."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        n = len(full) - len(plain)
        prefix = next((full[:k] for k in range(n + 1) if full[k:k + len(plain)] == plain), None)
        if not prefix:
            return False
        if prefix != [self._bos]:
            raise ValueError(f"{self.name}: the post-processor puts token(s) {prefix} before the text, which is not "
                             f"the bos_token ({self._map.get('bos_token')!r} = {self._bos}); not supported")
        return True

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self._map.get('bos_token')!r}, "
                f"eos={self._map.get('eos_token')!r}, chat={self.has_chat_format})")

    def __reduce__(self):
        return (_restore, (self.backend.to_str(), dict(self._map), self._template_source, self._cleanup, self.name,
                           self._stops))

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer":
        """A Hugging Face tokenizer directory (see the module docstring for the files read).

        Raises FileNotFoundError when tokenizer.json is missing, ValueError naming the file and
        key for malformed JSON or token entries.
        """
        from engine.tokenizers.hf_tokenizer_dir import read_tokenizer_dir

        return read_tokenizer_dir(Path(path), cls)

    @classmethod
    def from_gguf(cls, source: Any) -> "HFTokenizer":
        """The tokenizer a GGUF file describes; `source` is a path or an open gguf.GGUFReader
        (so a model loader can share one reader). See engine/tokenizers/gguf_tokenizer.py for what is
        supported; anything else raises ValueError naming the key and value."""
        from engine.tokenizers.gguf_tokenizer import build_gguf_tokenizer

        return build_gguf_tokenizer(source, cls)

    # ------------------------------------------------------------------ API
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (max id + 1)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """The id of tokenizer_config's bos_token (None without one)."""
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config's eos_token (None without one)."""
        return self._eos

    @property
    def prepend_bos(self) -> bool:
        """True when transformers' encode(text) puts the BOS token before text (jobs' text prompts)."""
        return self._prepend_bos

    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        """The stop tokens given at construction (a GGUF file's end-of-generation set), else
        (eos_token_id,), or () without an eos token. The model's config may add more."""
        if self._stops is not None:
            return self._stops
        return () if self._eos is None else (self._eos,)

    @property
    def has_chat_format(self) -> bool:
        """True when there is a chat template to render."""
        return self._template is not None

    @property
    def chat_template(self) -> str | None:
        """The Jinja source render_chat uses (None without one)."""
        return self._template

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special added tokens (text -> id; a copy)."""
        return dict(self._specials)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The template's token variables, e.g. {"bos_token": "<s>", "eos_token": "</s>"} (a copy)."""
        return dict(self._map)

    def special(self, name: str) -> int | None:
        """The id of special token `name` (e.g. "<|im_end|>"), None if it is not a special token."""
        return self._specials.get(name)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS (transformers' encode(text, add_special_tokens=False)).
        Added tokens spelled in the text become those tokens. Raises TypeError if `text` is not a str."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, as transformers' decode(ids): special tokens kept, bytes that are not
        valid UTF-8 as U+FFFD. Raises ValueError naming an id outside the vocabulary."""
        try:
            ids = [operator.index(i) for i in ids]
        except TypeError:
            raise ValueError(f"cannot decode {list(ids)[:5]}: token ids must be integers") from None
        n = self._vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if self._gaps and not bad:
            bad = [i for i in ids if self.backend.id_to_token(i) is None]
        if bad:
            raise ValueError(f"cannot decode token id(s) {bad[:5]}: not in the vocabulary of {self.name} "
                             f"(size {self._vocab_size})")
        text = self.backend.decode(ids, skip_special_tokens=False)
        if self._cleanup:
            for a, b in _CLEANUP:
                text = text.replace(a, b)
        return text

    def decode_token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token as it appears inside a sequence (for streaming UTF-8
        assembly and stop strings), as `decode` renders it there, added tokens too (the
        `tokenizers` decoder treats them as any token): <0xNN> byte-fallback tokens as that
        byte; byte-level tokens mapped back to bytes, or as their UTF-8 text when a character
        is outside the byte-level alphabet ("<｜User｜>"); otherwise SentencePiece's "▁" as a
        space (CodeLlama's added "▁<EOT>" decodes as " <EOT>"). Only `decode`'s strip of the
        sample's first space is not applied.
        Raises ValueError for an id outside the vocabulary."""
        text = self.backend.id_to_token(token) if isinstance(token, int) and token >= 0 else None
        if text is None:
            raise ValueError(f"token id {token!r} is not in the vocabulary of {self.name}")
        if self._byte_fallback and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        if self._byte_level:
            table = UNICODE_TO_BYTE
            if all(c in table for c in text):
                return bytes(table[c] for c in text)
            return text.encode("utf-8")
        return text.replace("\u2581", " ").encode("utf-8")

    def render_chat(self, messages: list[dict], *, date: Any = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids priming the assistant's reply: the model's chat template rendered with
        add_generation_prompt=True, then encoded (transformers' apply_chat_template(messages,
        add_generation_prompt=True, tokenize=True, tools=tools)).

        messages: [{"role": ..., "content": ...}, ...]; the template decides what it accepts.
        date: the day the template's `strftime_now` sees (a date or "YYYY-MM-DD"; None: now,
        in UTC; engine/tokenizers/chat_template.py says why).
        tools: JSON schemas of the tools the model may call ({"type": "function", "function":
        {...}}), handed to the template as `tools`; the tokenizer's "tool_use" template renders
        them when it has one (transformers and llama.cpp pick it for tools). A template that
        never reads `tools` (SmolLM2's) gets them as Hermes's tool block in the system message
        instead (engine/tool_calls.py `with_hermes_system`).
        Raises ValueError: the template's own message when it raises (e.g. roles that do not
        alternate), a Jinja error, or "... has no chat template ..." without a template.
        """
        return self.encode(self.render_chat_text(messages, date=date, tools=tools))

    def render_chat_text(self, messages: list[dict], *, add_generation_prompt: bool = True, date: Any = None,
                         tools: list[dict] | None = None) -> str:
        """The text `render_chat` encodes (add_generation_prompt: end with the assistant's
        header). Raises as render_chat."""
        template = self._template
        if tools and isinstance(self._template_source, Mapping) and "tool_use" in self._template_source:
            template = self._template_source["tool_use"]  # transformers' get_chat_template (llama.cpp too)
        if template is None:
            names = sorted(self._template_source) if isinstance(self._template_source, Mapping) else None
            raise ValueError(f"tokenizer {self.name} has no chat template"
                             + (f" named 'default' (it has {names})" if names else "")
                             + "; send token ids or plain text prompts instead")
        if tools and not template_reads_tools(template):
            messages, tools = with_hermes_system(messages, tools), None
        return render_chat_template(template, messages, self._map, add_generation_prompt=add_generation_prompt,
                                    date=date, tools=tools or None)


def _restore(backend_json: str, special_tokens_map: dict, chat_template: Any, cleanup: bool, name: str,
             stop_token_ids: tuple[int, ...] | None = None) -> HFTokenizer:
    # `cleanup` is the effective flag (already False for BPE), so passing it back is exact.
    return HFTokenizer(Backend.from_str(backend_json), special_tokens_map=special_tokens_map,
                       chat_template=chat_template, clean_up_tokenization_spaces=cleanup, name=name,
                       stop_token_ids=stop_token_ids)


__all__ = ["HFTokenizer", "ChatTemplateError"]
