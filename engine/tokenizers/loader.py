"""Which tokenizer a path holds: the dispatch behind `Tokenizer.load` and `Tokenizer.find_nanochat`
(engine/tokenizers/base.py says which formats, and what each raises). The interface imports
this module when it is called, so this module, and the tokenizers it builds, never import it."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.tokenizers.tiktoken_tokenizer import TiktokenTokenizer

if TYPE_CHECKING:
    from engine.tokenizers.hf_tokenizer import HFTokenizer


def load_tokenizer(path: str | Path) -> TiktokenTokenizer | HFTokenizer:
    """`Tokenizer.load(path)`: see its docstring."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} does not exist")
    if p.is_dir():
        has_gpt2_files = (p / "vocab.json").is_file() and (p / "merges.txt").is_file()
        has_hf = (p / "tokenizer.json").is_file()
        # tokenizer.json wins over vocab.json + merges.txt, GPT-2 checkpoints included: it (with
        # tokenizer_config.json) carries the added tokens and the chat template that the bare pair
        # lacks, and it is what transformers' AutoTokenizer reads from such a directory.
        if has_gpt2_files and not has_hf:
            return TiktokenTokenizer.from_gpt2_files(p / "vocab.json", p / "merges.txt")
        if (p / "tokenizer.pkl").is_file():
            return TiktokenTokenizer.from_pickle(p / "tokenizer.pkl")
        if has_hf:
            from engine.tokenizers.hf_tokenizer import HFTokenizer

            return HFTokenizer.from_dir(p)
        raise ValueError(f"tokenizer directory {str(p)!r} has neither vocab.json + merges.txt (GPT-2), "
                         f"tokenizer.pkl (nanochat) nor tokenizer.json (Hugging Face)")
    if p.suffix == ".gguf":
        from engine.tokenizers.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_gguf(p)
    if p.name == "tokenizer.json":
        from engine.tokenizers.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(p.parent)
    if p.suffix == ".pkl":
        return TiktokenTokenizer.from_pickle(p)
    if p.suffix == ".tiktoken":
        return TiktokenTokenizer.from_tiktoken_file(p)
    if p.name == "vocab.json" and (p.parent / "merges.txt").is_file():
        return TiktokenTokenizer.from_gpt2_files(p, p.parent / "merges.txt")
    raise ValueError(f"tokenizer file {str(p)!r}: expected a tokenizer.pkl, a .tiktoken ranks file, a "
                     f"tokenizer.json, a .gguf file, or a directory with vocab.json + merges.txt or tokenizer.json")


def find_nanochat_tokenizer(checkpoint_dir: str | Path) -> TiktokenTokenizer:
    """`Tokenizer.find_nanochat(checkpoint_dir)`: see its docstring."""
    d = Path(checkpoint_dir)
    tried = [d / "tokenizer.pkl", d.resolve().parent.parent / "tokenizer" / "tokenizer.pkl"]
    for p in tried:
        if p.is_file():
            return TiktokenTokenizer.from_pickle(p)
    raise FileNotFoundError("no nanochat tokenizer found; tried " + ", ".join(repr(str(p)) for p in tried)
                            + " (pass an explicit tokenizer path)")

