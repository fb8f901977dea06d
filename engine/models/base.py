"""What the engine needs from a model: its shape (`ModelInfo`) and two forwards.

Every architecture in engine/models implements `CausalLM`:
- `forward(tokens)`: the plain, cache-free forward, (B, T) -> (B, T, V) fp32 logits. It is the
  reference the tests compare against (transformers, nanochat) and the KV-cached path must
  agree with it.
- `forward_step(tokens, batch, kv)`: one prefill or decode step over the KV cache,
  (B, T) -> (B, V) fp32 logits at `batch.last_index` of each row. Attention goes through
  `kv.attend(...)`; per-slot state (nanochat's smear) lives in `kv.state`.
Logits are cropped to the real vocabulary (`info.vocab_size`), padding excluded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache, StepBatch


@dataclass(slots=True)
class ModelInfo:
    """Shape facts the engine sizes its KV cache and requests with.

    arch: "gpt2" or "nanochat". vocab_size: logits width (real vocabulary, tokens).
    context_len: the longest sequence (prompt + generated) the model supports, in tokens
        (GPT-2's n_positions, nanochat's sequence_len).
    n_layer, n_kv_head, head_dim: attention shape, for the KV cache.
    state_dims: extra per-slot state the model keeps in the cache, name -> width.
    description: one line for logs and summaries (the demo model says it is untrained).
    """

    arch: str
    vocab_size: int
    context_len: int
    n_layer: int
    n_kv_head: int
    head_dim: int
    state_dims: dict[str, int] = field(default_factory=dict)
    description: str = ""


class CausalLM(nn.Module):
    """Interface of the engine's models (see the module docstring)."""

    info: ModelInfo
    _head_out: torch.Tensor | None = None

    def project_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for the output head: x (B, C), weight (N, C) -> (B, N).

        In float32 the result lands in a buffer reused by every step (the vocabulary-sized
        logits are a decode step's largest allocation: reusing them saves the page faults of a
        fresh 25-100 MB tensor per step). The result is only valid until the next call.
        """
        if x.dtype != torch.float32 or x.dim() != 2:
            return F.linear(x, weight)
        B, N = x.shape[0], weight.shape[0]
        buf = self._head_out
        if buf is None or buf.shape[0] < B or buf.shape[1] != N or buf.device != x.device:
            buf = self._head_out = torch.empty(max(B, 64), N, device=x.device)
        return torch.mm(x, weight.t(), out=buf[:B])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
