"""Find out what a checkpoint path holds and load its model and tokenizer.

Formats (detected from the files, never from the name):
- "demo": a built-in small nanochat-architecture model with deterministic random weights
  and an offline tokenizer. It is untrained: its text is noise.
- Hugging Face GPT-2: a directory with config.json (model_type gpt2) and model.safetensors
  or pytorch_model.bin, tokenizer from vocab.json + merges.txt beside them.
- nanochat: a directory with model_<step>.pt + meta_<step>.json (highest step unless one is
  given), tokenizer.pkl in the directory, or in <dir>/../../tokenizer/ (nanochat's layout).
An explicit tokenizer path (a tokenizer.pkl, a .tiktoken ranks file, or a directory with
vocab.json + merges.txt) overrides the one found beside the checkpoint.

Errors: FileNotFoundError for a missing path or file, CheckpointError (a ValueError) for
a directory that is none of these formats or whose contents do not fit the format; the
message names the path and what is wrong.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.models.base import CausalLM
from engine.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def check_keys(keys, expected, where: str, context: str, optional=()) -> None:
    """Raise CheckpointError naming unknown and missing state-dict keys (at most 8 of each).

    keys: the checkpoint's keys; expected: the keys the architecture needs; optional: keys
    it accepts but does not need. `where` names the file, `context` the expected model.
    """
    keys = set(keys)
    unknown = sorted(keys - set(expected) - set(optional))
    missing = sorted(set(expected) - keys)
    if unknown or missing:
        show = lambda ks: f"{ks[:8]}{' ...' if len(ks) > 8 else ''}"
        parts = ([f"missing keys {show(missing)}"] if missing else []) + \
                ([f"unknown keys {show(unknown)}"] if unknown else [])
        raise CheckpointError(f"{where}: {'; '.join(parts)} {context}")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" picks CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on a CUDA GPU with native bfloat16 (compute capability 8.0 and up:
    Ampere, Hopper, ...), float32 elsewhere: on CPUs and older GPUs bfloat16 is emulated
    (torch.cuda.is_bf16_supported() says True there too) and slower than float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0):
            return torch.bfloat16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r}: expected one of auto, float32, bfloat16, float16")
    return table[dtype]


def detect_format(path: str | Path) -> str:
    """Return "demo", "gpt2" or "nanochat" for a checkpoint path (see module docstring)."""
    if str(path) == "demo":
        return "demo"
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {str(p)!r} does not exist (expected a checkpoint directory or 'demo')")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {str(p)!r} is a file; expected a checkpoint directory or 'demo'")
    if (p / "config.json").exists():
        return "gpt2"
    if any(re.fullmatch(r"model_\d+\.pt", f.name) for f in p.iterdir()):
        return "nanochat"
    raise CheckpointError(
        f"{str(p)!r} is not a checkpoint directory: expected config.json with model.safetensors or "
        f"pytorch_model.bin (Hugging Face GPT-2), or model_<step>.pt with meta_<step>.json (nanochat)")


def load_checkpoint(path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                    tokenizer: str | Path | None = None, step: int | None = None) -> tuple[CausalLM, Tokenizer]:
    """Load (model, tokenizer) from `path` (see the module docstring for formats and errors).

    The model is in eval mode on `device`, its weights and activations in `dtype`.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fmt = detect_format(path)
    if fmt == "demo":
        from engine.models.nanochat import build_demo_model

        tok = Tokenizer.load(tokenizer) if tokenizer is not None else Tokenizer.demo()
        model = build_demo_model(tok.vocab_size, dev, dt)
    elif fmt == "gpt2":
        from engine.models.gpt2 import load_gpt2_checkpoint

        model = load_gpt2_checkpoint(Path(path), dev, dt)
        tok = Tokenizer.load(tokenizer if tokenizer is not None else Path(path))
    else:
        from engine.models.nanochat import load_nanochat_checkpoint

        model = load_nanochat_checkpoint(Path(path), dev, dt, step=step)
        tok = Tokenizer.load(tokenizer) if tokenizer is not None else Tokenizer.find_nanochat(Path(path))
    if tok.vocab_size > model.info.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {model.info.vocab_size}")
    return model.eval(), tok
