"""The preallocated KV cache, indexed by slot, and the attention that reads it.

One slot holds one sample's keys and values for every layer, up to `max_seq_len`
positions. The cache is allocated once (gpt-fast style: static shapes, the hot loop never
reallocates); the scheduler decides which request owns which slot, so admission, not an
allocation failure, bounds memory.

Layout per layer: (num_slots, max_seq_len, n_kv_head, head_dim), flash-attention's and
nanochat's (B, T, H, D) order: one decode step's keys for a row are one contiguous run,
written with a single index_copy_, and a decode step over a contiguous range of slots
attends to a transposed view of the cache without copying it.

Models call `attend(layer, q, k, v, batch, window)` and never index the cache
themselves; `StepBatch` describes one forward (prefill or decode) and caches the attention
masks so every layer of a step shares them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def _prefill_mask(T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """(T, T) boolean mask (True = attend) for a prefill of T tokens from position 0 with a
    left `window`; None when plain causal attention is the same (SDPA's is_causal path,
    bit-identical to a no-cache forward)."""
    if window is None or window >= T - 1:
        return None
    i = torch.arange(T, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d <= window)


@dataclass(slots=True)
class StepBatch:
    """One forward pass over the cache, built by the engine, read by the model.

    slots: (B,) int64, the cache slot of each row.
    positions: (B, T) int64, the position of each input token (prefill: 0..T-1 for every
        row, prompts right-padded to T; decode: T == 1 and each row's own position).
    last_index: (B,) int64, index along T of each row's last real token, where the
        logits are taken (prefill: length - 1; decode: 0).
    prefill: True for a prefill from position 0, False for a one-token decode step.
    kv_len: decode only: number of cache positions to read, max(positions) + 1.
    slot_start: decode only: if the rows are exactly slots slot_start .. slot_start+B-1,
        the cache is read as a view; None means gather (slower, always correct).
    live: decode only: per row, False for a dummy row (an idle slot inside a decoded slot
        range) whose output is thrown away; None means every row is live.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    last_index: torch.Tensor
    prefill: bool
    kv_len: int = 0
    slot_start: int | None = None
    live: list[bool] | None = None
    _masks: dict = field(default_factory=dict)
    _ranges: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean attention mask (True = attend) for a layer with this left window.

        window: a query at position i sees keys i - window .. i (flash-attention's
        (left, 0) window, nanochat's sliding window); None is full causal context.
        Prefill: (1, 1, T, T) or None when plain causal suffices. Decode: (B, 1, 1, kv_len).
        """
        if window in self._masks:
            return self._masks[window]
        if self.prefill:
            T = self.positions.shape[1]
            m = _prefill_mask(T, window, self.slots.device)
            if m is not None:
                m = m[None, None]
        else:
            pos = self.positions[:, :1]  # (B, 1)
            j = torch.arange(self.kv_len, device=self.slots.device)[None, :]
            m = j <= pos
            if window is not None:
                m = m & (pos - j <= window)
            m = m[:, None, None, :]
        self._masks[window] = m
        return m

    def row_ranges(self, window: int | None) -> list[tuple[int, int, int, int]]:
        """Per live row, what batch-invariant attention reads: (row, slot, lo, hi).

        Prefill: the row's queries and keys are positions [0, hi) (its prompt, unpadded).
        Decode: its one query attends to key positions [lo, hi) of its own slot (its history,
        cut to the layer's window). Dummy rows are left out.
        """
        if window in self._ranges:
            return self._ranges[window]
        slots = self.slots.tolist()
        if self.prefill:
            ranges = [(r, slots[r], 0, n) for r, n in enumerate((self.last_index + 1).tolist())]
        else:
            ranges = [(r, slots[r], 0 if window is None else max(0, pos - window), pos + 1)
                      for r, pos in enumerate(self.positions[:, 0].tolist())
                      if self.live is None or self.live[r]]
        self._ranges[window] = ranges
        return ranges


# Query rows of a batch-invariant decode call (see _attend_decode_rows).
DECODE_QUERY_ROWS = 4


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_seq_len` tokens.

    Args:
        n_layer, n_kv_head, head_dim: the model's attention shape.
        num_slots: rows of the cache (samples decoding at once, at most).
        max_seq_len: positions per slot (prompt + generated tokens), in tokens.
        dtype, device: storage (the model's compute dtype).
        state_dims: extra per-slot model state, name -> width, stored as
            (num_slots, width) tensors in `self.state` (nanochat's smear keeps the previous
            token's embedding there). Fanned out with the keys and values.
        batch_invariant: on CPU, attend row by row so that a row's result is bit-identical
            whatever else is in the step (see `_attend_prefill_rows`); GPUs ignore it.

    Memory: `bytes_per_slot(...) * num_slots` bytes, allocated with torch.empty (on CPU the
    operating system commits pages only when they are first written).
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, num_slots: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device | str, state_dims: dict[str, int] | None = None,
                 batch_invariant: bool = True):
        shape = (n_layer, num_slots, max_seq_len, n_kv_head, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.state = {name: torch.zeros(num_slots, dim, dtype=dtype, device=device)
                      for name, dim in (state_dims or {}).items()}
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.batch_invariant = batch_invariant
        # Positions [0, written[s]) of slot s hold finite values. Attention reads up to the
        # longest row of a step; masked keys get weight 0, but 0 * NaN from never-written
        # memory would still poison the output, so `initialize` zeroes memory before its first
        # read. Zeroing lazily (not with torch.zeros up front) keeps untouched pages
        # uncommitted; it runs ahead in chunks so a decode step rarely has anything to zero.
        self.written = [0] * num_slots
        self._row = n_kv_head * head_dim

    @staticmethod
    def bytes_per_slot(n_layer: int, n_kv_head: int, head_dim: int, max_seq_len: int,
                       dtype: torch.dtype, state_dims: dict[str, int] | None = None) -> int:
        """Bytes one slot costs: K and V for every layer and position, plus its state."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        kv = 2 * n_layer * n_kv_head * max_seq_len * head_dim
        return (kv + sum((state_dims or {}).values())) * itemsize

    def initialize(self, slots: list[int], length: int, ahead: int = 64) -> None:
        """Make positions [0, length) of `slots` safe to read (zero what was never written).

        Zeroes up to `ahead` positions more than asked, so that one-token-at-a-time growth
        zeroes memory once per `ahead` steps instead of every step.
        """
        for s in slots:
            w = self.written[s]
            if w < length:
                end = min(self.max_seq_len, length + ahead)
                self.k[:, s, w:end] = 0
                self.v[:, s, w:end] = 0
                self.written[s] = end

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: StepBatch, window: int | None = None) -> torch.Tensor:
        """Store this step's keys/values for `layer` and attend over the slot's history.

        q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim), already rotated
        and normed as the model requires. Returns (B, n_head, T, head_dim).
        Grouped-query attention (n_head a multiple of n_kv_head) is handled here.
        Scale is SDPA's default 1/sqrt(head_dim).
        """
        gqa = q.shape[1] != k.shape[1]
        kc, vc = self.k[layer], self.v[layer]
        if batch.prefill:
            T = q.shape[2]
            kc[batch.slots, :T] = k.transpose(1, 2)
            vc[batch.slots, :T] = v.transpose(1, 2)
            if self.batch_invariant and q.device.type == "cpu":
                return self._attend_prefill_rows(q, k, v, batch, window, gqa)
            # A prefill starts at position 0, so its own keys are the whole history: attend
            # to them directly, with the same SDPA call a cache-free forward makes.
            m = batch.mask(window)
            if m is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)
        # Row (slot, position) of the flattened (slots * positions, heads * head_dim) view.
        flat = batch.slots * self.max_seq_len + batch.positions[:, 0]
        B = q.shape[0]
        kc.view(-1, self._row).index_copy_(0, flat, k.reshape(B, self._row))
        vc.view(-1, self._row).index_copy_(0, flat, v.reshape(B, self._row))
        if self.batch_invariant and q.device.type == "cpu":
            return self._attend_decode_rows(layer, q, batch, window, gqa)
        L = batch.kv_len
        if batch.slot_start is not None:
            s0 = batch.slot_start
            keys, values = kc[s0:s0 + B, :L], vc[s0:s0 + B, :L]
        else:
            keys, values = kc[batch.slots, :L], vc[batch.slots, :L]
        return F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=batch.mask(window), enable_gqa=gqa)

    # Batch-invariant attention (CPU, `batch_invariant=True`). SDPA's CPU kernels give a row
    # results that differ in the last bits with the shape of the call it shares: the padded
    # length of a prefill, the longest row of a decode step, even the number of rows (measured:
    # up to 1e-7 between 1 and 4 rows of identical shape). So every row gets its own unmasked
    # call over exactly its own keys: its attention depends only on itself, and no masked key
    # is read. It costs a call per row per layer (9-10% of throughput on GPT-2 small with
    # 128 rows, bench/bench_engine.py). With batch_invariant=False, or on GPUs (where many small kernel
    # launches would cost far more), a step is one masked call.

    def _attend_prefill_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                             window: int | None, gqa: bool) -> torch.Tensor:
        out = q.new_zeros(q.shape)
        for r, _, _, n in batch.row_ranges(window):
            qs, ks, vs = q[r:r + 1, :, :n], k[r:r + 1, :, :n], v[r:r + 1, :, :n]
            m = _prefill_mask(n, window, q.device)
            out[r:r + 1, :, :n] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, is_causal=m is None,
                                                                 enable_gqa=gqa)
        return out

    def _attend_decode_rows(self, layer: int, q: torch.Tensor, batch: StepBatch, window: int | None,
                            gqa: bool) -> torch.Tensor:
        kt, vt = self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)  # (S, H, T, D) views
        ranges = batch.row_ranges(window)
        if len(ranges) < q.shape[0]:  # dummy rows: zeros
            rows = list(torch.zeros_like(q).split(1))
        else:
            rows = [None] * q.shape[0]
        # Each row's query goes in as the first of DECODE_QUERY_ROWS query rows (the others
        # zero): SDPA's CPU kernel takes another path for a lone query row, whose last bits
        # change with the number of threads (measured: up to 9e-8 between 1 and 2 threads);
        # with 4 or more rows a row's result is the same whatever the thread count or row count.
        B, H, _, D = q.shape
        padded = q.new_zeros(B, H, DECODE_QUERY_ROWS, D)
        padded[:, :, :1] = q
        sdpa = F.scaled_dot_product_attention
        for r, s, lo, hi in ranges:
            rows[r] = sdpa(padded[r:r + 1], kt[s:s + 1, :, lo:hi], vt[s:s + 1, :, lo:hi], enable_gqa=gqa)[:, :, :1]
        return torch.cat(rows)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Fan out: copy positions [0, length) of slots `src` into slots `dst`, all layers.

        src, dst: (N,) int64 slot indices (src may repeat: one prompt to many samples).
        """
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]
        for t in self.state.values():
            t[dst] = t[src]
