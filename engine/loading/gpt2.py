"""A Hugging Face GPT-2 checkpoint directory -> a `GPT2` model (engine/models/gpt2.py).

A checkpoint directory holds config.json (model_type "gpt2") and model.safetensors or
pytorch_model.bin (or a sharded *.index.json of either), with GPT2LMHeadModel key names:
`transformer.wte/wpe`, `transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj}`, `transformer.ln_f`, optional `lm_head.weight` (tied to wte). Bare GPT2Model
checkpoints (no "transformer." prefix) load too.

HF's Conv1D stores weights as (in, out); they are transposed once here into nn.Linear's
(out, in), so every projection of the model is one `linear` call.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.loading.errors import CheckpointError, check_keys
from engine.loading.hf_weights import read_json, read_state_dict
from engine.loading.weight_map import Target, WeightMap
from engine.models.base import CausalLM
from engine.models.gpt2 import ACTIVATIONS, GPT2

# Non-persistent causal-mask buffers older checkpoints (transformers < 4.x) still carry.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    cfg = read_json(path)
    mt = cfg.get("model_type", "gpt2")
    if mt != "gpt2":
        raise CheckpointError(f"{path}: model_type {mt!r} is not supported by the GPT-2 loader (expected 'gpt2')")
    cfg.setdefault("n_positions", cfg.get("n_ctx", 1024))
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise CheckpointError(f"{path}: {key} must be a positive integer, got {cfg.get(key)!r}")
    if cfg["n_embd"] % cfg["n_head"]:
        raise CheckpointError(f"{path}: n_embd {cfg['n_embd']} is not a multiple of n_head {cfg['n_head']}")
    act = cfg.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{path}: activation_function {act!r} is not supported "
                              f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    if cfg.get("add_cross_attention"):
        raise CheckpointError(f"{path}: add_cross_attention (encoder-decoder GPT-2) is not supported")
    # reorder_and_upcast_attn only changes the precision of the score computation (fp32
    # accumulation), which SDPA already does on CPU/GPU, so it is accepted as is.
    return cfg


def load_gpt2_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype, *,
                         weights: tuple[dict[str, torch.Tensor], str] | None = None) -> CausalLM:
    """Load a Hugging Face GPT-2 checkpoint directory as a `GPT2` model (eval mode).

    directory: holds config.json and model.safetensors / pytorch_model.bin (or shards).
    weights: (the state dict, where it came from) already read (meta tensors for a weights
    swap's check); None: read from the directory.
    device, dtype: where the weights live and the compute dtype; logits are always fp32.
    Raises FileNotFoundError for missing files, CheckpointError naming the file for an
    unsupported config, unknown or missing keys, or a tensor of the wrong shape.
    """
    directory = Path(directory)
    cfg = _read_config(directory)
    raw, where = read_state_dict(directory) if weights is None else weights
    C, L, V, P = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], cfg["n_positions"]
    inner = cfg.get("n_inner") or 4 * C

    sd: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        name = key[len("transformer."):] if key.startswith("transformer.") else key
        sd[name] = t
    expected: dict[str, tuple[int, ...] | None] = {"wte.weight": None, "wpe.weight": (P, C),
                                                   "ln_f.weight": (C,), "ln_f.bias": (C,)}
    layer_shapes = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C),
                    "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
                    "ln_2.weight": (C,), "ln_2.bias": (C,), "mlp.c_fc.weight": (C, inner),
                    "mlp.c_fc.bias": (inner,), "mlp.c_proj.weight": (inner, C), "mlp.c_proj.bias": (C,)}
    for i in range(L):
        expected.update({f"h.{i}.{k}": s for k, s in layer_shapes.items()})
    check_keys(sd, expected, where, f"for a GPT-2 with n_layer={L} (config.json in {directory})",
               optional={"lm_head.weight"})
    wte = sd["wte.weight"]
    if wte.ndim != 2 or wte.shape[1] != C or wte.shape[0] < V:
        raise CheckpointError(f"{where}: wte.weight has shape {tuple(wte.shape)}, expected ({V}, {C}) "
                              f"(vocab_size {V} from config.json)")
    for k, shape in expected.items():
        if shape is not None and tuple(sd[k].shape) != shape:
            raise CheckpointError(f"{where}: {k} has shape {tuple(sd[k].shape)}, expected {shape}")

    weights: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if k == "lm_head.weight":
            continue
        if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t()  # Conv1D (in, out) -> Linear (out, in)
        weights[k] = t.to(device=device, dtype=dtype).contiguous()
    head = sd.get("lm_head.weight")
    if not cfg.get("tie_word_embeddings", True):
        if head is None:
            raise CheckpointError(f"{where}: tie_word_embeddings is false but lm_head.weight is missing")
        if head.ndim != 2 or head.shape[1] != C or head.shape[0] < V:
            raise CheckpointError(f"{where}: lm_head.weight has shape {tuple(head.shape)}, expected ({V}, {C})")
        weights["lm_head.weight"] = head.to(device=device, dtype=dtype).contiguous()
    del raw, sd

    n_params = sum(t.numel() for t in weights.values())
    desc = (f"GPT-2 {L} layers, {cfg['n_head']} heads, {C} wide, {n_params / 1e6:.1f}M params, "
            f"context {P}, from {directory}")
    return GPT2(cfg, weights, description=desc).eval()


# transformers' GPT-2 layer names -> GPT2Block's parameters; the Conv1D weights are transposed
_LAYER_TARGETS = {"ln_1.weight": "ln1_w", "ln_1.bias": "ln1_b", "attn.c_attn.weight": "qkv_w",
                  "attn.c_attn.bias": "qkv_b", "attn.c_proj.weight": "proj_w", "attn.c_proj.bias": "proj_b",
                  "ln_2.weight": "ln2_w", "ln_2.bias": "ln2_b", "mlp.c_fc.weight": "fc_w", "mlp.c_fc.bias": "fc_b",
                  "mlp.c_proj.weight": "fc2_w", "mlp.c_proj.bias": "fc2_b"}


def weight_map(model: GPT2) -> WeightMap:
    """Where each transformers-named tensor (GPT2LMHeadModel's, with or without the
    "transformer." prefix) goes in `model`: Conv1D weights transposed into (out, in), as
    `load_gpt2_checkpoint` does; a tied head's `lm_head.weight` accepted and ignored."""
    targets: dict[str, Target | None] = {"wte.weight": Target("wte"), "wpe.weight": Target("wpe"),
                                         "ln_f.weight": Target("lnf_w"), "ln_f.bias": Target("lnf_b"),
                                         "lm_head.weight": None if model.lm_head is model.wte else Target("lm_head")}
    for i in range(model.n_layer):
        for k, param in _LAYER_TARGETS.items():
            targets[f"h.{i}.{k}"] = Target(f"blocks.{i}.{param}", transpose=k.endswith(
                ("c_attn.weight", "c_proj.weight", "c_fc.weight")))
    return WeightMap(targets, strip_prefixes=("transformer.",), ignored_suffixes=_IGNORED_SUFFIXES)
