"""Decode and prefill attention over the KV arena, with cascade (shared-prefix) decoding.

A decoding row attends to up to two parts of its history (engine/kernels/kv_layout.py): the shared
prompt and its own run. Each part gives an output o and the log-sum-exp l of its scaled
scores; the exact attention over both is the log-sum-exp merge

    m = max(l1, l2),  o = (o1 e^(l1 - m) + o2 e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m))

(Hydragen, arXiv 2402.05099; FlashInfer's cascade attention, "merge_state"). The prompt part
is computed once per prompt for the queries of all its samples (one read of its keys).

Implementations:
- `decode_grouped` (CPU), first choice: the compiled kernel of engine/kernels/native.py
  (engine/kernels/csrc/decode_attention.cpp), one call per layer for the whole step. Per group of
  rows sharing a stored prompt it reads each block of prompt keys once for all of them, then
  each row's own keys, with a per-row online softmax (no merge step). A row's result depends
  only on its own query and keys by construction (see the source), so it needs none of the
  alignment rules below; it matches the fallback to about 1e-6.
- `decode_grouped` (CPU) where the kernel is unavailable (no compiler, not AVX2, another
  dtype or head size, BATCHGEN_NATIVE=0): torch's CPU flash kernel, which returns
  the log-sum-exp (`_scaled_dot_product_flash_attention_for_cpu`), called over strided views
  of the arena (no copies), reading exactly a row's keys (no padding, no mask). Whether a
  query row's result can depend on the rest of the call, measured on torch 2.13
  (bench/bench_invariance.py, tests/test_attention.py): the kernel gives each thread a
  scratch buffer of q * (k + 2 + head_dim) floats (q query rows per (batch, head) item, k =
  min(keys, 512) keys per block) carved from one allocation, and its matmul into that
  buffer rounds differently when the buffer is not 16-byte aligned. So a row's bits depend
  on which thread runs its item unless q * (k + 2 + head_dim) is a multiple of 4 (or k <= 3,
  too short for the vector path). With `invariant` (batch_invariant):
  - with one query head per KV head (multi-head attention), a row's generated keys are
    attended in chunks whose lengths satisfy that rule for q = 1 (`key_chunks`, a function
    of the row's own length only), merged exactly by log-sum-exp: with q = 1 the kernel takes
    its matrix-vector path, 1.4-5x faster here than a padded q = 4 (bench/bench_invariance.py, 7).
    With g > 1 query heads per KV head (grouped-query attention) the call pads each item to
    the fewest rows >= g that satisfy the rule for all its keys (`aligned_query_rows`);
  - the prompt calls pad each item's query rows to a multiple of 4 (aligned whatever k),
    which is cheap there: one call serves all the prompt's samples.
  A row's output then depends only on its own query and keys: bit-identical whatever the
  batch, the number of threads, and whether its prompt is shared or its own copy. The rule
  is probed once per head_dim and thread count (`alignment_rule_holds`); where it does not
  hold (a CPU whose kernels want wider alignment), every item is padded to 16 query rows.
- `decode_batched` (GPUs; any device; engine/kernels/batched_attention.py): the prompts and
  own runs gathered into padded blocks and attended with plain tensor ops (matmul, masked
  log-sum-exp), a fixed number of calls per step whatever the batch. Not batch-invariant
  (padding changes reduction lengths).

Prefill: `prefill_native` (the compiled kernel), `prefill_rows` (one SDPA call per row, where
the kernel is unavailable) or one SDPA call for the batch. Which of these a KV cache runs is
chosen once, when it is made (engine/kernels/attention_backend.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.kv_layout import KVLayout, RunGroup
from engine.kernels.native import NativeKernels, native_kernels


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): SDPA (scale 1/sqrt(head_dim), no mask) and the log-sum-exp of the scaled scores."""
    out, lse = _FLASH(q, k, v, 0.0, False)
    return out, lse


def merge_attention(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Exact attention over the union of two disjoint key sets from their partial results.

    o1, o2: (..., D) outputs; l1, l2: (...) float32 log-sum-exps (-inf for an empty set, whose
    o must be finite). Returns (..., D) in o1's dtype, computed in float32. Elementwise, so a
    row's result does not depend on the other rows.
    """
    return merge_attention_lse(o1, l1, o2, l2)[0]


def merge_attention_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor,
                        l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_attention` and the log-sum-exp over the union, log(e^l1 + e^l2): ((..., D), (...))."""
    m = torch.maximum(l1, l2)
    a = torch.exp(l1 - m)
    b = torch.exp(l2 - m)
    den = a + b
    out = (o1.float() * a.unsqueeze(-1) + o2.float() * b.unsqueeze(-1)) / den.unsqueeze(-1)
    return out.to(o1.dtype), m + torch.log(den)


_KV_BLOCK = 512  # torch's CPU flash kernel reads keys in blocks of this many (kv_split_size)


# Query rows per item that keep every thread's buffer 64-byte aligned whatever the keys
# (16 x (k + 2 + head_dim) floats): the fallback where the 16-byte rule fails its probe.
_STRICT_ROWS = 16
_RULE_PROBES: dict[tuple, bool] = {}


def alignment_rule_holds(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether, on this machine and thread count, the flash kernel gives every item the same
    bits on any thread whenever the rule of the module docstring says its buffers are aligned.

    Measured on AVX2 (bench/bench_invariance.py, 6); a CPU with wider vectors may need wider
    alignment. So the rule is checked once per (head_dim, dtype, threads) on random data
    (1-4 query rows, keys 1-24 and 508-516 that the rule calls aligned, 2 threads or more
    against one; 10-70 ms) and, where it fails, decode attention pads every item to 16
    query rows instead (aligned to 64 bytes for any key count; slower, still invariant).
    """
    threads = torch.get_num_threads()
    key = (head_dim, dtype, threads)
    if key in _RULE_PROBES:
        return _RULE_PROBES[key]
    ok = True
    if threads > 1:
        gen = torch.Generator().manual_seed(0)
        try:
            for rows in (1, 2, 3, 4):
                for k in list(range(1, 25)) + list(range(508, 517)):
                    if k > 3 and rows * (min(k, _KV_BLOCK) + 2 + head_dim) % 4:
                        continue  # the rule calls it unaligned: never used
                    q = torch.randn(2 * threads, 1, rows, head_dim, generator=gen).to(dtype)
                    kv = torch.randn(2, 2 * threads, 1, k, head_dim, generator=gen).to(dtype)
                    torch.set_num_threads(1)
                    one = _FLASH(q, kv[0], kv[1], 0.0, False)[0]
                    torch.set_num_threads(threads)
                    if not torch.equal(one, _FLASH(q, kv[0], kv[1], 0.0, False)[0]):
                        ok = False
                        break
                if not ok:
                    break
        finally:
            torch.set_num_threads(threads)
    _RULE_PROBES[key] = ok
    return ok


def aligned_query_rows(g: int, keys: int, head_dim: int) -> int:
    """Query rows per item for one invariant call of `g` query heads per KV head over `keys`
    keys (see the module docstring): 1 when g is 1 (the caller then splits the keys with
    `key_chunks`: the matrix-vector path is worth a second call), else the fewest rows >= g
    that keep every thread's scratch buffer aligned (g itself or zero rows added, at most 3)."""
    if g == 1:
        return 1
    k = min(keys, _KV_BLOCK)
    rows = g
    while keys > 3 and rows * (k + 2 + head_dim) % 4:
        rows += 1
    return rows


def key_chunks(length: int, q_rows: int, head_dim: int) -> list[int]:
    """Lengths of consecutive chunks of `length` keys for which torch's CPU flash kernel, with
    `q_rows` query rows per item, gives a row the same bits whichever thread runs it (see the
    module docstring): each chunk has k <= 512 keys and q_rows * (k + 2 + head_dim) a multiple
    of 4, or k <= 3. Most lengths need one chunk or one plus a tail of 1-3 keys; a length
    over 512 takes a chunk per block."""
    out = []
    while length > 0:
        if length <= 3:
            out.append(length)
            break
        k = min(length, _KV_BLOCK)
        while q_rows * (k + 2 + head_dim) % 4:
            k -= 1
        out.append(k)
        length -= k
    return out


def _strided_runs(cache: torch.Tensor, start: int, stride: int, n: int, lo: int, hi: int) -> torch.Tensor:
    """(n, H, hi - lo, D) view of arena positions start + i * stride + [lo, hi) of one layer's
    (positions, H, D) cache, without copying."""
    P, H, D = cache.shape
    return cache.as_strided((n, H, hi - lo, D), (stride * H * D, D, H * D, 1),
                            cache.storage_offset() + (start + lo) * H * D)


def decode_grouped(kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                   window: int | None, invariant: bool = True,
                   new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention in strided groups over the arena (CPU; see the module docstring).

    kc, vc: one layer's (positions, n_kv_head, head_dim) arena. q: (B, n_head, 1, head_dim).
    new_kv: this step's (k, v), each (B, n_kv_head, 1, head_dim), stored first at
    `layout.write_index()` (by the compiled kernel itself when it runs); None when they are
    already in the arena. Returns (B, n_head, 1, head_dim).
    Each row attends to its prompt (the stored run, or its own copy) and to its generated
    tokens in separate calls, merged exactly: the split point is the row's prompt length, so
    a row gets the same bits with or without prefix sharing.
    invariant: attend generated keys in aligned chunks and pad the prompt calls' query rows
    to a multiple of 4 (module docstring), which makes each row's result independent of the
    rest of the step; False makes one unpadded call per part (results then move in the last
    bits with the batch).
    """
    B, Hq, _, D = q.shape
    Hkv = kc.shape[1]
    kernel = native_kernel(q.dtype, D) if kc.is_contiguous() and vc.is_contiguous() else None
    if kernel is not None:
        return decode_native(kernel, kc, vc, q, layout, window, new_kv)
    if new_kv is not None:
        idx = layout.write_index()
        kc.index_copy_(0, idx, new_kv[0][:, :, 0].to(kc.dtype))
        vc.index_copy_(0, idx, new_kv[1][:, :, 0].to(vc.dtype))
    if q.dtype != kc.dtype:  # float32 queries over a bfloat16 cache: torch's kernel wants one dtype
        return decode_grouped(kc, vc, q.to(kc.dtype), layout, window, invariant).to(q.dtype)
    g = Hq // Hkv
    q4 = q.reshape(B, Hkv, g, D)
    t = layout.t
    rule = not invariant or alignment_rule_holds(D, q.dtype)
    multiple = 1 if not invariant else 4 if rule else _STRICT_ROWS
    outs, lses = [], []
    key_bytes = 2 * Hkv * D * kc.element_size()
    for grp in layout.generated_groups(key_bytes):
        last = grp.length0 + t  # offset of this step's token in the rows' generated part
        a, b = layout.key_range(last, 0, last + 1, window)
        qg = _group_queries(q4, grp)
        chunks = [b - a]
        if invariant:
            rows = aligned_query_rows(g, b - a, D) if rule else -(-g // _STRICT_ROWS) * _STRICT_ROWS
            if rows == 1:
                chunks = key_chunks(b - a, 1, D)
            elif rows > g:
                qg = torch.cat([qg, qg.new_zeros(qg.shape[0], Hkv, rows - g, D)], dim=2)
        o, l = _run_group_attention(kc, vc, qg, grp, a, b, chunks)
        outs.append(o[:, :, :g])
        lses.append(l[:, :, :g])
    o_gen = outs[0] if len(outs) == 1 else torch.cat(outs)
    l_gen = lses[0] if len(lses) == 1 else torch.cat(lses)
    pick = layout.generated_pick()
    if pick is not None:
        o_gen, l_gen = o_gen.index_select(0, pick), l_gen.index_select(0, pick)
    o_pre, l_pre = _shared_prompts(kc, vc, q4, layout, window, multiple)
    copies = layout.copy_groups(key_bytes)  # rows with their own copy of the prompt
    if copies:
        m = -(-g // multiple) * multiple
        qpad = q4 if m == g else torch.cat([q4, q4.new_zeros(B, Hkv, m - g, D)], dim=2)
    for grp in copies:
        a, b = layout.key_range(grp.position0 + t, 0, grp.length0, window)
        if a >= b:
            continue
        if o_pre is None:
            o_pre, l_pre = torch.zeros_like(o_gen), torch.full_like(l_gen, float("-inf"))
        o, l = _run_group_attention(kc, vc, _group_queries(qpad, grp), grp, a, b, [b - a])
        if grp.gather is None:
            r0, n = grp.rows[0], grp.num_slots
            o_pre[r0:r0 + n], l_pre[r0:r0 + n] = o[:, :, :g], l[:, :, :g]
        else:
            rows, slots = grp.scatter
            o_pre.index_copy_(0, rows, o[:, :, :g].index_select(0, slots))
            l_pre.index_copy_(0, rows, l[:, :, :g].index_select(0, slots))
    if o_pre is None:
        return o_gen.reshape(B, Hq, 1, D)
    return merge_attention(o_gen, l_gen, o_pre, l_pre).reshape(B, Hq, 1, D)


def native_kernel(dtype: torch.dtype, head_dim: int) -> NativeKernels | None:
    """The compiled kernels (engine/kernels/native.py) when they are available and decode attention
    handles this query dtype (float32, over a float32 or bfloat16 cache) and head_dim; None
    otherwise (torch's kernels then)."""
    if dtype != torch.float32:
        return None
    kernel = native_kernels()
    return kernel if kernel is not None and kernel.supports(head_dim) else None


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, D) with contiguous heads (rows may be strided), copying only when needed."""
    H, D = x.shape[1:]
    return x if x.stride(2) == 1 and (x.stride(1) == D or H == 1) else x.contiguous()


def decode_native(kernel: NativeKernels, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                  window: int | None, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention through the compiled kernel, one call for the step's rows.

    kc, vc: one layer's contiguous (positions, n_kv_head, head_dim) arena. q: (B, n_head, 1,
    head_dim), any strides (the q part of a fused projection is read in place). new_kv:
    this step's (k, v), each (B, n_kv_head, 1, head_dim), stored by the kernel at
    `layout.write_index()` before it attends (in place of two index_copy_ calls); None when
    they are already in the arena. Returns (B, n_head, 1, head_dim).
    """
    B, Hq, _, D = q.shape
    seg, group_ptr, order = layout.native_segments(window, kc.shape[0])  # checks every run, the writes' too
    write = None
    if new_kv is not None:
        k, v = (_rows_of_heads(t[:, :, 0]) for t in new_kv)
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        write = (k, v, layout.write_index())
    out = kernel.decode_attention(_rows_of_heads(q[:, :, 0]), kc, vc, seg, group_ptr, order,
                                  torch.get_num_threads(), new_kv=write)
    return out.view(B, Hq, 1, D)


def _group_queries(q: torch.Tensor, grp: RunGroup) -> torch.Tensor:
    """The (num_slots, ...) queries of a run group's slots from the step's (B, ...) queries."""
    if grp.gather is None:
        return q[grp.rows[0]:grp.rows[0] + grp.num_slots]
    return q.index_select(0, grp.gather)


def _run_group_attention(kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, grp: RunGroup, a: int, b: int,
                         chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a run group's slot queries q (num_slots, Hkv, m, D) to positions [a, b)
    of their runs, in key chunks of the given lengths merged by log-sum-exp: ((num_slots,
    Hkv, m, D), (num_slots, Hkv, m))."""
    n = grp.num_slots
    o = l = None
    for k in chunks:
        oc, lc = _flash_lse(q, _strided_runs(kc, grp.start, grp.stride, n, a, a + k),
                            _strided_runs(vc, grp.start, grp.stride, n, a, a + k))
        o, l = (oc, lc) if o is None else merge_attention_lse(o, l, oc, lc)
        a += k
    return o, l


def _shared_prompts(kc: torch.Tensor, vc: torch.Tensor, q4: torch.Tensor, layout: KVLayout,
                    window: int | None, multiple: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Attention of every row to its stored prompt, one call per prompt for all its rows
    (query rows padded to a multiple of `multiple`): ((B, Hkv, g, D) out, (B, Hkv, g) lse)
    with 0 and -inf for rows without one; (None, None) when no row has one."""
    B, Hkv, g, D = q4.shape
    pc = layout.prefix_calls(window, g, multiple)
    if pc is None:
        return None, None
    # All prompts' queries in one gathered block: (Hkv, B * g + 1, D), the last row zeros.
    qrows = torch.cat([q4.permute(1, 0, 2, 3).reshape(Hkv, B * g, D), q4.new_zeros(Hkv, 1, D)], dim=1)
    qblock = qrows.index_select(1, pc.gather)[None]  # (1, Hkv, slots, D)
    outs, lses = [], []
    # (1, Hkv, hi - lo, D) views of the prompts' runs, made directly (one op per view: this
    # loop runs once per prompt and layer, and its per-call costs add up)
    stride, base = (0, D, Hkv * D, 1), kc.storage_offset()
    assert vc.storage_offset() == base and kc.is_contiguous() and vc.is_contiguous()
    for start, lo, hi, off, n in pc.calls:
        size, at = (1, Hkv, hi - lo, D), base + (start + lo) * Hkv * D
        o, l = _flash_lse(qblock[:, :, off:off + n], kc.as_strided(size, stride, at), vc.as_strided(size, stride, at))
        outs.append(o)
        lses.append(l)
    outs.append(q4.new_zeros(1, Hkv, 1, D))  # the sentinel slot of rows without a prompt part
    lses.append(torch.full((1, Hkv, 1), float("-inf"), dtype=lses[0].dtype, device=q4.device))
    o_pre = torch.cat(outs, dim=2).index_select(2, pc.scatter).view(Hkv, B, g, D).permute(1, 0, 2, 3)
    l_pre = torch.cat(lses, dim=2).index_select(2, pc.scatter).view(Hkv, B, g).permute(1, 0, 2)
    return o_pre, l_pre  # permuted views: the merge reads them as they are


def prefill_mask(T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """(T, T) boolean mask (True = attend) for a prefill of T tokens from position 0 with a
    left `window`; None when plain causal attention is the same (SDPA's is_causal path,
    bit-identical to a no-cache forward)."""
    if window is None or window >= T - 1:
        return None
    i = torch.arange(T, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d <= window)


def prefill_native(kernel: NativeKernels, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, layout: KVLayout,
                   window: int | None) -> torch.Tensor:
    """Prefill attention through the compiled kernel (engine/kernels/csrc/prefill_attention.cpp), one
    call for the batch: each prompt token attends to its prompt's keys as the arena holds
    them (just written by the prefill). q: (B, n_head, T, head_dim), any strides whose
    transpose to (B, T, n_head, head_dim) has contiguous heads (the q part of a fused qkv
    projection does); kc, vc: one layer's contiguous arena. Returns (B, n_head, T, head_dim),
    zeros at padding positions. Row-invariant and the same bits on every ISA by
    construction (see the source); a row whose prompt starts with a cached prefix
    (`layout.position0`) gets the bits it would get in a prefill of the whole prompt."""
    qt = q.transpose(1, 2)
    if qt.stride(3) != 1 or qt.stride(2) != qt.shape[3]:
        qt = qt.contiguous()
    starts, lengths, cached = layout.prefill_runs()
    return kernel.prefill_attention(qt, kc, vc, starts, lengths, window, torch.get_num_threads(),
                                    cached).transpose(1, 2)


def prefill_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                 window: int | None) -> torch.Tensor:
    """Batch-invariant prefill attention (CPU): one unmasked causal SDPA call per row over
    exactly its own tokens, so its result cannot depend on the padded length or the other
    rows. q: (B, n_head, T, D); k, v: (B, n_kv_head, T, D). Padding positions get 0. Used
    where the compiled kernel is unavailable (`prefill_native` otherwise): its rows do not
    depend on the batch, but its bits follow torch's kernels, which differ between AVX2 and
    AVX-512 builds."""
    out = q.new_zeros(q.shape)
    gqa = q.shape[1] != k.shape[1]
    for r, n in enumerate(lengths):
        m = prefill_mask(n, window, q.device)
        out[r:r + 1, :, :n] = F.scaled_dot_product_attention(q[r:r + 1, :, :n], k[r:r + 1, :, :n], v[r:r + 1, :, :n],
                                                             attn_mask=m, is_causal=m is None, enable_gqa=gqa)
    return out
