"""The tokenizer a GGUF file describes, from its `tokenizer.ggml.*` metadata (llama.cpp's keys),
read with the `gguf` package (ggml-org's GGUFReader), as an HFTokenizer.

Sources: llama.cpp (src/llama-vocab.cpp: the token types and the `tokenizer.ggml.pre` names) and
transformers 5.x's GGUF tokenizer (integrations/gguf/gguf_tokenizer_mapping.py), the reference
the tests compare with.

Keys read: `tokenizer.ggml.model`, `.pre`, `.tokens`, `.token_type`, `.merges`, `.scores`,
`.bos_token_id`, `.eos_token_id`, `.unknown_token_id`, `.padding_token_id`, `.add_bos_token`,
`.add_space_prefix`, and `tokenizer.chat_template`.

Tokenizer models (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2, ...). Tokens outside the byte-level
  alphabet are respelled from their UTF-8 bytes; text is split by the pre-tokenizer that
  `tokenizer.ggml.pre` names (PRE_TOKENIZERS; a name not there is a load error naming it).
- "llama": SentencePiece BPE with byte fallback (Llama 2, TinyLlama, Mistral v0.1): merges from
  the file or, as transformers does, from the scores (a merge ranks by its result's score, then
  the longer left part, then the longer right part); "▁" prefixed to the start of the text.
  Files whose architecture has its own SentencePiece variant in transformers (gemma*, phi3) are
  refused.
Anything else is a load error naming the model.

Token types: CONTROL (3) tokens become special added tokens (skipped in byte-level vocabularies
when they are not spelled in the byte alphabet: llama.cpp mislabels), USER_DEFINED (4) become
plain added tokens; both encode whole when the text spells them. The BOS/EOS/unknown/padding
tokens are the template's `bos_token`, `eos_token`, `unk_token`, `pad_token`. BOS goes before
text prompts when `tokenizer.ggml.add_bos_token` is true (default: false for "gpt2", true for
"llama").

Where the two references differ, this follows llama.cpp, the format's owner:
- "smollm" splits digits one by one before GPT-2's split, as llama.cpp and SmolLM2's own
  tokenizer.json do; transformers 5.x uses GPT-2's split alone, which differs on runs of
  whitespace before a digit ("a  1": llama.cpp a|ĠĠ|1, transformers a|Ġ|Ġ|1). Other texts are
  identical (SmolLM2's vocabulary has no token joining a digit to anything).
- "llama" honours `add_space_prefix = false` (no "▁" before the text); transformers ignores it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from engine.tokenizers.byte_level import byte_to_unicode

# llama.cpp token types (llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split patterns (llama.cpp's regexes; transformers' spelling).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = "gpt2"            # GPT-2's own split (the ByteLevel pre-tokenizer's regex)
DIGITS_GPT2 = "digits"   # each digit alone, then GPT-2's split

# tokenizer.ggml.pre -> how byte-level BPE splits text before merging
PRE_TOKENIZERS: dict[str, str] = {
    "default": GPT2, "gpt-2": GPT2,
    "smollm": DIGITS_GPT2,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
    "tekken": TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), GPT4O_SPLIT),
}
# architectures whose "llama" (SentencePiece) vocabulary transformers builds differently
_OWN_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


class _Metadata:
    """Typed access to one GGUF file's metadata; errors name the file and key."""

    def __init__(self, reader: Any, where: str):
        self.reader, self.where = reader, where

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{self.where}: metadata {key} cannot be read ({e})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.where}: metadata {key} is missing (needed to build the tokenizer)")
        return value


def _open(source: Any) -> tuple[Any, str]:
    if isinstance(source, (str, Path)):
        import gguf

        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        try:
            return gguf.GGUFReader(str(path)), str(path)
        except Exception as e:  # noqa: BLE001 - the reader raises ValueError/struct.error/... on a bad file
            raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return source, str(getattr(getattr(source, "data", None), "filename", None) or "GGUF file")


def _byte_level_pre_tokenizer(pre: str, where: str) -> Any:
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{where}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer batchgen knows; known: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    kind = PRE_TOKENIZERS[pre]
    if kind == GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == DIGITS_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _merges(meta: _Metadata) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    out = []
    for i, m in enumerate(raw):
        parts = m.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"{meta.where}: tokenizer.ggml.merges[{i}] is {m!r}, expected 'left right'")
        out.append((parts[0], parts[1]))
    return out


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    ranked by the token's score (highest first), then longer left part, then longer right part,
    then vocabulary order (the order transformers' `generate_merges` gives)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for order, (token, score) in enumerate(dict(zip(tokens, scores)).items()):
        splits = sorted((vocab[token[:k]], vocab[token[k:]], token[:k], token[k:]) for k in range(1, len(token))
                        if token[:k] in vocab and token[k:] in vocab)
        for j, (_, _, left, right) in enumerate(splits):
            ranked.append((-score, -len(left), -len(right), order, j, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_level_backend(meta: _Metadata, tokens: list[str]) -> tuple[Backend, bool]:
    alphabet = set(byte_to_unicode().values())
    table = byte_to_unicode()
    vocab = {t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    merges = _merges(meta)
    if merges is None:
        raise ValueError(f"{meta.where}: metadata tokenizer.ggml.merges is missing (a 'gpt2' tokenizer needs it)")
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default", meta.where)
    backend.decoder = decoders.ByteLevel()
    if "<|endoftext|>" in vocab:  # transformers' GPT2Tokenizer makes its default special token one
        backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return backend, bool(meta.get("tokenizer.ggml.add_bos_token", False))


def _sentencepiece_backend(meta: _Metadata, tokens: list[str]) -> tuple[Backend, bool]:
    merges = _merges(meta)
    if merges is None:
        scores = meta.require("tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ValueError(f"{meta.where}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        merges = sentencepiece_merges(tokens, [float(s) for s in scores])
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, bool(meta.get("tokenizer.ggml.add_bos_token", True))


def build_gguf_tokenizer(source: Any, cls: type) -> Any:
    """An HFTokenizer (`cls`) from a GGUF path or open gguf.GGUFReader (see the module docstring).

    Raises FileNotFoundError for a missing file; ValueError naming the file and key for an
    unsupported tokenizer model or pre-tokenizer, or missing / malformed tokenizer metadata.
    """
    reader, where = _open(source)
    meta = _Metadata(reader, where)
    model = meta.require("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if model == "gpt2":
        backend, add_bos = _byte_level_backend(meta, tokens)
    elif model == "llama" and arch not in _OWN_SENTENCEPIECE:
        backend, add_bos = _sentencepiece_backend(meta, tokens)
    else:
        what = f"tokenizer.ggml.model {model!r}" + (f" with general.architecture {arch!r}" if model == "llama" else "")
        raise ValueError(f"{where}: {what} is not supported (supported: 'gpt2' byte-level BPE, 'llama' "
                         f"SentencePiece BPE)")

    alphabet = set(byte_to_unicode().values()) if model == "gpt2" else None
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == TOKEN_CONTROL and (alphabet is None or set(t) <= alphabet)]
    backend.add_special_tokens(control)
    if TOKEN_USER_DEFINED in types:
        vocab = backend.get_vocab(with_added_tokens=False)
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                            if k == TOKEN_USER_DEFINED and t in vocab])

    variables: dict[str, str] = {}
    for name, key in _SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            continue
        if not 0 <= int(i) < len(tokens):
            raise ValueError(f"{where}: tokenizer.ggml.{key} is {i}, outside the {len(tokens)} tokens")
        variables[name] = tokens[int(i)]
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in dict.fromkeys(variables.values()) if t not in known])
    bos = variables.get("bos_token")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, backend.token_to_id(bos))])
    template = meta.get("tokenizer.chat_template")
    return cls(backend, special_tokens_map=variables, chat_template=template, name=where)


__all__ = ["build_gguf_tokenizer", "PRE_TOKENIZERS", "sentencepiece_merges"]
