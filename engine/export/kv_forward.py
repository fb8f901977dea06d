"""The forward pass with the KV cache as explicit inputs and outputs: what an exported graph runs.

HF optimum's and ONNX Runtime GenAI's decoder interface, written from batchgen's own model
modules (engine/models/): the same weights and the same layer code (projections, norms,
rotary, MLPs, heads), only the attention's cache handling is here. One module serves prefill
and decode: past_key_values of length 0 is a prefill.

    input_ids       (batch, seq)               int64
    attention_mask  (batch, past + seq)        int64, 1 = a real token (left padding)
    position_ids    (batch, seq)               int64
    past_key_values.{i}.key / .value  (batch, num_kv_heads, past, head_dim)
  ->
    logits          (batch, seq, vocab)        float32
    present.{i}.key / .value          (batch, num_kv_heads, past + seq, head_dim)

nanochat's smear gate carries the previous token's normed embedding from step to step: it is
one more pair, `past_smear` (batch, n_embd) -> `present_smear` (batch, n_embd) (zeros before a
prefill).

The static variant (`static_max_len=N`, ExecuTorch's static cache, GenAI's
past_present_share_buffer): the KV inputs are fixed buffers (batch, num_kv_heads, N, head_dim),
`attention_mask` is (batch, N), and a `cache_position` (seq,) int64 input (HF's StaticCache
name) says at which buffer index the step's tokens go; `present.*` are the same buffers with
the step's keys and values scattered in (ScatterND in ONNX; nothing else is copied).

Attention masking is built explicitly from the mask and the indices (a query at cache index
i sees keys j <= i with attention_mask 1, and j >= i - window in a sliding-window layer): SDPA's
is_causal aligns its mask top-left, which is wrong whenever a step has fewer queries than keys.
Positions are tensors throughout (no `.item()`), so tracing bakes in no position.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from engine.models.base import CausalLM
from engine.models.gpt2 import GPT2
from engine.models.layers import RotaryStep, add_rms_norm
from engine.models.llama import LlamaModel
from engine.models.nanochat import NanochatGPT


@contextmanager
def reference_mode(model: CausalLM):
    """Inside it the model's projections and pointwise functions are torch's plain operations
    (`reference_numerics`), never the compiled CPU kernels, which no exporter can see through."""
    prev = model._reference
    model._reference = True
    try:
        yield
    finally:
        model._reference = prev


def attention_bias(attention_mask: torch.Tensor, query_index: torch.Tensor, window: int | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of one layer: (batch, 1, seq, keys) of 0 where a query may attend and
    the dtype's lowest finite value elsewhere (finite: a padding query that sees nothing gets a
    harmless uniform average, never NaN that could leak into the real rows).

    attention_mask (batch, keys) int64; query_index (seq,) int64, each query's index among the
    keys; window: a query at index i sees keys i - window .. i (None: every earlier key).
    With left padding a real token's index differs from its position by the row's padding,
    the same for all its keys, so index distances are position distances.
    """
    keys = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    allowed = keys[None, :] <= query_index[:, None]
    if window is not None:
        allowed = allowed & (keys[None, :] >= query_index[:, None] - window)
    allowed = allowed[None, None] & attention_mask[:, None, None, :].bool()
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) + bias) v, scores and softmax in float32.
    q (B, H, T, D); k, v (B, KV, S, D) with H a multiple of KV (grouped-query attention: query
    head h reads KV head h // (H / KV)); bias (B, 1, T, S). -> (B, H, T, D) in q's dtype."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1])) + bias.float()
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


class KVExplicitForward(nn.Module):
    """Wraps a loaded `CausalLM` (GPT2, LlamaModel, NanochatGPT) as the graph's forward.

    forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present), past and
    present in the order key 0, value 0, key 1, value 1, ... then `smear` (nanochat with a
    smear gate); with static_max_len the fourth input is cache_position (seq,) int64.
    Raises ExportError (engine/export/errors.py) for a model class it does not know.
    """

    def __init__(self, model: CausalLM, static_max_len: int | None = None):
        super().__init__()
        from engine.export.errors import ExportError

        if not isinstance(model, (GPT2, LlamaModel, NanochatGPT)):
            raise ExportError(f"export: no KV-explicit forward for {type(model).__name__}")
        self.model = model
        self.static_max_len = static_max_len
        self.windows: list[int | None] = (list(model.cfg.windows) if isinstance(model, LlamaModel) else
                                          list(model.windows) if isinstance(model, NanochatGPT) else
                                          [None] * model.info.n_layer)
        self.has_smear = isinstance(model, NanochatGPT) and model.smear_gate is not None
        if isinstance(model, LlamaModel):
            model.rotary.ensure(model.rotary.max_positions)  # the whole table: a constant of the graph

    # ---------------------------------------------------------------- names
    def input_names(self) -> list[str]:
        names = ["input_ids", "attention_mask", "position_ids"]
        if self.static_max_len is not None:
            names.append("cache_position")
        names += [f"past_key_values.{i}.{kv}" for i in range(self.model.info.n_layer) for kv in ("key", "value")]
        return names + (["past_smear"] if self.has_smear else [])

    def output_names(self) -> list[str]:
        names = ["logits"] + [f"present.{i}.{kv}" for i in range(self.model.info.n_layer) for kv in ("key", "value")]
        return names + (["present_smear"] if self.has_smear else [])

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *rest: torch.Tensor):
        static = self.static_max_len is not None
        cache_position = rest[0] if static else None
        past = list(rest[1:] if static else rest)
        smear = past.pop() if self.has_smear else None
        T = input_ids.shape[1]
        if static:
            query_index = cache_position
        else:  # the step's tokens follow the past: indices past .. past + seq - 1
            query_index = torch.arange(T, device=input_ids.device) + (attention_mask.shape[1] - T)
        biases: dict[int | None, torch.Tensor] = {}
        presents: list[torch.Tensor] = []
        dtype = self.model.kv_dtype

        def layer_attention(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            w = self.windows[i]
            if w not in biases:
                biases[w] = attention_bias(attention_mask, query_index, w, dtype)
            pk, pv = past[2 * i], past[2 * i + 1]
            if static:  # the step's keys scattered into the fixed buffer at cache_position
                k = pk.index_copy(2, cache_position, k.to(pk.dtype))
                v = pv.index_copy(2, cache_position, v.to(pv.dtype))
            else:
                k, v = torch.cat([pk, k.to(pk.dtype)], dim=2), torch.cat([pv, v.to(pv.dtype)], dim=2)
            presents.extend((k, v))
            return attend(q, k, v, biases[w])

        with reference_mode(self.model):
            if isinstance(self.model, LlamaModel):
                logits = self._llama(input_ids, position_ids, layer_attention)
            elif isinstance(self.model, GPT2):
                logits = self._gpt2(input_ids, position_ids, layer_attention)
            else:
                logits, smear = self._nanochat(input_ids, attention_mask, position_ids, query_index, smear,
                                               layer_attention)
        return (logits, *presents) + ((smear,) if self.has_smear else ())

    def _llama(self, tokens, positions, layer_attention):
        m = self.model
        rope = RotaryStep(m.rotary, positions, m.rotary.max_positions - 1, None)
        x, delta = m.embedding(tokens, m.embed), None
        for i, layer in enumerate(m.layers):
            x, h = add_rms_norm(x, delta, layer.input_norm, m.cfg.rms_norm_eps, None)
            q, k, v = m._attention_inputs(layer, h, rope)
            x, delta = m._attention_out_mlp(layer, x, layer_attention(i, q, k, v), None)
        return m._logits(x, delta, None)

    def _gpt2(self, tokens, positions, layer_attention):
        m = self.model
        x = m._embed(tokens, positions)
        for i, blk in enumerate(m.blocks):
            q, k, v = m._qkv(blk, i, x)
            x = m._attn_out_mlp(blk, x, layer_attention(i, q, k, v))
        return m._logits(x)

    def _nanochat(self, tokens, attention_mask, positions, query_index, smear, layer_attention):
        m = self.model
        x = m._embed(tokens)
        # bfloat16 tables (2025 models) widened: nanochat's products promote them to x's dtype
        # anyway (exactly), and onnxruntime's CPU kernels have no bfloat16 Neg/Mul
        cos, sin = m.cos[positions].unsqueeze(2).to(x.dtype), m.sin[positions].unsqueeze(2).to(x.dtype)
        if smear is not None:
            # each token mixes in its predecessor's normed embedding (the carried state for the
            # step's first token), unless the predecessor is padding or there is none
            prev_index = query_index - 1
            has_prev = attention_mask[:, prev_index.clamp(min=0)].bool() & (prev_index >= 0)[None, :]
            has_prev = has_prev.to(x.dtype)[..., None]
            prev = torch.cat([smear[:, None, :].to(x.dtype), x], dim=1)[:, :tokens.shape[1]]
            new_smear = x[:, -1]
            x = x + m._smear_gate(x) * (prev * has_prev)
            smear = new_smear
        return m._logits(m._trunk(x, tokens, cos, sin, layer_attention)), smear
