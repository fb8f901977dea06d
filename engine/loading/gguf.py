"""Read llama.cpp GGUF model files: a transformers-style config and state dict.

`read_gguf(path)` opens a GGUF file (the format of ggml-org/ggml docs/gguf.md) with ggml-org's
`gguf` package, turns its metadata into the config.json dict transformers would have for the
architecture (engine/loading/gguf_config.py), and dequantizes every tensor, one at a time from
the memory-mapped file, into a state dict with transformers' parameter names. Supported
`general.architecture` values: `llama` (Llama 1-3, Mistral, SmolLM/SmolLM2, TinyLlama), `qwen2`
(Qwen2/2.5) and `qwen3` (dense).

What llama.cpp's converter (convert_hf_to_gguf.py) changed is undone here:
- names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, through the `gguf`
  package's own tensor-name map (gguf.get_tensor_name_map), as transformers' GGUF loader does;
- shapes: GGUF lists dimensions fastest-first (ggml's ne[]), torch slowest-first;
- llama's Q and K rows, permuted for llama.cpp's interleaved rotary layout, are permuted back
  exactly as transformers (modeling_gguf_pytorch_utils.LlamaTensorProcessor) does; qwen2 and
  qwen3 are stored unpermuted (llama.cpp runs them with NeoX rotary);
- llama 3.1+'s `rope_freqs.weight` (per-frequency divisors the converter computed from the
  `llama3` rope scaling) becomes that rope_scaling again, or a named error when the tensor
  is not of that form (see `llama3_rope_scaling`).

Anything the engine would have to approximate (another architecture, a mixture of experts,
partial rotary, a sliding window, an unknown tensor or metadata feature, a tensor type
`gguf.quants` cannot dequantize) is a CheckpointError naming the file and the item.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.loading.errors import CheckpointError
from engine.loading.gguf_config import metadata_value, read_config
from engine.loading.gguf_rope import llama3_rope_scaling

_GGUF_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


@dataclass(slots=True)
class GGUFCheckpoint:
    """A GGUF model file, read.

    config: transformers' config.json dict for the architecture ("architectures",
        "model_type", hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, rms_norm_eps, rope_theta, "rope_scaling" when the file
        scales rope, max_position_embeddings, vocab_size, tie_word_embeddings, attention_bias,
        bos/eos/pad_token_id from tokenizer.ggml.*).
    weights: transformers-named tensors in the requested dtype with transformers' shapes, e.g.
        model.embed_tokens.weight (vocab_size, hidden_size); lm_head.weight only when untied.
    reader: the open gguf.GGUFReader (tokenizer.ggml.* and tokenizer.chat_template live there).
    path: the file. description: one line (architecture, shape, size, tensor types, file).
    """

    config: dict
    weights: dict[str, torch.Tensor]
    reader: gguf.GGUFReader
    path: Path
    description: str


class _Reader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its memory map.

    The reader slices its np.memmap once per metadata item; every slice of a memmap subclass
    runs numpy's memmap bookkeeping, which is most of the time spent opening a file with a
    large vocabulary (SmolLM2, 49,152 tokens + 48,900 merges: 2.9 s -> 1.0 s measured). A
    base-class view of the same map reads the same bytes, still memory-mapped.
    """

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file for reading (metadata parsed, tensors memory-mapped, none read yet).

    Raises FileNotFoundError when `path` does not exist, CheckpointError naming the file when
    it is a directory, not a GGUF file, or cannot be parsed (truncated or corrupt).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, a GGUF file starts with b'GGUF')")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse the GGUF file, truncated or corrupt "
                              f"({type(e).__name__}: {e})") from None
    if reader.byte_order != "I":
        # gguf.quants reads block scales in the machine's byte order: values would be wrong
        raise CheckpointError(f"{path}: the GGUF file's byte order is not this machine's ({reader.endianess.name} "
                              f"file); convert it with llama.cpp's gguf_convert_endian.py")
    return reader


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Read a llama / qwen2 / qwen3 GGUF file into a config and a dequantized state dict.

    path: the .gguf file (a single file; split files must be merged first). dtype: the dtype
    of the returned tensors (every tensor is dequantized to float32 by gguf.quants, then cast).
    Memory: tensors are dequantized one at a time from the memory map, so the peak is about
    the returned state dict plus one tensor's float32 temporaries.
    Raises FileNotFoundError for a missing file; CheckpointError naming the file and the
    problem for anything else (see the module docstring).
    """
    path = Path(path)
    reader = open_gguf(path)
    config, rope_freqs = read_config(reader, path)
    weights = _read_weights(reader, path, config, rope_freqs, dtype)
    if rope_freqs is not None:
        factors = dequantize(rope_freqs, path)
        config["rope_scaling"] = llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], path)
    return GGUFCheckpoint(config=config, weights=weights, reader=reader, path=path,
                          description=_describe(reader, path, config, weights))


# ---------------------------------------------------------------------- tensors
def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers parameter name -> shape, for every tensor the file must have."""
    H, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    D, nq, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    qwen2, qwen3 = config["model_type"] == "qwen2", config["model_type"] == "qwen3"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nq * D, H), p + "self_attn.k_proj.weight": (nkv * D, H),
            p + "self_attn.v_proj.weight": (nkv * D, H), p + "self_attn.o_proj.weight": (H, nq * D),
            p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F),
        })
        if qwen2 or config["attention_bias"]:
            shapes.update({p + "self_attn.q_proj.bias": (nq * D,), p + "self_attn.k_proj.bias": (nkv * D,),
                           p + "self_attn.v_proj.bias": (nkv * D,)})
        if config["attention_bias"]:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if qwen3:
            shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
    return shapes


def _gguf_names(config: dict, hf_names) -> dict[str, str]:
    """GGUF tensor name -> transformers name, through the gguf package's name map."""
    arch = _GGUF_ARCH[config["model_type"]]
    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    out = {}
    for hf in hf_names:
        base, suffix = hf.rsplit(".", 1)
        out[f"{name_map.get_name(base)}.{suffix}"] = hf
    return out


def dequantize(tensor: gguf.ReaderTensor, path: Path | str = "") -> np.ndarray:
    """One GGUF tensor as a float32 ndarray in torch's dimension order (GGUF's ne[] reversed).

    Every type gguf.quants can dequantize works (F32, F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K,
    the IQ and TQ types, MXFP4 in gguf 0.19). Raises CheckpointError naming the tensor and its
    type for any other (Q8_1, Q8_K, integer and F64 tensors).
    """
    qtype = tensor.tensor_type
    try:
        w = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name} has type {qtype.name}, which the gguf package "
                              f"cannot dequantize") from None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return w.reshape(shape)


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute on Q or K rows (weight (n_head*D, C)
    or bias (n_head*D,)): per head, llama.cpp stores rotary pairs interleaved (rows 0,D/2,1,...),
    transformers as halves; same reshape/swap as transformers' _reverse_permute_weights."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read_weights(reader: gguf.GGUFReader, path: Path, config: dict, rope_freqs, dtype: torch.dtype):
    """Check every tensor's name and shape first (a bad file fails before any dequantizing),
    then dequantize them one at a time into transformers-named `dtype` tensors."""
    shapes = _expected_shapes(config)
    to_hf = _gguf_names(config, shapes)
    tensors = {}
    for t in reader.tensors:
        if t is rope_freqs:
            continue
        hf = to_hf.get(t.name)
        if hf is None:
            raise CheckpointError(f"{path}: unknown tensor {t.name} for a {config['model_type']} model "
                                  f"({'tied' if config['tie_word_embeddings'] else 'untied'} head, "
                                  f"attention_bias={config['attention_bias']})")
        got = tuple(int(n) for n in reversed(t.shape.tolist()))
        if got != shapes[hf]:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {got} (torch order), expected {shapes[hf]} "
                                  f"for {hf}")
        tensors[hf] = t
    missing = [g for g, hf in to_hf.items() if hf not in tensors]
    if missing:
        show = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{path}: missing tensors {show} ({len(missing)} of {len(shapes)}) for a "
                              f"{config['model_type']} model with {config['num_hidden_layers']} layers")
    heads = {}
    if config["model_type"] == "llama":
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, torch.Tensor] = {}
    for hf, t in tensors.items():
        w = dequantize(t, path)
        if not w.flags.writeable:  # F32 tensors come back as views into the read-only map
            w = w.copy()
        x = torch.from_numpy(w)
        proj = hf.split(".")[-2]
        if proj in heads:
            x = _unpermute_rotary(x, heads[proj])
        weights[hf] = x.to(dtype).contiguous()
    return weights


# ---------------------------------------------------------------------- description
def _describe(reader: gguf.GGUFReader, path: Path, config: dict, weights: dict[str, torch.Tensor]) -> str:
    types = Counter(t.tensor_type.name for t in reader.tensors)
    params = sum(w.numel() for w in weights.values())
    name = metadata_value(reader, "general.name")
    return (f"GGUF {config['model_type']} ({config['architectures'][0]}{', ' + name if name else ''}): "
            f"{config['num_hidden_layers']} layers, {config['hidden_size']} wide, {config['num_attention_heads']} "
            f"heads / {config['num_key_value_heads']} KV heads, {params / 1e6:.1f}M params, "
            f"{' + '.join(f'{k} x{v}' for k, v in types.most_common())}: {path.name}")
