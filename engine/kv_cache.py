"""The KV cache: one arena of key/value positions per layer, and the per-sequence model state.

Storage per layer is (num_positions, n_kv_head, head_dim), flash-attention's and nanochat's
(T, H, D) order: one decode step's keys for a row are one contiguous run, written with a
single index_copy_, and any run of positions is a (H, T, D) view of the arena without a copy.
Who owns which positions is the scheduler's business (engine/scheduler.py, with
engine/run_allocator.py): a prompt's KV is one run written once at prefill and read by all
its samples; each sample's generated KV is one run of its own (engine/kernels/kv_layout.py).

Models call `attend(layer, q, k, v, batch, window)` and never index the cache themselves:
`StepBatch` describes one forward (prefill or decode) and carries the `KVLayout` that says
where each row's KV lives. A StepBatch without a layout uses the static-slot layout (row r's
sequence at positions slots[r] * max_seq_len + p), the cache's default shape of `num_slots`
sequences of `max_seq_len` positions. `attend` stores the step's keys and values and runs the
attention chosen for the cache's device when it was made (engine/kernels/attention_backend.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.kernels.attention import prefill_mask
from engine.kernels.attention_backend import attention_backend
from engine.kernels.kv_layout import KVLayout


@dataclass(slots=True)
class StepBatch:
    """One forward pass over the cache, built by the engine, read by the model.

    slots: (B,) int64, each row's sequence slot: its row of per-sequence model state
        (`KVCache.state`; prefill: the slot of the prompt's first sample).
    positions: (B, T) int64, the position of each input token (prefill: c..c+T-1 for a row
        whose first c positions are a cached prefix (`KVLayout.position0`, usually 0), rows
        right-padded to T; decode: T == 1 and each row's own position).
    last_index: (B,) int64, index along T of each row's last real token, where the
        logits are taken (prefill: length - 1; decode: 0).
    prefill: True for a prefill, False for a one-token decode step.
    kv_len: max(positions) + 1, the longest sequence of the step (host int); a prefill from
        position 0 may leave it 0 (`last_position`).
    slot_start: accepted for callers of the static-slot layout; not needed by the cache.
    layout: where each row's keys and values live (engine/kernels/kv_layout.py); None means the
        static-slot layout, built from `slots` and `positions` (which costs a device sync).
    all_logits: prefill only: the forward returns the logits at every position, (B, T, V),
        instead of at last_index (scoring a given continuation: `teacher_forced_logits`).
    prev_tokens: prefill only, (B,) int64 or None: the token before each row's first input
        (the last of a cached prefix; -1 for a row from position 0), for models whose step
        reads it (nanochat's smear); None when every row starts at position 0.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    last_index: torch.Tensor
    prefill: bool
    kv_len: int = 0
    slot_start: int | None = None
    layout: KVLayout | None = None
    all_logits: bool = False
    prev_tokens: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    def last_position(self, T: int) -> int:
        """The largest of `positions` as a host int (no device sync): kv_len - 1, or T - 1 for
        a prefill from position 0 that left kv_len 0."""
        return self.kv_len - 1 if self.kv_len else T - 1

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Prefill only: the (1, 1, T, T) boolean mask (True = attend) for a layer with this
        left window, or None when plain causal attention is the same.

        window: a query at position i sees keys i - window .. i (flash-attention's (left, 0)
        window, nanochat's sliding window); None is full causal context.
        """
        if window not in self._masks:
            m = prefill_mask(self.positions.shape[1], window, self.slots.device)
            self._masks[window] = None if m is None else m[None, None]
        return self._masks[window]


class KVCache:
    """Keys and values in one arena of positions per layer, plus per-sequence state.

    Args:
        n_layer, n_kv_head, head_dim: the model's attention shape.
        num_slots: sequences decoding at once, at most (rows of `state`).
        max_seq_len: the longest sequence, prompt + generated, in positions.
        dtype, device: storage (the model's compute dtype; bfloat16 for a model with
            bfloat16 weights and float32 activations: keys and values are rounded to
            bfloat16 as they are stored, and attention widens them back as it reads).
        state_dims: extra per-sequence model state, name -> width, stored as (num_slots,
            width) tensors in `self.state` (nanochat's smear keeps the previous token's
            embedding there), in `state_dtype` (default: dtype; the activations' dtype).
        batch_invariant: on CPU, attention whose result for a row is bit-identical whatever
            else is in the step; GPUs ignore it. The attention implementation is chosen once
            for the device (`self.attention`: engine/kernels/attention_backend.py); on CPU
            `batched_decode` switches decode to the GPU path.
        num_positions: positions per layer (default num_slots * max_seq_len: a full-length
            slot per sequence, the static layout).

    Memory: `bytes_per_position(...) * num_positions` bytes plus the state, allocated with
    torch.empty (on CPU the operating system commits pages only when they are first written,
    and attention never reads a position before it is written).
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, num_slots: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device | str, state_dims: dict[str, int] | None = None,
                 batch_invariant: bool = True, num_positions: int | None = None,
                 state_dtype: torch.dtype | None = None):
        self.num_positions = num_positions if num_positions is not None else num_slots * max_seq_len
        shape = (n_layer, self.num_positions, n_kv_head, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.state = {name: torch.zeros(num_slots, dim, dtype=state_dtype or dtype, device=device)
                      for name, dim in (state_dims or {}).items()}
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.batch_invariant = batch_invariant
        self.attention = attention_backend(device, batch_invariant)  # chosen once, for the device

    @staticmethod
    def bytes_per_position(n_layer: int, n_kv_head: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one position costs: K and V for every layer."""
        return 2 * n_layer * n_kv_head * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V arenas."""
        return self.k.nbytes + self.v.nbytes

    # ------------------------------------------------------------------ attention
    @property
    def batched_decode(self) -> bool:
        """Decode through decode_batched (what GPUs run); set True on a CPU cache, tests run
        the GPU path without a GPU (engine/kernels/attention_backend.py)."""
        return self.attention.batched_decode

    @batched_decode.setter
    def batched_decode(self, value: bool) -> None:
        self.attention.batched_decode = value

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: StepBatch, window: int | None = None) -> torch.Tensor:
        """Store this step's keys/values for `layer` and attend over each row's history.

        q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim), already rotated
        and normed as the model requires. Returns (B, n_head, T, head_dim).
        Grouped-query attention (n_head a multiple of n_kv_head, query head h reading KV head
        h // (n_head / n_kv_head)) is handled here. Scale is SDPA's default 1/sqrt(head_dim).
        window: a query at position i sees keys i - window .. i; None is full context.
        """
        layout = batch.layout if batch.layout is not None else self._static_layout(batch)
        kc, vc = self.k[layer], self.v[layer]
        if batch.prefill:
            B, H, T, D = k.shape
            dst, src = layout.prefill_write(T)
            kc.index_copy_(0, dst, k.transpose(1, 2).reshape(B * T, H, D).index_select(0, src).to(kc.dtype))
            vc.index_copy_(0, dst, v.transpose(1, 2).reshape(B * T, H, D).index_select(0, src).to(vc.dtype))
            return self.attention.prefill(q, k, v, kc, vc, layout, window, batch.mask)
        return self.attention.decode(q, k, v, kc, vc, layout, window)

    def _static_layout(self, batch: StepBatch) -> KVLayout:
        slots = batch.slots.tolist()
        if batch.prefill:
            layout = KVLayout.static_slots(slots, [], self.max_seq_len, self.k.device, prefill=True,
                                           lengths=(batch.last_index + 1).tolist())
        else:
            layout = KVLayout.static_slots(slots, batch.positions[:, 0].tolist(), self.max_seq_len, self.k.device)
        batch.layout = layout  # every layer of the step shares it
        return layout

    # ------------------------------------------------------------------ copies
    def copy_positions(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K and V of arena positions `src` into positions `dst`, every layer: (N,) int64 each."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def copy_run(self, src: int, dst: int, n: int) -> None:
        """K and V of arena positions [src, src + n) into [dst, dst + n), every layer: a
        prompt's cached prefix copied from another prompt's run (engine/prefix_cache.py).
        Raises ValueError when the two ranges overlap."""
        if n > 0 and src < dst + n and dst < src + n:
            raise ValueError(f"KVCache.copy_run: [{src}, {src + n}) and [{dst}, {dst + n}) overlap")
        for arena in (self.k, self.v):
            arena[:, dst:dst + n].copy_(arena[:, src:src + n])

    def slide_down(self, moves: list[tuple[int, int, int]], chunk_bytes: int = 64 << 20) -> None:
        """Move runs of positions down the arena, every layer, K and V: (src, dst, length) per
        run, sorted by src, each dst <= src, each run and its destination ending at or below the
        next run's src and dst (what a sliding compaction gives: engine/run_allocator.py,
        `RunAllocator.compact`). Copied in that order, every run's positions are read before
        anything is written over them, so a run may overlap its own destination. Values are
        copied exactly.

        A run moving by at least its length is one copy per arena; one that overlaps its
        destination is copied from its low end in pieces as long as the move (each clear of
        its own source) when the move is at least 64 positions, else through a buffer of at
        most `chunk_bytes` per arena.
        Raises ValueError for moves out of that order (they could overwrite a run not yet moved).
        """
        for i, (src, dst, n) in enumerate(moves):
            nxt_src, nxt_dst = moves[i + 1][:2] if i + 1 < len(moves) else (self.num_positions,) * 2
            if not (0 <= dst <= src and n >= 0 and src + n <= nxt_src and dst + n <= min(nxt_src, nxt_dst)):
                raise ValueError(f"KVCache.slide_down: move {i} ({src} -> {dst}, {n} positions) is out of order "
                                 f"(each must go down, sorted by source, and end below the next source and "
                                 f"destination)")
        per_position = self.k[:, :1].nbytes  # one arena, every layer
        step = max(1, chunk_bytes // per_position)
        buf = None
        for src, dst, n in moves:
            shift = src - dst
            if shift == 0 or n == 0:
                continue
            piece = n if shift >= n else shift if shift >= 64 else 0
            for arena in (self.k, self.v):
                if piece:  # pieces of at most the move's length: each lands below its own source
                    for off in range(0, n, piece):
                        c = min(piece, n - off)
                        arena[:, dst + off:dst + off + c].copy_(arena[:, src + off:src + off + c])
                    continue
                if buf is None:
                    buf = torch.empty((self.k.shape[0], min(step, max(m[2] for m in moves)), *self.k.shape[2:]),
                                      dtype=self.k.dtype, device=self.k.device)
                for off in range(0, n, buf.shape[1]):
                    c = min(buf.shape[1], n - off)
                    buf[:, :c].copy_(arena[:, src + off:src + off + c])
                    arena[:, dst + off:dst + off + c].copy_(buf[:, :c])

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per-sequence state of slots `src` into slots `dst`: (N,) int64 each (src may repeat)."""
        for t in self.state.values():
            t[dst] = t[src]

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one slot's state (name -> (width,) tensor)."""
        return {name: t[slot].clone() for name, t in self.state.items()}

    def write_state(self, slots: torch.Tensor, saved: dict[str, torch.Tensor]) -> None:
        """Set the state of `slots` ((N,) int64) to `saved` (from `read_state`)."""
        for name, t in self.state.items():
            t[slots] = saved[name]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Static-slot layout: copy positions [0, length) and the state of slots `src` into
        slots `dst` ((N,) int64 each; src may repeat: one prompt to many samples)."""
        off = torch.arange(length, device=src.device)
        L = self.max_seq_len
        self.copy_positions((src[:, None] * L + off).flatten(), (dst[:, None] * L + off).flatten())
        self.copy_state(src, dst)


# The part of what is free that a default KV budget takes: on a GPU the rest is activations
# and the allocator's slack; on the host the rest is activations, Ray's object store, the
# input and output tables, and everything else the machine runs.
FREE_FRACTION = {"cuda": 0.9, "cpu": 0.5}


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for a new allocation: the GPU's free memory (torch.cuda.mem_get_info), or
    the host's MemAvailable (/proc/meminfo: free pages plus reclaimable caches), else a
    quarter of physical RAM where that is unreadable, else 16 GiB."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_kv_bytes(device: torch.device, share: float = 1.0) -> int:
    """KV budget (bytes) when none is given: a fraction of the device's free memory
    (`FREE_FRACTION`: 90% on a GPU, 50% on the host) times `share`, this engine's share of the
    device: a worker's share of its node (its CPUs over the node's, or the fraction of a GPU
    it was given; cluster/worker.py), so the workers placed on one node or one GPU divide
    what is free instead of each taking all of it. Raises ValueError for a share outside
    (0, 1]."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    return int(free_memory_bytes(device) * FREE_FRACTION.get(device.type, 0.5) * share)


def kv_budget_basis(device: torch.device, share: float = 1.0) -> str:
    """How `default_kv_bytes` came to its number, for messages."""
    where = "this GPU" if device.type == "cuda" else "this host"
    return (f"{FREE_FRACTION.get(device.type, 0.5):.0%} of the {free_memory_bytes(device)} bytes free on {where}"
            + ("" if share == 1.0 else f", times this worker's share of it, {share:.3g}"))
