"""A GGUF file's metadata -> the config.json dict transformers would have for its architecture
(engine/loading/gguf.py reads the tensors). Keys are llama.cpp's (`{arch}.embedding_length`,
`{arch}.attention.head_count`, `{arch}.rope.*`, `tokenizer.ggml.*_token_id`, ...); a key the
engine does not read, at a value that would change the model, is a CheckpointError naming it.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from engine.loading.errors import CheckpointError

# general.architecture -> (transformers' architectures[0], model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

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


def metadata_value(reader: gguf.GGUFReader, key: str):
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


def read_config(reader: gguf.GGUFReader, path: Path) -> tuple[dict, gguf.ReaderTensor | None]:
    """The config dict (without the llama3 rope_scaling, which needs the rope_freqs tensor)
    and the rope_freqs tensor if the file has one. Raises CheckpointError naming the file and
    the metadata key (see engine/loading/gguf.py's module docstring)."""
    arch = _architecture(reader, path)
    prefix = f"{arch}."
    get = _metadata_getter(reader, prefix, path)
    hidden, heads, kv_heads, head_dim = _attention_shape(get, prefix, path)
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


def _architecture(reader: gguf.GGUFReader, path: Path) -> str:
    """general.architecture, once every `{arch}.` key of the file is one the engine reads or
    one at a value that changes nothing."""
    arch = metadata_value(reader, "general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: no general.architecture in the GGUF metadata")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    splits = metadata_value(reader, "split.count")
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
        if sub in _NEUTRAL_KEYS and metadata_value(reader, key) == _NEUTRAL_KEYS[sub]:
            continue
        raise CheckpointError(f"{path}: metadata {key} = {metadata_value(reader, key)!r} is a {arch} feature "
                              f"the engine does not implement")
    return arch


def _metadata_getter(reader: gguf.GGUFReader, prefix: str, path: Path):
    """get(sub, default, required, kind): the `{prefix}{sub}` value, checked to be one
    positive int (or float, or a str); `default` when absent (None: required unless told)."""

    def get(sub: str, default=None, required: bool = True, kind: type = int):
        key = prefix + sub
        value = metadata_value(reader, key)
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

    return get


def _attention_shape(get, prefix: str, path: Path) -> tuple[int, int, int, int]:
    """(hidden size, heads, KV heads, head_dim); refuses key and value heads of different
    sizes and partial rotary embeddings."""
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
    return hidden, heads, kv_heads, head_dim


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
    """bos/eos/pad ids from tokenizer.ggml.*; eos_token_id is llama.cpp's end-of-generation set
    (engine/tokenizers/gguf_tokenizer.py `end_of_generation`, after src/llama-vocab.cpp
    llama_vocab::impl::load: eos/eot/eom, the FIM pad/rep/sep tokens, and every token spelled
    like an end of turn such as <|im_end|> or <|endoftext|>), a list when it has several ids."""
    from engine.tokenizers.gguf_tokenizer import end_of_generation

    out = {}
    bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    pad = metadata_value(reader, "tokenizer.ggml.padding_token_id")
    if bos is not None:
        out["bos_token_id"] = bos
    tokens = metadata_value(reader, "tokenizer.ggml.tokens") or []
    types = metadata_value(reader, "tokenizer.ggml.token_type") or []
    eos, _ = end_of_generation(list(tokens), list(types), lambda key: metadata_value(reader, key))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad is not None:
        out["pad_token_id"] = pad
    return out


