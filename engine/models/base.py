"""What the engine needs from a model: its shape (`ModelInfo`) and two forwards.

Every architecture in engine/models implements `CausalLM`:
- `forward(tokens)`: the plain, cache-free forward, (B, T) -> (B, T, V) fp32 logits. It is the
  reference the tests compare against (transformers, nanochat) and the KV-cached path must
  agree with it; decorated with `reference_numerics`, its projections are plain F.linear,
  as in the models' own code.
- `forward_step(tokens, batch, kv)`: one prefill or decode step over the KV cache,
  (B, T) -> (B, V) fp32 logits at `batch.last_index` of each row. Attention goes through
  `kv.attend(...)`; per-slot state (nanochat's smear) lives in `kv.state`.
Logits are cropped to the real vocabulary (`info.vocab_size`), padding excluded.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache, StepBatch
from engine.native import NativeKernels, native_kernels


def reference_numerics(forward):
    """Decorator for a model's cache-free `forward`: inside it `linear` and `project_head`
    are plain F.linear, so the reference computes what transformers and nanochat compute
    (bit for bit where their code does the same operations)."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        prev, self._reference = self._reference, True
        try:
            return forward(self, *args, **kwargs)
        finally:
            self._reference = prev
    return wrapper


# Pointwise functions whose value for an element does not depend on the tensor's length.
# PyTorch's CPU kernels run whole SIMD vectors through a vectorized implementation and the
# leftover tail through a scalar one. For sigmoid, silu and tanh-gelu the two disagree in
# the last bit (measured: 4% and 8% of random inputs), so an element's value would depend on
# how many rows share the tensor. exp, tanh, +, *, / and 1/x agree on both paths (0 of
# 256,000 differ: bench/bench_invariance.py), so these compositions are length-invariant; they
# are within 1.2e-7 (sigmoid) and 4.8e-7 (gelu) of torch's.
_GELU_K = math.sqrt(2.0 / math.pi)


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), elementwise, any shape."""
    return torch.reciprocal(torch.exp(-x).add_(1.0))


def invariant_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): GPT-2's gelu (Hendrycks & Gimpel
    2016), computed as x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)),
    because exp is 2.5x faster than tanh here (0.8 against 2.0 ms for 128 x 3072 on one core)."""
    u = (x * x).mul_(0.044715).add_(1.0).mul_(x).mul_(-2.0 * _GELU_K)
    return x / u.exp_().add_(1.0)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return x * invariant_sigmoid(x)


@dataclass(slots=True)
class ModelInfo:
    """Shape facts the engine sizes its KV cache and requests with.

    arch: "gpt2", "nanochat", or a Llama-family model_type ("llama", "mistral", "qwen2",
        "qwen3"). vocab_size: logits width (real vocabulary, tokens).
    context_len: the longest sequence (prompt + generated) the model supports, in tokens
        (GPT-2's n_positions, nanochat's sequence_len, max_position_embeddings).
    n_layer, n_kv_head, head_dim: attention shape, for the KV cache.
    state_dims: extra per-slot state the model keeps in the cache, name -> width.
    description: one line for logs and summaries (the demo model says it is untrained).
    stop_token_ids: the checkpoint's own end tokens (eos_token_id of generation_config.json
        or config.json); the engine stops on these when a request names none, and on the
        tokenizer's defaults when this is empty.
    """

    arch: str
    vocab_size: int
    context_len: int
    n_layer: int
    n_kv_head: int
    head_dim: int
    state_dims: dict[str, int] = field(default_factory=dict)
    description: str = ""
    stop_token_ids: tuple[int, ...] = ()


class CausalLM(nn.Module):
    """Interface of the engine's models (see the module docstring)."""

    info: ModelInfo
    _head_out: torch.Tensor | None = None
    _reference = False  # True inside a @reference_numerics forward

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for every projection of the engine's step: x (..., C),
        weight (N, C), bias (N,) or None -> (..., N).

        In float32 on CPU it runs through oneDNN with the weight reordered once into its
        blocked layout (torch's mkldnn linear, the kernel inductor uses), for two reasons:
        - batch invariance: each row's result is bit-identical whatever the number of rows
          (measured from 1 to 3,000 rows, widths 32 to 3,072), where F.linear (MKL) moves a
          row by 1e-7 to 1e-6 as the row count changes. Those bits could flip a near-tie
          between two tokens, so a sample would depend on its neighbours.
        - speed: on 2 AVX2 cores, 1.25-1.46x F.linear's at GPT-2-small shapes with 128 rows
          (2.6x with 8 rows), 1.2-1.8x on a 50k-100k output head; for widths under 256 it is
          about 0.03 ms a call slower, which is small next to the head.
        The price is a second, reordered copy of the weights in CPU memory. Elsewhere (GPU,
        bf16, no oneDNN, or inside a @reference_numerics forward) it is F.linear. The path
        depends only on the model and device; results differ from F.linear in the last bits
        (about 1e-6 relative).
        """
        if not self._reference and x.dtype == torch.float32 and x.device.type == "cpu":
            packed = self._packed_weight(weight)
            if packed is not None:
                y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
                return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, weight, bias)

    def pointwise(self, reference: Callable[[torch.Tensor], torch.Tensor],
                  invariant: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`invariant(x)` in a CPU step (so a row's value cannot depend on its neighbours, see
        `invariant_sigmoid`), `reference(x)` (torch's kernel) inside a @reference_numerics
        forward and on other devices."""
        if self._reference or x.device.type != "cpu":
            return reference(x)
        return invariant(x)

    def fused_kernels(self, x: torch.Tensor) -> NativeKernels | None:
        """The compiled library (engine/native.py) for a step's fused operations on x's
        device and dtype: CPU float32 outside a @reference_numerics forward, where the library
        could be built; None otherwise (torch's operations)."""
        if self._reference or x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        return native_kernels()

    def project_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for the output head: x (B, C) or (B, T, C), weight (N, C) -> (..., N).

        The head (N = the vocabulary) is the largest matmul of a decode step. On CPU in
        float32 it goes through `linear` (oneDNN). Otherwise (GPU in float32, without oneDNN)
        allocating the (B, N) output every step would be a large part of a small model's
        step, so the result is a matmul into a buffer that every step reuses; it is valid
        until the next call.
        """
        if self._reference or x.dtype != torch.float32 or x.dim() != 2:
            return F.linear(x, weight)
        if x.device.type == "cpu" and self._packed_weight(weight) is not None:
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

    def architecture(self) -> dict[str, Any]:
        """The settings outside the tensors that decide what the model computes (norm eps,
        rope, windows, activation, ...), as plain values. With the class, `info` and the
        state dict's names, shapes and dtypes, they decide whether another checkpoint's
        weights can replace this model's in place (engine/weights.py). Architectures
        override it; the default is nothing beyond those."""
        return {}

    def weights_changed(self) -> None:
        """Forget what was derived from the weights (the oneDNN-packed copies `linear` keeps,
        keyed by storage address): call after writing new values into the parameters in
        place, or `linear` would go on using the old ones."""
        self.__dict__.pop("_packed_weights", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
