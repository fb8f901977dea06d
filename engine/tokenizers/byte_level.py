"""GPT-2's byte-level alphabet: the reversible map between the 256 byte values and printable
unicode characters in which byte-level BPE vocabularies spell their tokens (GPT-2's data-gym
files and Hugging Face vocab.json, `tokenizers`' ByteLevel pre-tokenizer and decoder, GGUF
"gpt2" vocabularies). Shared by the tiktoken, Hugging Face and GGUF tokenizers."""
from __future__ import annotations


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (data-gym / HF byte-level BPE).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 onwards, in
    byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}  # the inverse: character -> byte


def unicode_to_bytes(token: str) -> bytes | None:
    """Inverse of the byte-level map; None if `token` has a character outside it."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return None
