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

# Smallest input width (features) whose float32 CPU projections go through oneDNN (`linear`):
# below it a matmul is cheap and the call overhead is not worth a second copy of the weight.
PACK_MIN_IN_FEATURES = 512


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

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for every projection of the models: x (..., C), weight (N, C),
        bias (N,) or None -> (..., N).

        In float32 on CPU, for C >= PACK_MIN_IN_FEATURES, it runs through oneDNN with the weight
        reordered once into its blocked layout (torch's mkldnn linear, the kernel inductor
        uses). Measured on 2 AVX2 cores at GPT-2-small shapes, with 128 rows, it is 1.25-1.46x
        faster than F.linear (MKL), up to 2.6x with 8 rows; and each row's result is
        bit-identical whatever the number of rows, which F.linear's is not (about 1e-6 apart),
        so a sample's tokens cannot depend on how many neighbours it had. The price is a
        second, reordered copy of those weights (CPU memory only). Elsewhere (GPU, bf16, small
        C, no oneDNN) it is F.linear. The rule depends only on the model and device, so a
        model always takes the same path; results may differ from F.linear in the last bits
        (about 1e-6 relative).
        """
        if x.dtype == torch.float32 and x.device.type == "cpu" and weight.shape[1] >= PACK_MIN_IN_FEATURES:
            packed = self._packed_weight(weight)
            if packed is not None:
                y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
                return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, weight, bias)

    def project_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for the output head of a step: x (B, C), weight (N, C) -> (B, N).

        The head (N = the vocabulary) is the largest matmul of a decode step; it goes through
        `linear` (oneDNN on CPU for C >= PACK_MIN_IN_FEATURES: 1.8x faster than F.linear on
        GPT-2's head with 128 rows). Otherwise allocating the (B, N) output every step would
        dominate a small model's head, so the result is a plain matmul into a buffer that
        every step reuses; it is valid until the next call.
        """
        if x.dtype != torch.float32 or x.dim() != 2:
            return F.linear(x, weight)
        if x.device.type == "cpu" and x.shape[1] >= PACK_MIN_IN_FEATURES and self._packed_weight(weight) is not None:
            return self.linear(x, weight)
        B, N = x.shape[0], weight.shape[0]
        buf = self._head_out
        if buf is None or buf.shape[0] < B or buf.shape[1] != N or buf.device != x.device:
            buf = self._head_out = torch.empty(max(B, 64), N, device=x.device)
        return torch.mm(x, weight.t(), out=buf[:B])

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The oneDNN-reordered copy of `weight`, made once per weight; None when oneDNN is
        unavailable or its result does not match F.linear (a private torch API: checked,
        never trusted)."""
        cache = self.__dict__.setdefault("_packed_weights", {})
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride())
        if key in cache:
            return cache[key]
        packed = None
        try:
            if torch.backends.mkldnn.is_available():
                w = weight.detach().contiguous()
                cand = torch.ops.mkldnn._reorder_linear_weight(w, 128)
                probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
                got = torch.ops.mkldnn._linear_pointwise(probe, cand, None, "none", [], "")
                want = F.linear(probe, w)
                if torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                    packed = cand
        except (AttributeError, RuntimeError, TypeError):
            packed = None
        cache[key] = packed
        return packed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
