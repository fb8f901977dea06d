"""What the engine needs from a model: its shape (`ModelInfo`) and two forwards.

Every architecture in engine/models implements `CausalLM`:
- `forward(tokens)`: the plain, cache-free forward, (B, T) -> (B, T, V) fp32 logits. It is the
  reference the tests compare against (transformers, nanochat) and the KV-cached path must
  agree with it; decorated with `reference_numerics`, its projections are plain F.linear,
  as in the models' own code.
- `forward_step(tokens, batch, kv)`: one prefill or decode step over the KV cache,
  (B, T) -> (B, V) fp32 logits at `batch.last_index` of each row. Attention goes through
  `kv.attend(...)`; per-slot state (nanochat's smear) lives in `kv.state`. The logits may
  live in a buffer the model's next step overwrites (`project_head`); a caller that keeps
  them past that takes `owned_logits(...)` of them.
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

from engine.kernels.native import NativeKernels, PackedWeight, native_kernels
from engine.kv_cache import KVCache, StepBatch


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
    """Interface of the engine's models (see the module docstring).

    bfloat16 weights on CPU (`use_bfloat16_weights`): the matrices (projections, embeddings,
    head) are stored in bfloat16 and multiplied by the compiled GEMM in bfloat16 with float32
    sums; everything else (norm weights, biases, activations, the residual stream, rotary
    tables) stays float32, as in llama.cpp, and the KV cache is bfloat16. The GEMMs and the
    KV reads, which are the step's cost, run at bfloat16's rate; the pointwise operations
    cost the same in either dtype, and in float32 they add no rounding of their own.
    """

    info: ModelInfo
    _head_out: torch.Tensor | None = None
    _reference = False  # True inside a @reference_numerics forward
    act_dtype: torch.dtype | None = None  # float32 with bfloat16 weights on CPU; None: the weights' dtype
    _kv_dtype: torch.dtype | None = None

    @property
    def resumes_prefill(self) -> bool:
        """Whether forward_step can prefill past a cached prefix (StepBatch.positions from
        KVLayout.position0 > 0, the prefix's KV already in the cache) with the whole prompt's
        bits (engine/prefix_cache.py): true of a model whose only per-sequence input is the KV
        cache; a model with per-sequence state says so itself (nanochat: its smear reads
        StepBatch.prev_tokens)."""
        return not self.info.state_dims

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype and the model's nominal one: bfloat16 with bfloat16 weights,
        else the parameters' dtype."""
        return self._kv_dtype or next(self.parameters()).dtype

    def use_bfloat16_weights(self) -> None:
        """Store every matrix parameter (2-d: projections, embeddings, the head) in bfloat16
        and keep the others (norms, biases, per-layer scalars) and the activations in float32
        (see the class docstring). Call on a float32 model before its first step; the
        engine's CPU loader does for `dtype: bfloat16` where the compiled GEMM is available."""
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.data = p.data.to(torch.bfloat16)
        self.act_dtype, self._kv_dtype = torch.float32, torch.bfloat16
        self.weights_changed()

    def as_cached(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a reference forward attends to: as the KV cache would hold
        them (rounded to bfloat16 and widened back for bfloat16 weights; unchanged otherwise),
        so the cache-free forward computes what the cached steps compute."""
        if self._kv_dtype is None or k.dtype == self._kv_dtype:
            return k, v
        return k.to(self._kv_dtype).to(k.dtype), v.to(self._kv_dtype).to(v.dtype)

    def embedding(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """F.embedding(tokens, table) in the activations' dtype: (...,) int64 -> (..., C)."""
        x = F.embedding(tokens, table)
        return x if self.act_dtype is None else x.to(self.act_dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for every projection of the engine's step: x (..., C),
        weight (N, C), bias (N,) or None -> (..., N) in x's dtype.

        On CPU in float32 or bfloat16 it is the compiled GEMM (engine/kernels/csrc/gemm.cpp) with the
        weight packed once into its panel layout: each output element is one fused
        multiply-add chain over C in order, so a row's bits do not depend on how many rows
        share the call, on the thread count or on the instruction set (AVX2 and AVX-512 give
        the same bits). A library GEMM does not promise that: oneDNN's and MKL's rows move
        by about 1e-7 relative with the row count on AVX-512 Xeons, enough to flip a near-tie
        between two tokens. The price is a second, packed copy of the weights in memory.
        Without the compiled library, in float32 on CPU it is oneDNN's linear with the
        weight reordered once (row-invariant on the CPUs measured, not by construction);
        elsewhere (GPU, float16, inside a @reference_numerics forward) F.linear. The path
        depends only on the model, device and dtype; results differ from F.linear in the
        last bits (about 1e-6 relative).
        """
        return self._linear(x, weight, bias, x.dtype)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        if not self._reference and x.device.type == "cpu" and x.dtype in (weight.dtype, torch.float32):
            packed = self._packed_weight(weight, bias)
            if isinstance(packed, PackedWeight):  # the compiled GEMM (float32 activations or the weight's dtype)
                return self._gemm(x, packed, out_dtype)
            if packed is not None and x.dtype == weight.dtype:  # oneDNN's reordered float32 weight
                y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
                return y.view(*x.shape[:-1], y.shape[-1]).to(out_dtype)
        if x.dtype != weight.dtype:
            # float32 activations, bfloat16 weight, elsewhere: the products the compiled GEMM
            # forms (x rounded to bfloat16, exact products in float32), summed by torch
            w, b = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
            return F.linear(x.to(weight.dtype).to(x.dtype), w, b).to(out_dtype)
        return F.linear(x, weight, bias).to(out_dtype)

    @staticmethod
    def _gemm(x: torch.Tensor, packed: PackedWeight, out_dtype: torch.dtype,
              out: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = native_kernels().gemm(x2, packed, out_dtype, torch.get_num_threads(), out=out)
        return y.view(*x.shape[:-1], y.shape[-1])

    def pointwise(self, reference: Callable[[torch.Tensor], torch.Tensor],
                  invariant: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`invariant(x)` in a CPU step (so a row's value cannot depend on its neighbours, see
        `invariant_sigmoid`), `reference(x)` (torch's kernel) inside a @reference_numerics
        forward and on other devices."""
        if self._reference or x.device.type != "cpu":
            return reference(x)
        return invariant(x)

    def fused_kernels(self, x: torch.Tensor) -> NativeKernels | None:
        """The compiled library (engine/kernels/native.py) for a step's fused operations on x's
        device and dtype: CPU float32 outside a @reference_numerics forward, where the library
        could be built; None otherwise (torch's operations)."""
        if self._reference or x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        return native_kernels()

    def project_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for the output head: x (B, C) or (B, T, C), weight (N, C) -> (..., N)
        float32 logits, whatever the compute dtype.

        The head (N = the vocabulary) is the largest matmul of a decode step, and its (B, N)
        float32 output the step's largest tensor (25 MB for 128 rows of a 49k vocabulary): a
        fresh one each step would cost its pages' first-touch faults (on CPU, glibc maps so
        large a block afresh; about 5 ms a step) or, on a GPU, a large part of a small model's
        step. So a 2-D x's logits go into a buffer that every step reuses: they are valid
        until the next call, and whatever keeps them past it (a prefill's, kept across prefill
        chunks and for samples admitted later) takes `owned_logits` of them. On CPU the head
        is `linear`'s compiled GEMM (or oneDNN) and, for a bfloat16 model, returns the float32
        sums unrounded: sampling and logprobs work on float32 logits.
        """
        if not self._reference and x.device.type == "cpu":
            packed = self._packed_weight(weight, None)
            if isinstance(packed, PackedWeight) and x.dim() == 2 and x.dtype in (weight.dtype, torch.float32):
                return self._gemm(x, packed, torch.float32, out=self._head_buffer(x.shape[0], weight.shape[0], x.device))
            if isinstance(packed, PackedWeight) or (packed is not None and x.dtype == torch.float32):
                return self._linear(x, weight, None, torch.float32)
        if self._reference or x.dtype != torch.float32 or x.dim() != 2 or weight.dtype != x.dtype:
            return self._linear(x, weight, None, x.dtype)
        return torch.mm(x, weight.t(), out=self._head_buffer(x.shape[0], weight.shape[0], x.device))

    def _head_buffer(self, B: int, N: int, device: torch.device) -> torch.Tensor:
        """(B, N) float32 rows of the reused logits buffer (grown, never shrunk)."""
        buf = self._head_out
        if buf is None or buf.shape[0] < B or buf.shape[1] != N or buf.device != device:
            buf = self._head_out = torch.empty(max(B, 64), N, device=device)
        return buf[:B]

    def owned_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (or a view of them) as a tensor no later step overwrites: a copy when they
        share `project_head`'s reused buffer, else `logits` themselves (no copy)."""
        buf = self._head_out
        if buf is not None and logits.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            return logits.clone()
        return logits

    def _packed_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> "PackedWeight | torch.Tensor | None":
        """The packed copy of `weight` (and its bias) for a CPU step, made once per weight:
        gemm.cpp's (a `PackedWeight`) where the compiled library is available and the dtype
        is float32 or bfloat16; else, in float32, oneDNN's reordered weight (a tensor) when
        its result matches F.linear (a private torch API: checked, never trusted); None
        otherwise (F.linear)."""
        cache = self.__dict__.setdefault("_packed_weights", {})
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype,
               None if bias is None else bias.data_ptr())
        if key in cache:
            return cache[key]
        packed = None
        kernels = native_kernels()
        if kernels is not None and weight.dtype in (torch.float32, torch.bfloat16):
            packed = kernels.pack(weight, bias)
        elif weight.dtype == torch.float32:
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
        weights can replace this model's in place (engine/loading/weight_swap.py). Architectures
        override it; the default is nothing beyond those."""
        return {}

    def weights_changed(self) -> None:
        """Forget what was derived from the weights (the packed copies `linear` keeps, keyed
        by storage address): call after writing new values into the parameters in
        place, or `linear` would go on using the old ones."""
        self.__dict__.pop("_packed_weights", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
