"""Which attention a KV cache runs, chosen once when the cache is made (`attention_backend`).

- `CpuAttention` (a CPU cache): prefill through the compiled kernel
  (engine/kernels/csrc/prefill_attention.cpp, `prefill_native`) where it handles the query
  dtype and head size, else one SDPA call per row (`prefill_rows`, batch-invariant) or one
  SDPA call for the batch (batch_invariant off); decode through `decode_grouped` (the compiled
  kernel, else torch's CPU flash kernel; engine/kernels/attention.py). `batched_decode`
  switches its decode to the GPU path below, so tests exercise that path without a GPU.
- `BatchedAttention` (any other device): prefill with one SDPA call for the batch, decode with
  `decode_batched` (engine/kernels/batched_attention.py). Not batch-invariant.

Both take one layer's arena (kc, vc: (positions, n_kv_head, head_dim)), the step's queries q
(B, n_head, T, head_dim) and keys and values k, v (B, n_kv_head, T, head_dim), and the
`KVLayout` saying where each row's keys live; they return (B, n_head, T, head_dim). A prefill's
keys are already in the arena (the cache writes them); a decode step's are stored here, by the
compiled kernel itself when it runs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels.attention import decode_grouped, native_kernel, prefill_native, prefill_rows
from engine.kernels.batched_attention import decode_batched
from engine.kernels.kv_layout import KVLayout

# window -> the (1, 1, T, T) prefill mask (True = attend), or None for plain causal attention
MaskFn = Callable[[int | None], torch.Tensor | None]


def attention_backend(device: torch.device | str, batch_invariant: bool) -> CpuAttention | BatchedAttention:
    """The attention a KV cache on `device` runs (see the module docstring). batch_invariant:
    on CPU, a row's result is bit-identical whatever else is in the step; GPUs ignore it."""
    if torch.device(device).type == "cpu":
        return CpuAttention(batch_invariant)
    return BatchedAttention()


class CpuAttention:
    """Attention over a CPU arena (see the module docstring)."""

    def __init__(self, batch_invariant: bool):
        self.batch_invariant = batch_invariant
        self.batched_decode = False  # True: decode through decode_batched, what GPUs run

    def resumes_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a prefill may start past position 0 (a prompt's cached prefix already in
        its run): only the compiled kernel reads a prompt's earlier keys from the arena."""
        return native_kernel(dtype, head_dim) is not None

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                layout: KVLayout, window: int | None, mask: MaskFn) -> torch.Tensor:
        """A prefill of each row's positions layout.position0 .. length - 1 (0 unless
        `resumes_prefill`), their keys already stored at `layout`'s runs."""
        kernel = native_kernel(q.dtype, k.shape[3]) if kc.is_contiguous() else None
        if kernel is not None:  # one call for the batch, from the arena just written
            return prefill_native(kernel, q, kc, vc, layout, window)
        _whole_prompts(layout)
        k, v = _as_stored(k, v, kc)
        if self.batch_invariant:
            return prefill_rows(q, k, v, layout.lengths, window)
        return _prefill_sdpa(q, k, v, mask(window))

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               layout: KVLayout, window: int | None) -> torch.Tensor:
        """One decode step: store this step's keys and values, attend over each row's history."""
        if self.batched_decode:
            return _decode_batched(q, k, v, kc, vc, layout, window)
        return decode_grouped(kc, vc, q, layout, window, invariant=self.batch_invariant, new_kv=(k, v))


class BatchedAttention:
    """Attention in a fixed number of calls per step, on any device (see the module docstring)."""

    batched_decode = True

    def resumes_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """A prefill here always starts at position 0 (its own keys are the whole history)."""
        return False

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                layout: KVLayout, window: int | None, mask: MaskFn) -> torch.Tensor:
        """A prefill from position 0, its keys already stored at `layout`'s runs."""
        _whole_prompts(layout)
        k, v = _as_stored(k, v, kc)
        return _prefill_sdpa(q, k, v, mask(window))

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               layout: KVLayout, window: int | None) -> torch.Tensor:
        """One decode step: store this step's keys and values, attend over each row's history."""
        return _decode_batched(q, k, v, kc, vc, layout, window)


def _whole_prompts(layout: KVLayout) -> None:
    """Raises ValueError for a prefill past position 0 on a path that attends only to the
    prefill's own keys (the engine checks `resumes_prefill` first)."""
    if layout.resumes:
        raise ValueError("this attention path prefills whole prompts only: a cached prefix needs the compiled kernel")


def _as_stored(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 activations over a bfloat16 cache: the prefill attends to the keys and values the
    cache holds (rounded to its dtype), as every later step does."""
    if k.dtype != kc.dtype:
        return k.to(kc.dtype).to(k.dtype), v.to(kc.dtype).to(v.dtype)
    return k, v


def _prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A prefill starts at position 0, so its own keys are the whole history: attend to them
    directly, with the same SDPA call a cache-free forward makes."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _decode_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                    layout: KVLayout, window: int | None) -> torch.Tensor:
    idx = layout.write_index()
    kc.index_copy_(0, idx, k[:, :, 0].to(kc.dtype))
    vc.index_copy_(0, idx, v[:, :, 0].to(vc.dtype))
    return decode_batched(kc, vc, q, layout, window)
