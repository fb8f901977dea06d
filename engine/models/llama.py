"""One decoder for the Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM (transformers' models/llama, mistral, qwen2, qwen3): the forward pass. It is
built from a Hugging Face checkpoint directory or from tensors another reader (GGUF) has named
the same way (engine/loading/llama.py).

Architecture (Touvron et al. 2023, "LLaMA"): token embedding; per layer
    x += o_proj(attention(rotary(q_proj(h)), rotary(k_proj(h)), v_proj(h))),  h = rms_norm(x)
    x += down_proj(silu(gate_proj(h)) * up_proj(h)),                            h = rms_norm(x)
then a final RMSNorm and the head (tied to the embedding or not). What varies by family
(biases, Qwen3's q/k norms, sliding windows, head_dim, rope scaling) is read from config.json
by engine/loading/hf_config.py into a `LlamaConfig`. Grouped-query attention is kv.attend's /
SDPA's enable_gqa. q/k/v are fused into one projection and gate/up into another at load (one
matmul each in a step).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.native import NativeKernels
from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM, ModelInfo, reference_numerics
from engine.models.layers import RopeScaling, RotaryStep, RotaryTables, add_rms_norm, swiglu


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """One Llama-family decoder's shape and features (engine/loading/hf_config.py reads it from
    config.json; its module docstring says what each architecture adds).

    model_type: "llama", "mistral", "qwen2" or "qwen3"; architecture its transformers class.
    hidden_size, intermediate_size, vocab_size (rows of the embedding and the head).
    num_heads, num_kv_heads, head_dim: attention shape (grouped-query when kv < heads).
    rms_norm_eps; rope: rotary parameters; max_position_embeddings: the context window.
    qkv_bias, o_bias, mlp_bias: which projections carry a bias. qk_norm: Qwen3's per-head norms.
    tie_word_embeddings: the head is the token embedding.
    windows: per layer, the engine's left window (a query at i sees keys i - w .. i; None =
        full context). transformers' sliding_window W lets a query see W keys, so w = W - 1.
    eos_token_ids: the config's eos_token_id as a tuple (() when none).
    """

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class _Layer(nn.Module):
    """One decoder layer's weights, q/k/v and gate/up fused, (out, in) layout. Qwen3's q_norm
    and k_norm (D,) are kept as one (H + KV, D) buffer, a gain per head of the fused q/k view."""

    def __init__(self, w: dict[str, torch.Tensor | None], num_heads: int, num_kv_heads: int):
        super().__init__()
        q_norm, k_norm = w.pop("q_norm"), w.pop("k_norm")
        for name, t in w.items():
            setattr(self, name, _frozen(t))
        qk_norm = None
        if q_norm is not None:
            qk_norm = torch.cat([q_norm.expand(num_heads, -1), k_norm.expand(num_kv_heads, -1)]).contiguous()
        self.register_buffer("qk_norm", qk_norm)


class LlamaModel(CausalLM):
    """A Llama-family decoder implementing `CausalLM` (engine/models/base.py).

    Built by `build_llama` (engine/loading/llama.py): config a `LlamaConfig`, weights (already
    fused, on the device, in the compute dtype) as `_Layer` parameters; logits are float32.
    """

    def __init__(self, cfg: LlamaConfig, embed: torch.Tensor, lm_head: torch.Tensor | None, norm: torch.Tensor,
                 layers: list[dict[str, torch.Tensor | None]], stop_token_ids: tuple[int, ...], description: str):
        super().__init__()
        self.cfg = cfg
        self.embed = _frozen(embed)
        self.lm_head = self.embed if lm_head is None else _frozen(lm_head)
        self.norm = _frozen(norm)
        self.layers = nn.ModuleList(_Layer(w, cfg.num_heads, cfg.num_kv_heads) for w in layers)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        inv_freq, scaling = cfg.rope.inv_freq(cfg.head_dim, cfg.max_position_embeddings)
        self.rotary = RotaryTables(inv_freq, scaling, cfg.max_position_embeddings, embed.dtype, embed.device)
        self.info = ModelInfo(arch=cfg.model_type, vocab_size=cfg.vocab_size, context_len=cfg.max_position_embeddings,
                              n_layer=cfg.num_layers, n_kv_head=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              description=description, stop_token_ids=stop_token_ids)

    def architecture(self) -> dict:
        """The parsed config (`LlamaConfig`) as a dict: sizes, rope, norms, biases, windows."""
        return dataclasses.asdict(self.cfg)

    # ------------------------------------------------------------------ pieces
    def _attention_inputs(self, layer: _Layer, h: torch.Tensor, rope: RotaryStep):
        """h (B, T, C), the normed input -> q (B, H, T, D), k and v (B, KV, T, D): projected,
        per-head normed (Qwen3), rotated. q and k are normed and rotated together, as the
        heads of one (B, T, H + KV, D) view (the same values as one at a time, in half the
        kernel calls)."""
        c = self.cfg
        B, T, _ = h.shape
        H, KV = c.num_heads, c.num_kv_heads
        qkv = self.linear(h, layer.qkv, layer.qkv_bias).view(B, T, H + 2 * KV, c.head_dim)
        qk = rope.rotate(qkv, H + KV, layer.qk_norm, c.rms_norm_eps)
        v = qkv[:, :, H + KV:]
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)

    def _attention_out_mlp(self, layer: _Layer, x: torch.Tensor, y: torch.Tensor,
                           kernels: NativeKernels | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output y (B, H, T, D) through o_proj and the residual add, then the
        MLP: x (B, T, C) -> (x + o_proj(y), the MLP's output), whose sum is the layer's output
        (the add is left to the next norm, which fuses it)."""
        B, H, T, D = y.shape
        x, h = add_rms_norm(x, self.linear(y.transpose(1, 2).reshape(B, T, H * D), layer.o_proj, layer.o_bias),
                            layer.post_norm, self.cfg.rms_norm_eps, kernels)
        return x, swiglu(self, h, layer.gate_up, layer.gate_up_bias, layer.down, layer.down_bias, kernels)

    def _logits(self, x: torch.Tensor, delta: torch.Tensor, kernels: NativeKernels | None) -> torch.Tensor:
        """x + delta (the last layer's output), normed, through the head: float32 logits."""
        _, h = add_rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps, kernels)
        return self.project_head(h, self.lm_head[:self.cfg.vocab_size]).float()

    # ------------------------------------------------------------------ CausalLM
    @torch.no_grad()
    @reference_numerics
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free reference forward: tokens (B, T) int64 -> logits (B, T, vocab_size) fp32.

        Raises ValueError if T exceeds the context (max_position_embeddings).
        """
        B, T = tokens.shape
        rope = RotaryStep(self.rotary, torch.arange(T, device=tokens.device).expand(B, T), T - 1, None)
        x, delta = self.embedding(tokens, self.embed), None
        i = torch.arange(T, device=tokens.device)
        dist = i[:, None] - i[None, :]
        for layer, window in zip(self.layers, self.cfg.windows):
            x, h = add_rms_norm(x, delta, layer.input_norm, self.cfg.rms_norm_eps, None)
            q, k, v = self._attention_inputs(layer, h, rope)
            k, v = self.as_cached(k, v)
            gqa = q.shape[1] != k.shape[1]
            if window is None or window >= T - 1:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=(dist >= 0) & (dist <= window), enable_gqa=gqa)
            x, delta = self._attention_out_mlp(layer, x, y, None)
        return self._logits(x, delta, None)

    @torch.no_grad()
    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """One prefill or decode step: tokens (B, T) int64 at batch.positions -> logits (B, V)
        fp32 at batch.last_index of each row ((B, T, V) with batch.all_logits). Keys and values go through `kv.attend`. On CPU
        in float32 the norms, rotary and SwiGLU gating run fused (engine/kernels/csrc/layer_ops.cpp).
        """
        B, T = tokens.shape
        x, delta = self.embedding(tokens, self.embed), None
        kernels = self.fused_kernels(x)
        rope = RotaryStep(self.rotary, batch.positions, batch.last_position(T), kernels)
        last = len(self.layers) - 1
        for i, (layer, window) in enumerate(zip(self.layers, self.cfg.windows)):
            x, h = add_rms_norm(x, delta, layer.input_norm, self.cfg.rms_norm_eps, kernels)
            q, k, v = self._attention_inputs(layer, h, rope)
            y = kv.attend(i, q, k, v, batch, window)
            if i == last and T > 1 and not batch.all_logits:
                # only each row's last token feeds the logits: skip o_proj and the MLP elsewhere
                rows = torch.arange(B, device=tokens.device)
                x = x[rows, batch.last_index].unsqueeze(1)
                y = y[rows, :, batch.last_index].unsqueeze(2)
            x, delta = self._attention_out_mlp(layer, x, y, kernels)
        if batch.all_logits:
            return self._logits(x, delta, kernels)
        return self._logits(x[:, 0], delta[:, 0], kernels)
