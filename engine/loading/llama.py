"""Building a Llama-family model (engine/models/llama.py) from a parsed config and
transformers-named tensors (`build_llama`, shared with the GGUF reader), and loading one from a
Hugging Face checkpoint directory (`load_llama_checkpoint`).

Weights: transformers' names (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`,
..., `model.norm.weight`, `lm_head.weight`). q/k/v are fused into one projection and gate/up
into another here (one matmul each in a step).
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.loading.errors import CheckpointError, check_keys
from engine.loading.weight_map import Target, WeightMap
from engine.loading.hf_config import parse_llama_config, token_ids
from engine.loading.hf_weights import read_json, read_state_dict
from engine.models.base import CausalLM
from engine.models.llama import LlamaConfig, LlamaModel

# Buffers older checkpoints carry that transformers recomputes (the rotary table).
_IGNORED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)


def _expected_shapes(cfg: LlamaConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """transformers' parameter names -> shapes for this config, and the optional names."""
    C, I, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    Q, KV = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    optional = set()
    if cfg.tie_word_embeddings:
        optional.add("lm_head.weight")  # transformers ties it to the embedding, whatever is stored
    else:
        shapes["lm_head.weight"] = (V, C)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        layer = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
                 "self_attn.q_proj.weight": (Q, C), "self_attn.k_proj.weight": (KV, C),
                 "self_attn.v_proj.weight": (KV, C), "self_attn.o_proj.weight": (C, Q),
                 "mlp.gate_proj.weight": (I, C), "mlp.up_proj.weight": (I, C), "mlp.down_proj.weight": (C, I)}
        if cfg.qkv_bias:
            layer.update({"self_attn.q_proj.bias": (Q,), "self_attn.k_proj.bias": (KV,), "self_attn.v_proj.bias": (KV,)})
        if cfg.o_bias:
            layer["self_attn.o_proj.bias"] = (C,)
        if cfg.mlp_bias:
            layer.update({"mlp.gate_proj.bias": (I,), "mlp.up_proj.bias": (I,), "mlp.down_proj.bias": (C,)})
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
        shapes.update({p + k: s for k, s in layer.items()})
    return shapes, optional


def build_llama(config: dict, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                where: str, generation_config: dict | None = None) -> CausalLM:
    """A Llama-family model from a parsed config.json and transformers-named tensors.

    config: config.json's contents (architectures / model_type, sizes, rope, ...).
    weights: name -> tensor (any float dtype, any device), names as transformers' state dict.
    device, dtype: where the weights live and the compute dtype; logits are always float32.
    where: names the source (file or directory) in error messages.
    generation_config: generation_config.json's contents, whose eos_token_id, when given,
        wins over config.json's as the model's stop tokens (ModelInfo.stop_token_ids).
    Raises CheckpointError naming `where` for an unsupported architecture or config feature,
    missing or unknown tensors, or a tensor of the wrong shape.
    """
    cfg = parse_llama_config(config, where)
    stops = cfg.eos_token_ids
    if generation_config and generation_config.get("eos_token_id") is not None:
        stops = token_ids(generation_config["eos_token_id"], where, "generation_config eos_token_id")
    weights = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
    shapes, optional = _expected_shapes(cfg)
    check_keys(weights, shapes, where, f"for a {cfg.architecture} with {cfg.num_layers} layers", optional=optional)
    for k, shape in shapes.items():
        if tuple(weights[k].shape) != shape:
            raise CheckpointError(f"{where}: {k} has shape {tuple(weights[k].shape)}, expected {shape} "
                                  f"(from the config)")

    def get(name: str) -> torch.Tensor | None:
        t = weights.get(name)
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    def cat(*names: str) -> torch.Tensor | None:
        parts = [weights.get(n) for n in names]
        if parts[0] is None:
            return None
        return torch.cat([t.to(device=device, dtype=dtype) for t in parts]).contiguous()

    layers = []
    for n in range(cfg.num_layers):
        a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        layers.append({
            "input_norm": get(f"model.layers.{n}.input_layernorm.weight"),
            "post_norm": get(f"model.layers.{n}.post_attention_layernorm.weight"),
            "qkv": cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            "qkv_bias": cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
            "o_proj": get(a + "o_proj.weight"), "o_bias": get(a + "o_proj.bias"),
            "q_norm": get(a + "q_norm.weight"), "k_norm": get(a + "k_norm.weight"),
            "gate_up": cat(m + "gate_proj.weight", m + "up_proj.weight"),
            "gate_up_bias": cat(m + "gate_proj.bias", m + "up_proj.bias"),
            "down": get(m + "down_proj.weight"), "down_bias": get(m + "down_proj.bias"),
        })
    embed = get("model.embed_tokens.weight")
    head = None if cfg.tie_word_embeddings else get("lm_head.weight")
    n_params = sum(t.numel() for k, t in weights.items() if k in shapes)
    windows = sorted({w + 1 for w in cfg.windows if w is not None})
    desc = (f"{cfg.architecture} {cfg.num_layers} layers, {cfg.num_heads} heads ({cfg.num_kv_heads} KV) x "
            f"{cfg.head_dim}, {cfg.hidden_size} wide, {n_params / 1e6:.1f}M params, context "
            f"{cfg.max_position_embeddings}, rope {cfg.rope.rope_type}"
            f"{f', sliding window {windows}' if windows else ''}, from {where}")
    return LlamaModel(cfg, embed, head, get("model.norm.weight"), layers, stops, desc).eval()


def load_llama_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype, *,
                          weights: tuple[dict[str, torch.Tensor], str] | None = None) -> CausalLM:
    """Load a Llama-family Hugging Face checkpoint directory (eval mode).

    directory: config.json, optional generation_config.json, and model.safetensors (or
    sharded with model.safetensors.index.json, or pytorch_model.bin).
    weights: (the state dict, where it came from) already read (a weights swap passes meta
    tensors here to check a checkpoint without reading it); None: read from the directory.
    Raises FileNotFoundError for missing files, CheckpointError naming the file for an
    unsupported architecture or feature, missing / unknown tensors or wrong shapes.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    config = read_json(config_path)
    parse_llama_config(config, str(config_path))  # config errors name config.json, before reading weights
    generation = read_json(directory / "generation_config.json", required=False)
    weights, where = read_state_dict(directory) if weights is None else weights
    return build_llama(config, weights, device, dtype, where, generation_config=generation)


def weight_map(model: LlamaModel) -> WeightMap:
    """Where each transformers-named tensor of this model goes in `model` (the fusions
    `build_llama` makes: q/k/v rows of `qkv`, gate/up rows of `gate_up`, Qwen3's q_norm and
    k_norm repeated per head in `qk_norm`), for weights from memory and file by file
    (engine/loading/weight_swap.py). A tied head's `lm_head.weight` is accepted and ignored,
    as the loader does. GGUF files load into the same model with these names."""
    cfg = model.cfg
    H, KV, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    Q, K = H * D, KV * D
    shapes, optional = _expected_shapes(cfg)
    fused = {"self_attn.q_proj.": ("qkv", (0, Q)), "self_attn.k_proj.": ("qkv", (Q, Q + K)),
             "self_attn.v_proj.": ("qkv", (Q + K, Q + 2 * K)), "mlp.gate_proj.": ("gate_up", (0, I)),
             "mlp.up_proj.": ("gate_up", (I, 2 * I))}
    plain = {"input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "post_norm",
             "self_attn.o_proj.weight": "o_proj", "self_attn.o_proj.bias": "o_bias",
             "mlp.down_proj.weight": "down", "mlp.down_proj.bias": "down_bias"}
    targets: dict[str, Target | None] = {n: None for n in optional}
    targets.update({"model.embed_tokens.weight": Target("embed"), "model.norm.weight": Target("norm")})
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = Target("lm_head")
    for name in shapes:
        if not name.startswith("model.layers."):
            continue
        n, rest = name[len("model.layers."):].split(".", 1)
        p = f"layers.{n}."
        for prefix, (param, rows) in fused.items():
            if rest.startswith(prefix):
                kind = "_bias" if rest.endswith(".bias") else ""
                targets[name] = Target(p + param + kind, rows)
        if rest in plain:
            targets[name] = Target(p + plain[rest])
        elif rest == "self_attn.q_norm.weight":
            targets[name] = Target(p + "qk_norm", (0, H), broadcast=True)
        elif rest == "self_attn.k_norm.weight":
            targets[name] = Target(p + "qk_norm", (H, H + KV), broadcast=True)
    return WeightMap(targets, ignored_suffixes=_IGNORED_SUFFIXES)
