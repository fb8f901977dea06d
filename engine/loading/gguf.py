"""Read llama.cpp GGUF model files: a transformers-style config and state dict.

`read_gguf(path)` opens a GGUF file (the format of ggml-org/ggml docs/gguf.md) with ggml-org's
`gguf` package, turns its metadata into the config.json dict transformers would have for the
architecture, and dequantizes every tensor, one at a time from the memory-mapped file, into a
state dict with transformers' parameter names. Supported `general.architecture` values:
`llama` (Llama 1-3, Mistral, SmolLM/SmolLM2, TinyLlama), `qwen2` (Qwen2/2.5) and `qwen3` (dense).

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
from engine.loading.gguf_rope import llama3_rope_scaling

# general.architecture -> (transformers' architectures[0], model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_GGUF_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}

# `{arch}.` metadata keys read into the config.
_READ_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scale_linear",
    "rope.scaling.finetuned",  # informational: whether the model was fine-tuned at the scaled length
}
# `{arch}.` keys some converters write at a value that changes nothing; any other value is a
# feature the engine does not implement.
_NEUTRAL_KEYS = {
    "expert_count": 0, "expert_used_count": 0, "attention.causal": True, "logit_scale": 1.0,
    "embedding_scale": 1.0, "residual_scale": 1.0, "rope.scaling.attn_factor": 1.0,
}


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
    config, rope_freqs = _read_config(reader, path)
    weights = _read_weights(reader, path, config, rope_freqs, dtype)
    if rope_freqs is not None:
        factors = dequantize(rope_freqs, path)
        config["rope_scaling"] = llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], path)
    return GGUFCheckpoint(config=config, weights=weights, reader=reader, path=path,
                          description=_describe(reader, path, config, weights))


# ---------------------------------------------------------------------- metadata
def _value(reader: gguf.GGUFReader, key: str):
    """A metadata value as Python (int, float, bool, str, or a list of them), None if absent.
    float32 values come back as the shortest decimal that rounds to the same float32 (the
    converter stored float32(1e-05): this gives 1e-05, not 9.999999747378752e-06)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{getattr(reader, 'path', '')}: metadata {key} is not valid UTF-8 ({e})") from None
    if field.types and field.types[-1] == gguf.GGUFValueType.FLOAT32:
        f32 = lambda v: float(str(np.float32(v)))  # noqa: E731
        value = [f32(v) for v in value] if isinstance(value, list) else f32(value)
    return value


def _read_config(reader: gguf.GGUFReader, path: Path) -> tuple[dict, gguf.ReaderTensor | None]:
    """The config dict (without the llama3 rope_scaling, which needs the rope_freqs tensor)
    and the rope_freqs tensor if the file has one."""
    arch = _value(reader, "general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: no general.architecture in the GGUF metadata")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    splits = _value(reader, "split.count")
    if splits is not None and splits > 1:
        raise CheckpointError(f"{path}: one shard of a split GGUF model ({splits} files); merge them first "
                              f"(llama-gguf-split --merge)")
    prefix = f"{arch}."
    for key in reader.fields:
        if not key.startswith(prefix):
            continue
        sub = key[len(prefix):]
        if sub in _READ_KEYS:
            continue
        if sub in _NEUTRAL_KEYS and _value(reader, key) == _NEUTRAL_KEYS[sub]:
            continue
        raise CheckpointError(f"{path}: metadata {key} = {_value(reader, key)!r} is a {arch} feature "
                              f"the engine does not implement")

    def get(sub: str, default=None, required: bool = True, kind: type = int):
        key = prefix + sub
        value = _value(reader, key)
        if value is None:
            if required and default is None:
                raise CheckpointError(f"{path}: metadata key {key} is missing")
            return default
        if isinstance(value, list):
            raise CheckpointError(f"{path}: metadata {key} is per-layer ({value[:4]}...); "
                                  f"only one value for every layer is supported")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise CheckpointError(f"{path}: metadata {key} must be a positive integer, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise CheckpointError(f"{path}: metadata {key} must be a positive number, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise CheckpointError(f"{path}: metadata {key} must be a string, got {value!r}")
        return kind(value)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: attention.head_count {heads} is not a multiple of "
                              f"attention.head_count_kv {kv_heads}")
    head_dim = get("attention.key_length", required=False)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"{path}: embedding_length {hidden} is not a multiple of attention.head_count "
                                  f"{heads} and {prefix}attention.key_length is missing")
        head_dim = hidden // heads
    value_dim = get("attention.value_length", default=head_dim)
    if value_dim != head_dim:
        raise CheckpointError(f"{path}: attention.value_length {value_dim} != attention.key_length {head_dim} "
                              f"(different key and value head sizes are not supported)")
    rope_dim = get("rope.dimension_count", default=head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(f"{path}: {prefix}rope.dimension_count {rope_dim} != head_dim {head_dim} "
                              f"(partial rotary embeddings are not supported)")
    vocab = get("vocab_size", required=False)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError(f"{path}: neither {prefix}vocab_size nor tokenizer.ggml.tokens gives the "
                                  f"vocabulary size")
        vocab = len(tokens.data)
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": ARCHITECTURES[arch][1],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", kind=float),
        # llama.cpp's default when the key is absent
        "rope_theta": get("rope.freq_base", default=10000.0, kind=float),
        "max_position_embeddings": get("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        # qwen2 always has q/k/v biases (and no o_proj bias); llama and qwen3 have all four or none
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    rope_scaling = _rope_scaling(get, prefix, path)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        if arch != "llama":
            raise CheckpointError(f"{path}: tensor rope_freqs.weight in a {arch} file is not supported")
        if rope_scaling is not None:
            raise CheckpointError(f"{path}: both {prefix}rope.scaling.type {rope_scaling['rope_type']!r} and a "
                                  f"rope_freqs.weight tensor; expected one rope scaling")
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    config.update(_special_tokens(reader))
    return config, rope_freqs


def _rope_scaling(get, prefix: str, path: Path) -> dict | None:
    """rope_scaling (transformers 4.x spelling) from {arch}.rope.scaling.* metadata, or None."""
    kind = get("rope.scaling.type", required=False, kind=str)
    legacy = get("rope.scale_linear", required=False, kind=float)
    if kind is None and legacy is not None:
        kind = "linear"
    if kind in (None, "none"):
        for sub in ("factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow"):
            if get(f"rope.scaling.{sub}", required=False, kind=float) is not None:
                raise CheckpointError(f"{path}: {prefix}rope.scaling.{sub} without a rope.scaling.type")
        return None
    factor = get("rope.scaling.factor", required=False, kind=float) or legacy
    if factor is None:
        raise CheckpointError(f"{path}: {prefix}rope.scaling.type {kind!r} without {prefix}rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        for sub, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = get(f"rope.scaling.{sub}", required=False, kind=float)
            if value is not None:
                scaling[name] = value
        return scaling
    raise CheckpointError(f"{path}: {prefix}rope.scaling.type {kind!r} is not supported "
                          f"(supported: none, linear, yarn)")


def _special_tokens(reader: gguf.GGUFReader) -> dict:
    """bos/eos/pad ids from tokenizer.ggml.*; eos_token_id is a list when the file also names
    end-of-turn / end-of-message tokens (llama.cpp stops at any of them)."""
    out = {}
    bos, pad = _value(reader, "tokenizer.ggml.bos_token_id"), _value(reader, "tokenizer.ggml.padding_token_id")
    if bos is not None:
        out["bos_token_id"] = bos
    eos = [v for k in ("eos", "eot", "eom") if (v := _value(reader, f"tokenizer.ggml.{k}_token_id")) is not None]
    eos = list(dict.fromkeys(eos))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad is not None:
        out["pad_token_id"] = pad
    return out


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
    name = _value(reader, "general.name")
    return (f"GGUF {config['model_type']} ({config['architectures'][0]}{', ' + name if name else ''}): "
            f"{config['num_hidden_layers']} layers, {config['hidden_size']} wide, {config['num_attention_heads']} "
            f"heads / {config['num_key_value_heads']} KV heads, {params / 1e6:.1f}M params, "
            f"{' + '.join(f'{k} x{v}' for k, v in types.most_common())}: {path.name}")
