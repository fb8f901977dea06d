"""GPT-2 family (gpt2, gpt2-medium/large/xl, distilgpt2, ...): the forward pass.

Architecture: learned absolute positions, pre-LayerNorm blocks, fused qkv projection,
gelu (tanh approximation for "gelu_new"), tied lm_head, attention scale 1/sqrt(head_dim)
(scale_attn_by_inverse_layer_idx / scale_attn_weights=False are supported by pre-scaling q).

Weights are in nn.Linear's (out, in) layout (engine/loading/gpt2.py reads a Hugging Face
checkpoint and transposes its Conv1D (in, out) weights once), so every projection is one
`linear` call (F.linear, or oneDNN on CPU: engine/models/base.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache, StepBatch
from engine.models.base import (CausalLM, ModelInfo, invariant_gelu_tanh, invariant_silu,
                                reference_numerics)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# activation_function -> (torch's kernel, its length-invariant form for CPU steps: base.py)
ACTIVATIONS = {
    "gelu_new": (_gelu_tanh, invariant_gelu_tanh),
    "gelu_pytorch_tanh": (_gelu_tanh, invariant_gelu_tanh),
    "gelu_fast": (_gelu_tanh, invariant_gelu_tanh),
    "gelu": (F.gelu, F.gelu),  # erf-gelu's vector and scalar paths agree
    "relu": (F.relu, F.relu),
    "silu": (F.silu, invariant_silu),
    "swish": (F.silu, invariant_silu),
}
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

    cfg: config.json's contents (validated by engine/loading/gpt2.py); weights: the
    state dict without the "transformer." prefix, linear weights (out, in), on the device in
    the compute dtype. Built by `load_gpt2_checkpoint`; logits are float32.
    """

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], description: str = ""):
        super().__init__()
        self.n_layer, self.n_head, self.n_embd = cfg["n_layer"], cfg["n_head"], cfg["n_embd"]
        self.head_dim = self.n_embd // self.n_head
        self.vocab_size = cfg["vocab_size"]
        self.eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        self.act = ACTIVATIONS[cfg.get("activation_function", "gelu_new")]
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
        h = F.layer_norm(x, (self.n_embd,), blk.ln1_w, blk.ln1_b, self.eps)
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
