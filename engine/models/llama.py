"""One decoder for the Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM (transformers' models/llama, mistral, qwen2, qwen3), from a Hugging Face
checkpoint directory or from tensors another reader (GGUF) has named the same way.

Architecture (Touvron et al. 2023, "LLaMA"): token embedding; per layer
    x += o_proj(attention(rotary(q_proj(h)), rotary(k_proj(h)), v_proj(h))),  h = rms_norm(x)
    x += down_proj(silu(gate_proj(h)) * up_proj(h)),                            h = rms_norm(x)
then a final RMSNorm and the head (tied to the embedding or not). What varies by family
(biases, Qwen3's q/k norms, sliding windows, head_dim, rope scaling) is read from config.json
by engine/loading/hf_config.py. Grouped-query attention is kv.attend's / SDPA's enable_gqa.

Weights: transformers' names (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`,
..., `model.norm.weight`, `lm_head.weight`). q/k/v are fused into one projection and
gate/up into another at load (one matmul each in a step).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading.errors import CheckpointError, check_keys
from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM, ModelInfo, reference_numerics
from engine.loading.hf_config import LlamaConfig, token_ids
from engine.loading.hf_weights import read_json, read_state_dict
from engine.models.layers import RotaryStep, RotaryTables, add_rms_norm, swiglu
from engine.kernels.native import NativeKernels

# Buffers older checkpoints carry that transformers recomputes (the rotary table).
_IGNORED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)


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

    Built by `build_llama`: config from hf_config.LlamaConfig, weights (already fused, on
    the device, in the compute dtype) as `_Layer` parameters; logits are float32.
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
        """The parsed config (hf_config.LlamaConfig) as a dict: sizes, rope, norms, biases, windows."""
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
        rope = RotaryStep(self.rotary, batch.positions, T - 1 if batch.prefill else batch.kv_len - 1, kernels)
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


# ---------------------------------------------------------------------- building and loading
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
    cfg = LlamaConfig.from_dict(config, where)
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


def load_llama_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Load a Llama-family Hugging Face checkpoint directory (eval mode).

    directory: config.json, optional generation_config.json, and model.safetensors (or
    sharded with model.safetensors.index.json, or pytorch_model.bin).
    Raises FileNotFoundError for missing files, CheckpointError naming the file for an
    unsupported architecture or feature, missing / unknown tensors or wrong shapes.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    config = read_json(config_path)
    LlamaConfig.from_dict(config, str(config_path))  # config errors name config.json, before reading weights
    generation = read_json(directory / "generation_config.json", required=False)
    weights, where = read_state_dict(directory)
    return build_llama(config, weights, device, dtype, where, generation_config=generation)
