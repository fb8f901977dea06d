"""config.json of a Llama-family checkpoint -> `LlamaConfig` (engine/models/llama.py), the one
description the decoder is built from, its rotary settings a `RopeScaling`
(engine/models/layers.py).

Architectures (transformers' model classes) and what each adds to Llama's decoder:
- LlamaForCausalLM ("llama"): optional biases on q/k/v/o (attention_bias) and on the MLP
  (mlp_bias). Covers Llama 2/3.x, TinyLlama, SmolLM/SmolLM2.
- MistralForCausalLM ("mistral"): a sliding window on every layer (sliding_window).
- Qwen2ForCausalLM ("qwen2"): biases on q/k/v (never o); sliding windows on the layers
  from max_window_layers on when use_sliding_window (or as `layer_types` says).
- Qwen3ForCausalLM ("qwen3"): RMSNorm on each head of q and k before the rotary embedding;
  attention_bias; head_dim 128 unless given; windows as Qwen2.
Missing keys take transformers' default for that model type, so a hand-written config means
what transformers would make of it. Anything the decoder does not implement is refused with
a CheckpointError naming it, never approximated.
"""
from __future__ import annotations

from engine.loading.errors import CheckpointError
from engine.models.layers import ROPE_TYPES, RopeScaling
from engine.models.llama import LlamaConfig

# model_type -> the CausalLM class transformers builds for it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Defaults of transformers' config classes (configuration_<model>.py) for keys a config may omit.
_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, eos_token_id=2),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-6, sliding_window=4096, eos_token_id=2),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=4096, max_window_layers=28),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES.values())


def parse_llama_config(config: dict, where: str) -> LlamaConfig:
    """config.json's contents as a `LlamaConfig` (engine/models/llama.py); `where` names the
    file in errors.

    Raises CheckpointError for an architecture outside ARCHITECTURES, a bad or missing
    shape value, or a feature the decoder does not implement (hidden_act other than silu,
    rope types other than default/linear/llama3/yarn, logit softcapping, a
    quantization_config, unknown layer_types).
    """
    model_type = architecture_of(config, where)
    c = {**_DEFAULTS[model_type], **{k: v for k, v in config.items() if v is not None or k in (
        "sliding_window", "head_dim", "num_key_value_heads", "eos_token_id")}}

    def pos_int(key: str) -> int:
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise CheckpointError(f"{where}: {key} must be a positive integer, got {v!r}")
        return v

    C, H, L = pos_int("hidden_size"), pos_int("num_attention_heads"), pos_int("num_hidden_layers")
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = H
    if c.get("head_dim") is None:
        c["head_dim"] = C // H
    KV, D = pos_int("num_key_value_heads"), pos_int("head_dim")
    if H % KV:
        raise CheckpointError(f"{where}: num_attention_heads {H} is not a multiple of num_key_value_heads {KV}")
    if D % 2:
        raise CheckpointError(f"{where}: head_dim {D} must be even for rotary embeddings")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (only 'silu': SwiGLU)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(key) is not None:
            raise CheckpointError(f"{where}: {key} is not supported")
    if c.get("quantization_config") is not None:
        q = c["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CheckpointError(f"{where}: quantized checkpoints (quantization_config, quant_method "
                              f"{method!r}) are not supported; use an unquantized checkpoint or a GGUF file")
    eps = c.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise CheckpointError(f"{where}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
    # pretraining_tp > 1 made transformers 4.x split each projection into slices and add
    # the partial products: the same function (a different float summation order), so it
    # is accepted; transformers 5 ignores it.
    flags = {}
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window"):
        v = c.get(key, False)
        if not isinstance(v, bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {v!r}")
        flags[key] = v
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "mistral":
        qkv_bias = o_bias = mlp_bias = False
    else:
        qkv_bias = o_bias = flags["attention_bias"]
        mlp_bias = flags["mlp_bias"] if model_type == "llama" else False
    return LlamaConfig(model_type=model_type, architecture=ARCHITECTURES[model_type], vocab_size=pos_int("vocab_size"),
                       hidden_size=C, intermediate_size=pos_int("intermediate_size"), num_layers=L, num_heads=H,
                       num_kv_heads=KV, head_dim=D, rms_norm_eps=float(eps), rope=parse_rope_scaling(c, where),
                       max_position_embeddings=pos_int("max_position_embeddings"), qkv_bias=qkv_bias, o_bias=o_bias,
                       mlp_bias=mlp_bias, qk_norm=model_type == "qwen3",
                       tie_word_embeddings=flags["tie_word_embeddings"],
                       windows=_windows(model_type, c, flags["use_sliding_window"], L, where),
                       eos_token_ids=token_ids(c.get("eos_token_id"), where, "eos_token_id"))


def parse_rope_scaling(config: dict, where: str) -> RopeScaling:
    """A config.json's rotary settings as a `RopeScaling` (engine/models/layers.py), read in
    either spelling: transformers 4.x (`rope_theta` plus an optional `rope_scaling` dict whose
    type is `rope_type` or `type`) or 5.x (`rope_parameters`, holding rope_theta too). As
    transformers does, `rope_scaling` wins over `rope_parameters`, a rope_theta inside the dict
    over the top-level one, and a top-level `original_max_position_embeddings` over the dict's;
    llama3 and yarn default it to max_position_embeddings.

    Raises CheckpointError naming `where` for an unknown rope_type (dynamic, longrope, ...),
    a missing required parameter, per-layer-type rope parameters, or
    partial_rotary_factor != 1.
    """
    raw = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: rope_scaling / rope_parameters must be an object, got {raw!r}")
    if any(isinstance(v, dict) for v in raw.values()):
        raise CheckpointError(f"{where}: per-layer-type rope parameters ({sorted(raw)}) are not supported")
    p = dict(raw)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{where}: rope_type {rope_type!r} is not supported (supported: "
                              f"{', '.join(ROPE_TYPES)})")
    partial = p.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor {partial} is not supported (only 1.0)")
    theta = p.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 1:
        raise CheckpointError(f"{where}: rope_theta must be a number > 1, got {theta!r}")
    orig = None
    if rope_type in ("llama3", "yarn"):
        orig = config.get("original_max_position_embeddings",
                          p.get("original_max_position_embeddings", config.get("max_position_embeddings")))
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "yarn": ()}.get(rope_type, ())
    missing = [k for k in required if p.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: rope_type {rope_type!r} needs {missing} in rope_scaling / rope_parameters")
    if rope_type != "default":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim"):
            v = p.get(k)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise CheckpointError(f"{where}: rope {k} must be a number, got {v!r}")
        if orig is not None and (not isinstance(orig, int) or orig <= 0):
            raise CheckpointError(f"{where}: original_max_position_embeddings must be a positive integer, "
                                  f"got {orig!r}")
    if rope_type == "default":
        return RopeScaling("default", float(theta))
    return RopeScaling(rope_type, float(theta), factor=p.get("factor"), original_max_position_embeddings=orig,
                       low_freq_factor=p.get("low_freq_factor"), high_freq_factor=p.get("high_freq_factor"),
                       attention_factor=p.get("attention_factor"), beta_fast=p.get("beta_fast"),
                       beta_slow=p.get("beta_slow"), mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"),
                       truncate=bool(p.get("truncate", True)))


def architecture_of(config: dict, where: str) -> str:
    """The model_type of a Llama-family config (from model_type, else architectures).

    Raises CheckpointError naming the architecture when it is not one of ARCHITECTURES, or
    when architectures and model_type disagree.
    """
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{where}: architectures must be a list of class names, got {archs!r}")
    mt = config.get("model_type")
    if mt is None:
        by_arch = {v: k for k, v in ARCHITECTURES.items()}
        known = [by_arch[a] for a in archs if a in by_arch]
        mt = known[0] if known else None
    if mt not in ARCHITECTURES:
        name = archs[0] if archs else f"model_type {mt!r}"
        raise CheckpointError(f"{where}: {name} is not supported; supported: {', '.join(supported_architectures())}")
    wrong = [a for a in archs if a != ARCHITECTURES[mt]]
    if wrong:
        raise CheckpointError(f"{where}: {wrong[0]} is not supported for model_type {mt!r} "
                              f"(expected {ARCHITECTURES[mt]})")
    return mt


def token_ids(value, where: str, key: str) -> tuple[int, ...]:
    """An int, a list of ints or None (config.json's eos_token_id) as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(f"{where}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(dict.fromkeys(items))


def _windows(model_type: str, c: dict, use_sliding_window: bool, L: int, where: str) -> tuple[int | None, ...]:
    """Each layer's engine window, following transformers' modeling code for the model type."""
    if model_type == "llama":
        return (None,) * L  # LlamaAttention has no sliding window, whatever the config says
    W = c.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not use_sliding_window:
        W = None  # Qwen2Config / Qwen3Config drop sliding_window unless use_sliding_window
    if W is not None and (not isinstance(W, int) or isinstance(W, bool) or W <= 0):
        raise CheckpointError(f"{where}: sliding_window must be a positive integer or null, got {W!r}")
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != L
                or any(t not in _LAYER_TYPES for t in layer_types)):
            raise CheckpointError(f"{where}: layer_types must list {L} of {_LAYER_TYPES}, got {layer_types!r}")
    if model_type == "mistral":
        # MistralForCausalLM applies sliding_window to every layer and ignores layer_types
        # (transformers warns and points to Ministral); a pattern it would ignore is refused.
        if layer_types is not None and W is not None and "full_attention" in layer_types:
            raise CheckpointError(f"{where}: layer_types with full_attention layers in a MistralForCausalLM "
                                  f"config is not supported (transformers ignores it; see Ministral)")
        return (None if W is None else W - 1,) * L
    if layer_types is None:
        first = c.get("max_window_layers")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise CheckpointError(f"{where}: max_window_layers must be a non-negative integer, got {first!r}")
        layer_types = ["sliding_attention" if W is not None and i >= first else "full_attention" for i in range(L)]
    return tuple(W - 1 if t == "sliding_attention" and W is not None else None for t in layer_types)
