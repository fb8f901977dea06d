"""The tokenizer a GGUF file describes, from its `tokenizer.ggml.*` metadata (llama.cpp's keys),
read with the `gguf` package (ggml-org's GGUFReader), as an HFTokenizer.

Sources: llama.cpp (src/llama-vocab.cpp, llama_vocab::impl::load and ::tokenize: the token
types, the `tokenizer.ggml.pre` names and their defaults, the end-of-generation tokens), the
reference where the two differ, and transformers 5.x's GGUF tokenizer
(integrations/gguf/gguf_tokenizer_mapping.py), which the tests compare with elsewhere.

Keys read: `tokenizer.ggml.model`, `.pre`, `.tokens`, `.token_type`, `.merges`, `.scores`,
`.bos_token_id`, `.eos_token_id`, `.unknown_token_id`, `.padding_token_id`, `.eot_token_id`,
`.eom_token_id`, `.fim_*_token_id`, `.add_bos_token`, `.add_space_prefix`, and
`tokenizer.chat_template` (with `tokenizer.chat_template.tool_use`, the template llama.cpp
renders a request with tools with, when the file has one).

Tokenizer models (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2, ...). NORMAL tokens outside the
  byte-level alphabet are respelled from their UTF-8 bytes; text is split by the pre-tokenizer
  that `tokenizer.ggml.pre` names (PRE_TOKENIZERS; a name not there is a load error naming it).
  The llama3 family and tekken (LLAMA3_DEFAULTS) take a pre-token that is a token whole
  (ignore_merges) and add BOS by default, as llama.cpp does.
- "llama": SentencePiece BPE with byte fallback (Llama 2, TinyLlama, Mistral v0.1): merges from
  the file or, as transformers does, from the scores (a merge ranks by its result's score, then
  the longer left part, then the longer right part); "▁" prefixed to every piece of text that
  starts the input or follows a special token (llama.cpp's SPM tokenize).
  Files whose architecture has its own SentencePiece variant in transformers (gemma*, phi3) are
  refused.
Anything else is a load error naming the model.

Token types: CONTROL (3) tokens become special added tokens, USER_DEFINED (4) plain added
tokens, each at its own id with its text as written (not byte-level respelled); both encode
whole when the text spells them, as llama.cpp's tokenizer_st_partition matches them. Tokens
llama.cpp makes control at load (end-of-generation and FIM tokens found by their text) are
control here too. The BOS/EOS/unknown/padding tokens are the template's `bos_token`,
`eos_token`, `unk_token`, `pad_token`. BOS goes before text prompts when
`tokenizer.ggml.add_bos_token` is true (default: true for "llama" and the llama3 family, false
for other "gpt2" files). The stop tokens (`default_stop_token_ids`, and the model config's
eos_token_id) are llama.cpp's end-of-generation set (`end_of_generation`).

Where the two references differ, this follows llama.cpp, the format's owner:
- "smollm" splits digits one by one before GPT-2's split, as llama.cpp and SmolLM2's own
  tokenizer.json do; transformers 5.x uses GPT-2's split alone, which differs on runs of
  whitespace before a digit ("a  1": llama.cpp a|ĠĠ|1, transformers a|Ġ|Ġ|1). Other texts are
  identical (SmolLM2's vocabulary has no token joining a digit to anything).
- "default", and a file without `tokenizer.ggml.pre`, split with llama.cpp's default regex list
  (DEFAULT_SPLITS: punctuation runs alone, then GPT-2's split, then digit runs in threes:
  "don't" is don|'|t, "a 12345" a|" "|123|45); transformers uses GPT-2's split alone (don|'t,
  a|" 12345").
- "llama" honours `add_space_prefix = false` (no "▁" before the text); transformers ignores it.
- "llama" puts "▁" before text after a special token, and before text that starts with a
  space ("<s>Hi": <s>|▁Hi; " Hi": ▁|▁Hi); transformers 5 only at the start, and not before a
  space.
- Stop tokens: transformers takes the eos token alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
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
# llama.cpp's split for "default" and for a file without tokenizer.ggml.pre (src/llama-vocab.cpp,
# llm_tokenizer_bpe's `default:` case): these regexes one after another, each splitting the pieces
# the one before left (punctuation runs alone, then GPT-2's split, then digit runs, in threes).
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+",
                  r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
                  r"\p{N}+", r"[0-9][0-9][0-9]")
DEFAULT = "default"

# tokenizer.ggml.pre -> how byte-level BPE splits text before merging
PRE_TOKENIZERS: dict[str, str] = {
    "default": DEFAULT, "gpt-2": GPT2,
    "smollm": DIGITS_GPT2,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
    "tekken": TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), GPT4O_SPLIT),
}
# llama.cpp (src/llama-vocab.cpp, llama_vocab::impl::load): the pre-tokenizer names whose defaults
# are ignore_merges = true (a pre-token that is itself a vocabulary token is that token, whatever
# the merges would make of it) and add_bos = true (unless tokenizer.ggml.add_bos_token says
# otherwise). dbrx and smaug-bpe split like llama3 but keep llama.cpp's plain defaults.
LLAMA3_DEFAULTS = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                             "lfm2", "jina-v5-nano", "tekken"))

# llama.cpp (src/llama-vocab.cpp, llama_vocab::impl::load): the texts that make a token end
# generation ("maintain a list of tokens that cause end-of-generation"), wherever it is in the
# vocabulary and whatever its type.
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))
# llama.cpp's fill-in-the-middle tokens, found by text when their tokenizer.ggml.fim_*_token_id
# key is absent; pad/rep/sep also end generation. (Its EOT/EOM detection by text is a subset of
# EOG_TEXTS, so only the keys matter for those.)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
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


def end_of_generation(tokens: list[str], types: list[int], get: Any) -> tuple[list[int], dict[int, int]]:
    """The ids that end generation for a GGUF vocabulary, as llama.cpp computes `special_eog_ids`
    (src/llama-vocab.cpp, llama_vocab::impl::load), and the token types llama.cpp overrides.

    tokens, types: tokenizer.ggml.tokens / .token_type ([] when absent); get(key): the metadata
    value of `key` or None. The set: the FIM pad/rep/sep tokens (tokenizer.ggml.fim_*_token_id,
    else the first token spelling one of llama.cpp's texts for them), every token whose text is
    in EOG_TEXTS, and the eos/eot/eom ids; then llama.cpp's two workarounds: "<|end|>" is dropped
    when "<|return|>" and "<|call|>" (gpt-oss) or "<|calls|>" and "<|flush|>" (solar-open) are
    there, "</s>" when "<|tool_response>" or "<|plamo:eos|>" is (gemma4, plamo). Ids outside the
    vocabulary are ignored, as llama.cpp ignores them. Returns (ids: eos first, then by id;
    {id: token type}: CONTROL for the tokens llama.cpp finds by text and marks control,
    USER_DEFINED / NORMAL for a dropped "<|end|>" / "</s>").
    """
    n = len(tokens)
    by_text = {t: i for i, t in enumerate(tokens)}  # llama.cpp's token_to_id: the last id of a repeated text
    kind = lambda i: types[i] if i < len(types) else TOKEN_NORMAL  # noqa: E731
    forced: dict[int, int] = {}

    def key_id(name: str) -> int | None:
        i = get(f"tokenizer.ggml.{name}_token_id")
        return int(i) if i is not None and 0 <= int(i) < n else None

    eog: set[int] = set()
    for name, texts in _FIM_TEXTS.items():
        i = key_id(name)
        if i is None:
            found = sorted(by_text[t] for t in texts if t in by_text)
            if found:
                i = found[0]
                forced[i] = TOKEN_CONTROL
        if i is not None and name in ("fim_pad", "fim_rep", "fim_sep"):
            eog.add(i)
    for t, i in by_text.items():
        if t in EOG_TEXTS:
            eog.add(i)
            forced[i] = TOKEN_CONTROL
    eos = key_id("eos")
    eog.update(i for i in (eos, key_id("eot"), key_id("eom")) if i is not None)

    texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
        forced[texts["<|end|>"]] = TOKEN_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        forced[texts["</s>"]] = TOKEN_NORMAL
    forced = {i: k for i, k in forced.items() if k != kind(i)}
    ordered = ([eos] if eos in eog else []) + sorted(eog - {eos})
    return ordered, forced


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
    # engine.loading.gguf's reader keeps its path (its data is a plain view, without the memmap's filename)
    name = getattr(source, "path", None) or getattr(getattr(source, "data", None), "filename", None)
    return source, str(name or "GGUF file")


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
    splits = DEFAULT_SPLITS if kind == DEFAULT else (kind,)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in splits]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


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


def _backend(meta: _Metadata, vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> Backend:
    """BPE(vocab, merges); a merge naming a token the vocabulary lacks is a ValueError naming the
    file and key (the tokenizers library raises a bare Exception)."""
    try:
        return Backend(BPE(vocab=vocab, merges=merges, dropout=None, **options))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for inconsistent merges
        raise ValueError(f"{meta.where}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({e})") from None


def _byte_level_backend(meta: _Metadata, tokens: list[str], raw: set[int]) -> tuple[Backend, bool]:
    # NORMAL tokens are byte-level spelled; ones outside the alphabet are respelled from their UTF-8
    # bytes. Tokens in `raw` (CONTROL, USER_DEFINED, the special ids) keep their text: llama.cpp
    # matches them by their raw text (llama_vocab::impl::tokenizer_st_partition), and its converter
    # writes them unspelled (DeepSeek-R1-Distill-Qwen's "<｜User｜>").
    alphabet = set(byte_to_unicode().values())
    table = byte_to_unicode()
    vocab = {t if i in raw or set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = _merges(meta)
    if merges is None:
        raise ValueError(f"{meta.where}: metadata tokenizer.ggml.merges is missing (a 'gpt2' tokenizer needs it)")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    # llama.cpp's defaults for the llama3 family and tekken (llama_vocab::impl::load): ignore_merges
    # and add_bos; the file's tokenizer.ggml.add_bos_token still wins.
    llama3 = pre in LLAMA3_DEFAULTS
    backend = _backend(meta, vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                       ignore_merges=llama3)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre, meta.where)
    backend.decoder = decoders.ByteLevel()
    if "<|endoftext|>" in vocab:  # transformers' GPT2Tokenizer makes its default special token one
        backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return backend, bool(meta.get("tokenizer.ggml.add_bos_token", llama3))


def _sentencepiece_backend(meta: _Metadata, tokens: list[str]) -> tuple[Backend, bool]:
    merges = _merges(meta)
    if merges is None:
        scores = meta.require("tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ValueError(f"{meta.where}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        merges = sentencepiece_merges(tokens, [float(s) for s in scores])
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _backend(meta, vocab, merges, fuse_unk=True, byte_fallback=True)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # llama.cpp's SPM tokenizer (llama_vocab::impl::tokenize, LLAMA_VOCAB_TYPE_SPM) puts a space
    # before every piece of text that starts the input or follows a special token
    # ("if (add_space_prefix && is_prev_special) text = ' '"), even one that starts with a space.
    # A normalizer runs on each piece between added tokens, so Prepend does exactly that;
    # Metaspace's "first" scheme would prefix only the start of the input, "always" not a piece
    # that already starts with a space.
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
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
    types = types or [TOKEN_NORMAL] * len(tokens)
    stops, forced = end_of_generation(tokens, types, meta.get)
    for i, kind in forced.items():  # the types llama.cpp overrides at load (see end_of_generation)
        types[i] = kind

    special_ids: dict[str, int] = {}
    for name, key in _SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            continue
        if not 0 <= int(i) < len(tokens):
            raise ValueError(f"{where}: tokenizer.ggml.{key} is {i}, outside the {len(tokens)} tokens")
        special_ids[name] = int(i)
    if model == "gpt2":
        raw = {i for i, k in enumerate(types) if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)} | set(special_ids.values())
        backend, add_bos = _byte_level_backend(meta, tokens, raw)
    elif model == "llama" and arch not in _OWN_SENTENCEPIECE:
        backend, add_bos = _sentencepiece_backend(meta, tokens)
    else:
        what = f"tokenizer.ggml.model {model!r}" + (f" with general.architecture {arch!r}" if model == "llama" else "")
        raise ValueError(f"{where}: {what} is not supported (supported: 'gpt2' byte-level BPE, 'llama' "
                         f"SentencePiece BPE)")

    # Added at their own ids: each text is in the model's vocabulary (raw, see _byte_level_backend).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])
    variables = {name: tokens[i] for name, i in special_ids.items()}
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in dict.fromkeys(variables.values()) if t not in known])
    bos = variables.get("bos_token")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, backend.token_to_id(bos))])
    template = meta.get("tokenizer.chat_template")
    tool_use = meta.get("tokenizer.chat_template.tool_use")  # llama.cpp renders tools with it
    if tool_use is not None:
        template = {"tool_use": tool_use, **({} if template is None else {"default": template})}
    return cls(backend, special_tokens_map=variables, chat_template=template, name=where, stop_token_ids=stops)


__all__ = ["build_gguf_tokenizer", "end_of_generation", "EOG_TEXTS", "LLAMA3_DEFAULTS", "PRE_TOKENIZERS",
           "sentencepiece_merges"]
