"""Stop strings: found token by token in a sample's bytes, and cut from its text.

A stop string may be split across any number of tokens, and a byte-level token may hold
part of a UTF-8 character, so matching decoded text token by token would see U+FFFD where
a character is split. The matcher works on bytes instead: each token's raw bytes
(`tokenizer.decode_token_bytes`) are appended to a window that keeps only the last
`len(longest stop) - 1` bytes of what came before, and the stop strings' UTF-8 encodings
are searched in it. The cost per token is bounded by the token's and the longest stop
string's length, never by the sample's: nothing is re-decoded. Byte matching is exact text
matching because UTF-8 is self-synchronising: the encoding of a string occurs in the
encoding of a text exactly where the string occurs in the text, and an incomplete
character at the end of the window cannot complete a match until its last byte arrives.

vLLM does the same job on incrementally detokenized text (vllm/v1/engine/detokenizer.py,
`check_stop_strings`): the sample ends at the token that completes the first stop string,
every generated token is kept, and the text ends before the stop string. That text leaves
special tokens out unless the request sets skip_special_tokens false (its DecodeStream /
convert_ids_to_tokens skip them): a stop string never matches inside one's text there, and
matches across one. SamplingParams.skip_special_tokens picks the same: special tokens' bytes
are fed by default (the `text` column keeps them), skipped with it (`skip_special`).
"""
from __future__ import annotations

from typing import Any


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes one token adds to a sample's text; b"" for an id the tokenizer lacks (a
    model vocabulary padded past the tokenizer's)."""
    try:
        return tokenizer.decode_token_bytes(token)
    except ValueError:
        return b""


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (`special_tokens`; none without it): what
    vLLM's skip_special_tokens leaves out of a sample's text."""
    return frozenset((getattr(tokenizer, "special_tokens", None) or {}).values())


class StopStringMatcher:
    """Finds the first stop string in a byte stream fed token by token.

    stops: non-empty strings. `feed(data)` returns the stop string completed by `data` (the one
    starting earliest when several complete at once, then the first listed), or None.
    skip_special: `skips(token, tokenizer)` is True for a special token, whose bytes are then
    not fed (SamplingParams.skip_special_tokens).
    """

    __slots__ = ("stops", "keep", "tail", "skip_special", "specials")

    def __init__(self, stops: tuple[str, ...], skip_special: bool = False):
        if not stops or any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.stops = [(s, s.encode("utf-8")) for s in stops]
        self.keep = max(len(b) for _, b in self.stops) - 1
        self.tail = b""
        self.skip_special = skip_special
        self.specials: frozenset[int] | None = None  # special_ids(tokenizer), on the first skips()

    def skips(self, token: int, tokenizer: Any) -> bool:
        """Whether `token` is left out of the matched text: a special token, with skip_special."""
        if not self.skip_special:
            return False
        if self.specials is None:
            self.specials = special_ids(tokenizer)
        return token in self.specials

    def feed(self, data: bytes) -> str | None:
        window = self.tail + data
        best: tuple[int, str] | None = None
        for s, b in self.stops:
            i = window.find(b)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        # No match was complete before this token, so a later one must end in `data`: only
        # the last keep bytes can start it.
        self.tail = window[-self.keep:] if self.keep else b""
        return None if best is None else best[1]

    def reset(self) -> None:
        """Forget the bytes fed so far: no match spans this point (forced tool output, which
        is not matched, lies between)."""
        self.tail = b""


def completion_text(tokenizer: Any, tokens: list[int], stop_reason: int | str | None) -> str:
    """A finished sample's text: `tokens` decoded without the stop token that ended it, and
    cut before the stop string that ended it.

    stop_reason: Sample.stop_reason (an int: tokens[-1] is that stop token; a str: the stop
    string completed in the last token). The cut is at the occurrence of the stop string that
    the last token completed: the first one to end in it, in the tokens' raw bytes (earlier
    occurrences can lie in forced tool output, which stop strings are not matched on), found
    in tokenizer.decode(tokens) as the same, n-th, occurrence; where the tokenizer's decoding
    differs from the tokens' raw bytes there (SentencePiece drops a leading space,
    clean_up_tokenization_spaces joins punctuation) and it is not found, the text is the raw
    bytes before it, decoded. A stop string matched across special tokens (skip_special_tokens:
    their text is not in the matched text) is cut where it starts, before them. Raises
    ValueError for token ids the tokenizer cannot decode.
    """
    toks = list(tokens)
    if isinstance(stop_reason, int) and not isinstance(stop_reason, bool) and toks and toks[-1] == stop_reason:
        toks.pop()
    if not isinstance(stop_reason, str):
        return tokenizer.decode(toks)
    b = stop_reason.encode("utf-8")
    raw = b"".join(token_bytes(tokenizer, t) for t in toks)
    last = len(token_bytes(tokenizer, toks[-1])) if toks else 0
    j = raw.find(b, max(0, len(raw) - last - len(b) + 1))  # the occurrence ending in the last token
    if j < 0 and (spanned := _spanned_specials(tokenizer, toks, b)):
        toks = [t for i, t in enumerate(toks) if i not in spanned]  # then it is the one ending there
        raw = b"".join(token_bytes(tokenizer, t) for t in toks)
        j = raw.find(b, max(0, len(raw) - last - len(b) + 1))
    text = tokenizer.decode(toks)
    if j < 0:
        j = raw.find(b)
    n, k = 0, raw.find(b)
    while 0 <= k < j:  # occurrences before it (in forced tool output)
        n, k = n + 1, raw.find(b, k + 1)
    i = text.find(stop_reason)
    for _ in range(n):
        i = text.find(stop_reason, i + 1) if i >= 0 else -1
    if i >= 0:
        return text[:i]
    return raw[: j if j >= 0 else len(raw)].decode("utf-8", errors="replace")


def _spanned_specials(tokenizer: Any, toks: list[int], b: bytes) -> set[int]:
    """Indices in `toks` of the special tokens inside the occurrence of `b` that ends in the
    last token when special tokens' bytes are left out (a match made with skip_special_tokens
    across them); empty when there is none."""
    specials = special_ids(tokenizer)
    if not toks or toks[-1] in specials:
        return set()
    kept = [i for i, t in enumerate(toks) if t not in specials]
    if len(kept) == len(toks):
        return set()
    ends, n = [], 0  # ends[k]: bytes of kept tokens up to and including kept[k]
    parts = []
    for i in kept:
        parts.append(token_bytes(tokenizer, toks[i]))
        n += len(parts[-1])
        ends.append(n)
    stream = b"".join(parts)
    j = stream.find(b, max(0, n - len(parts[-1]) - len(b) + 1))
    if j < 0:
        return set()
    first = kept[next(k for k, e in enumerate(ends) if e > j)]  # the token the occurrence starts in
    return {i for i in range(first + 1, len(toks)) if toks[i] in specials}
