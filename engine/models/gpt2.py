"""GPT-2 family (gpt2, gpt2-medium/large/xl, distilgpt2, ...) from a Hugging Face checkpoint.

A checkpoint directory holds config.json (model_type "gpt2") and model.safetensors or
pytorch_model.bin (or a sharded *.index.json of either), with GPT2LMHeadModel key names:
`transformer.wte/wpe`, `transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj}`, `transformer.ln_f`, optional `lm_head.weight` (tied to wte). Bare GPT2Model
checkpoints (no "transformer." prefix) load too.

Architecture: learned absolute positions, pre-LayerNorm blocks, fused qkv projection,
gelu (tanh approximation for "gelu_new"), tied lm_head, attention scale 1/sqrt(head_dim)
(scale_attn_by_inverse_layer_idx / scale_attn_weights=False are supported by pre-scaling q).

HF's Conv1D stores weights as (in, out); they are transposed once at load into nn.Linear's
(out, in) so every projection is one `linear` call (F.linear, or oneDNN on CPU: models/base.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading.errors import CheckpointError, check_keys
from engine.kv_cache import KVCache, StepBatch
from engine.models.base import (CausalLM, ModelInfo, invariant_gelu_tanh, invariant_silu,
                                reference_numerics)
from engine.loading.hf_weights import read_json, read_state_dict

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# activation_function -> (torch's kernel, its length-invariant form for CPU steps: base.py)
_ACTIVATIONS = {
    "gelu_new": (_gelu_tanh, invariant_gelu_tanh),
    "gelu_pytorch_tanh": (_gelu_tanh, invariant_gelu_tanh),
    "gelu_fast": (_gelu_tanh, invariant_gelu_tanh),
    "gelu": (F.gelu, F.gelu),  # erf-gelu's vector and scalar paths agree
    "relu": (F.relu, F.relu),
    "silu": (F.silu, invariant_silu),
    "swish": (F.silu, invariant_silu),
}
# Non-persistent causal-mask buffers older checkpoints (transformers < 4.x) still carry.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_LAYER_KEYS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
               "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
               "mlp.c_proj.weight", "mlp.c_proj.bias")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class GPT2Block(nn.Module):
    """One pre-LN transformer block; linear weights in (out, in) layout, qkv fused."""

    def __init__(self, w: dict[str, torch.Tensor]):
        super().__init__()
        self.ln1_w, self.ln1_b = _frozen(w["ln_1.weight"]), _frozen(w["ln_1.bias"])
        self.qkv_w, self.qkv_b = _frozen(w["attn.c_attn.weight"]), _frozen(w["attn.c_attn.bias"])
        self.proj_w, self.proj_b = _frozen(w["attn.c_proj.weight"]), _frozen(w["attn.c_proj.bias"])
        self.ln2_w, self.ln2_b = _frozen(w["ln_2.weight"]), _frozen(w["ln_2.bias"])
        self.fc_w, self.fc_b = _frozen(w["mlp.c_fc.weight"]), _frozen(w["mlp.c_fc.bias"])
        self.fc2_w, self.fc2_b = _frozen(w["mlp.c_proj.weight"]), _frozen(w["mlp.c_proj.bias"])


class GPT2(CausalLM):
    """GPT-2 language model implementing `CausalLM` (see engine/models/base.py).

    Built by `load_gpt2_checkpoint`; weights are frozen parameters in `dtype`, logits fp32.
    """

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], description: str = ""):
        super().__init__()
        self.n_layer, self.n_head, self.n_embd = cfg["n_layer"], cfg["n_head"], cfg["n_embd"]
        self.head_dim = self.n_embd // self.n_head
        self.vocab_size = cfg["vocab_size"]
        self.eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        self.act = _ACTIVATIONS[cfg.get("activation_function", "gelu_new")]
        self.wte = _frozen(weights["wte.weight"])
        self.wpe = _frozen(weights["wpe.weight"])
        self.blocks = nn.ModuleList(
            GPT2Block({k: weights[f"h.{i}.{k}"] for k in _LAYER_KEYS}) for i in range(self.n_layer))
        self.lnf_w, self.lnf_b = _frozen(weights["ln_f.weight"]), _frozen(weights["ln_f.bias"])
        head = weights.get("lm_head.weight")
        self.lm_head = self.wte if head is None else _frozen(head)
        # SDPA (and KVCache.attend) scale scores by 1/sqrt(head_dim); other GPT-2 scalings
        # are applied to q beforehand: factor[layer] multiplies q.
        base = 1.0 if cfg.get("scale_attn_weights", True) else math.sqrt(self.head_dim)
        inv_layer = cfg.get("scale_attn_by_inverse_layer_idx", False)
        self.q_scale = [base / (i + 1) if inv_layer else base for i in range(self.n_layer)]
        self.info = ModelInfo(arch="gpt2", vocab_size=self.vocab_size, context_len=cfg["n_positions"],
                              n_layer=self.n_layer, n_kv_head=self.n_head, head_dim=self.head_dim,
                              state_dims={}, description=description)

    def architecture(self) -> dict:
        """Sizes, layer-norm eps, activation, the per-layer query scaling and the tied head."""
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd, "vocab_size": self.vocab_size,
                "layer_norm_epsilon": self.eps, "activation": [f.__name__ for f in self.act],
                "q_scale": list(self.q_scale), "tied_head": self.lm_head is self.wte}

    # ------------------------------------------------------------------ pieces
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens, self.wte) + self.embedding(positions, self.wpe)

    def _qkv(self, blk: GPT2Block, layer: int, x: torch.Tensor):
        """x (B, T, C) -> q, k, v each (B, H, T, D) (strided views of one fused matmul)."""
        B, T, C = x.shape
        h = F.layer_norm(x, (C,), blk.ln1_w, blk.ln1_b, self.eps)
        qkv = self.linear(h, blk.qkv_w, blk.qkv_b).view(B, T, 3, self.n_head, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        s = self.q_scale[layer]
        if s != 1.0:
            q = q * s
        return q, k, v

    def _attn_out_mlp(self, blk: GPT2Block, x: torch.Tensor, y: torch.Tensor,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """Residual adds of attention output y (B, H, T, D) and the MLP.

        rows: optional (B,) index along T; if given, only those positions are kept (B, 1, C)
        before the MLP (the last layer of a step only needs each row's last token).
        """
        B, H, T, D = y.shape
        x = x + self.linear(y.transpose(1, 2).reshape(B, T, H * D), blk.proj_w, blk.proj_b)
        if rows is not None:
            x = x[torch.arange(B, device=x.device), rows].unsqueeze(1)
        h = F.layer_norm(x, (self.n_embd,), blk.ln2_w, blk.ln2_b, self.eps)
        return x + self.linear(self.pointwise(*self.act, self.linear(h, blk.fc_w, blk.fc_b)), blk.fc2_w, blk.fc2_b)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x, (self.n_embd,), self.lnf_w, self.lnf_b, self.eps)
        return self.project_head(x, self.lm_head[:self.vocab_size]).float()

    # ------------------------------------------------------------------ CausalLM
    @torch.no_grad()
    @reference_numerics
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free reference forward: tokens (B, T) int64 -> logits (B, T, vocab_size) fp32.

        Raises ValueError if T exceeds the context length (n_positions).
        """
        B, T = tokens.shape
        if T > self.info.context_len:
            raise ValueError(f"sequence of {T} tokens exceeds GPT-2's context of {self.info.context_len}")
        x = self._embed(tokens, torch.arange(T, device=tokens.device))
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, i, x)
            k, v = self.as_cached(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._attn_out_mlp(blk, x, y)
        return self._logits(x)

    @torch.no_grad()
    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """One prefill or decode step: tokens (B, T) int64 at batch.positions -> logits (B, V)
        fp32 at batch.last_index of each row ((B, T, V) with batch.all_logits). Keys/values go
        through `kv.attend`.
        """
        x = self._embed(tokens, batch.positions)
        last = self.n_layer - 1
        rows = batch.last_index if tokens.shape[1] > 1 and not batch.all_logits else None
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, i, x)
            y = kv.attend(i, q, k, v, batch, None)
            x = self._attn_out_mlp(blk, x, y, rows if i == last else None)
        if batch.all_logits:
            return self._logits(x)
        return self._logits(x[:, -1] if rows is not None else x[:, 0])


# ---------------------------------------------------------------------- loading
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
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{path}: activation_function {act!r} is not supported "
                              f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
    if cfg.get("add_cross_attention"):
        raise CheckpointError(f"{path}: add_cross_attention (encoder-decoder GPT-2) is not supported")
    # reorder_and_upcast_attn only changes the precision of the score computation (fp32
    # accumulation), which SDPA already does on CPU/GPU, so it is accepted as is.
    return cfg


def load_gpt2_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Load a Hugging Face GPT-2 checkpoint directory as a `GPT2` model (eval mode).

    directory: holds config.json and model.safetensors / pytorch_model.bin (or shards).
    device, dtype: where the weights live and the compute dtype; logits are always fp32.
    Raises FileNotFoundError for missing files, CheckpointError naming the file for an
    unsupported config, unknown or missing keys, or a tensor of the wrong shape.
    """
    directory = Path(directory)
    cfg = _read_config(directory)
    raw, where = read_state_dict(directory)
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
