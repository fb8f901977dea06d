"""Decode and prefill attention over the KV arena, with cascade (shared-prefix) decoding.

A decoding row attends to up to two parts of its history (engine/kv_layout.py): the shared
prompt and its own run. Each part gives an output o and the log-sum-exp l of its scaled
scores; the exact attention over both is the log-sum-exp merge

    m = max(l1, l2),  o = (o1 e^(l1 - m) + o2 e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m))

(Hydragen, arXiv 2402.05099; FlashInfer's cascade attention, "merge_state"). The prompt part
is computed once per prompt for the queries of all its samples (one read of its keys).

Two implementations:
- `decode_grouped` (CPU): torch's CPU flash kernel, which returns
  the log-sum-exp (`_scaled_dot_product_flash_attention_for_cpu`), called over strided views
  of the arena (no copies). Measured on torch 2.13 (bench/bench_invariance.py): a query row's
  result is bit-identical whatever else is in the call *when every (batch, head) item of the
  call has a multiple of 4 query rows*; with 1, 2 or 3 rows the kernel's result depends on
  which thread runs the item (odd threads differ), and a last block of 1-3 rows (mod 32)
  takes another GEMM path. So with `invariant` (batch_invariant) every call pads its query
  rows to a multiple of 4, and reads exactly the row's keys (no padding, no mask). A row's
  output then depends only on its own query and keys: bit-identical whatever the batch.
- `decode_batched` (GPUs; any device): the prompts and own runs gathered into padded blocks
  and attended with plain tensor ops (matmul, masked log-sum-exp), a fixed number of calls per
  step whatever the batch. Not batch-invariant (padding changes reduction lengths).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kv_layout import KVLayout


def _flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): SDPA (scale 1/sqrt(head_dim), no mask) and the log-sum-exp of the scaled scores."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    return out, lse


def merge_attention(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Exact attention over the union of two disjoint key sets from their partial results.

    o1, o2: (..., D) outputs; l1, l2: (...) float32 log-sum-exps (-inf for an empty set, whose
    o must be finite). Returns (..., D) in o1's dtype, computed in float32. Elementwise, so a
    row's result does not depend on the other rows.
    """
    m = torch.maximum(l1, l2)
    a = torch.exp(l1 - m).unsqueeze(-1)
    b = torch.exp(l2 - m).unsqueeze(-1)
    out = (o1.float() * a + o2.float() * b) / (a + b)
    return out.to(o1.dtype)


def _strided_runs(cache: torch.Tensor, start: int, stride: int, n: int, lo: int, hi: int) -> torch.Tensor:
    """(n, H, hi - lo, D) view of arena positions start + i * stride + [lo, hi) of one layer's
    (positions, H, D) cache, without copying."""
    P, H, D = cache.shape
    return cache.as_strided((n, H, hi - lo, D), (stride * H * D, D, H * D, 1),
                            cache.storage_offset() + (start + lo) * H * D)


def decode_grouped(kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                   window: int | None, invariant: bool = True) -> torch.Tensor:
    """Decode attention in strided groups over the arena (CPU; see the module docstring).

    kc, vc: one layer's (positions, n_kv_head, head_dim) arena, this step's keys already
    written. q: (B, n_head, 1, head_dim). Returns (B, n_head, 1, head_dim).
    Each row attends to its prompt (the stored run, or its own copy) and to its generated
    tokens in separate calls, merged exactly: the split point is the row's prompt length, so
    a row gets the same bits with or without prefix sharing.
    invariant: pad every call's query rows per item to a multiple of 4, which makes each
    row's result independent of the rest of the step; False skips that padding (faster when
    n_head / n_kv_head is not a multiple of 4; results then move in the last bits).
    """
    B, Hq, _, D = q.shape
    Hkv = kc.shape[1]
    g = Hq // Hkv
    q4 = q.reshape(B, Hkv, g, D)
    m = -(-g // 4) * 4 if invariant else g
    qpad = q4 if m == g else torch.cat([q4, q4.new_zeros(B, Hkv, m - g, D)], dim=2)
    t = layout.t
    outs, lses = [], []
    for grp in layout.generated_groups():
        last = grp.length0 + t  # offset of this step's token in the rows' generated part
        a, b = layout.key_range(last, 0, last + 1, window)
        n = grp.row_end - grp.row_begin
        o, l = _flash_lse(qpad[grp.row_begin:grp.row_end], _strided_runs(kc, grp.start, grp.stride, n, a, b),
                          _strided_runs(vc, grp.start, grp.stride, n, a, b))
        outs.append(o)
        lses.append(l)
    o_gen = (outs[0] if len(outs) == 1 else torch.cat(outs))[:, :, :g]
    l_gen = (lses[0] if len(lses) == 1 else torch.cat(lses))[:, :, :g]
    o_pre, l_pre = _shared_prompts(kc, vc, q4, layout, window, 4 if invariant else 1)
    for grp in layout.copy_groups():  # rows with their own copy of the prompt
        a, b = layout.key_range(grp.position0 + t, 0, grp.length0, window)
        if a >= b:
            continue
        if o_pre is None:
            o_pre, l_pre = torch.zeros_like(o_gen), torch.full_like(l_gen, float("-inf"))
        n = grp.row_end - grp.row_begin
        o, l = _flash_lse(qpad[grp.row_begin:grp.row_end], _strided_runs(kc, grp.start, grp.stride, n, a, b),
                          _strided_runs(vc, grp.start, grp.stride, n, a, b))
        o_pre[grp.row_begin:grp.row_end] = o[:, :, :g]
        l_pre[grp.row_begin:grp.row_end] = l[:, :, :g]
    if o_pre is None:
        return o_gen.reshape(B, Hq, 1, D)
    return merge_attention(o_gen, l_gen, o_pre, l_pre).reshape(B, Hq, 1, D)


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
    for start, lo, hi, off, n in pc.calls:
        k = kc[start + lo:start + hi].permute(1, 0, 2)[None]
        v = vc[start + lo:start + hi].permute(1, 0, 2)[None]
        o, l = _flash_lse(qblock[:, :, off:off + n], k, v)
        outs.append(o)
        lses.append(l)
    outs.append(q4.new_zeros(1, Hkv, 1, D))  # the sentinel slot of rows without a prompt part
    lses.append(torch.full((1, Hkv, 1), float("-inf"), dtype=lses[0].dtype, device=q4.device))
    o_pre = torch.cat(outs, dim=2).index_select(2, pc.scatter).view(Hkv, B, g, D).permute(1, 0, 2, 3)
    l_pre = torch.cat(lses, dim=2).index_select(2, pc.scatter).view(Hkv, B, g).permute(1, 0, 2)
    return o_pre.contiguous(), l_pre.contiguous()


def _masked_lse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-op attention with a key mask: q (N, H, M, D), k, v (N, H, L, D), valid broadcastable
    to (N, H, M, L). Returns (out (N, H, M, D) in q's dtype, lse (N, H, M) float32); a query that
    sees no key gets out 0 and lse -inf."""
    scale = q.shape[-1] ** -0.5
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    s = s.masked_fill_(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - finite.unsqueeze(-1))
    return torch.matmul(p.to(v.dtype), v), lse


def decode_batched(kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                   window: int | None) -> torch.Tensor:
    """Decode attention for any device in a fixed number of calls (see the module docstring).

    Same arguments and result as `decode_grouped`. Each prompt's keys are gathered once
    and attended by the queries of all its rows; each row's own keys are gathered and padded
    to the longest own run of the step.
    """
    B, Hq, _, D = q.shape
    Hkv = kc.shape[1]
    g = Hq // Hkv
    q4 = q.reshape(B, Hkv, g, D)
    index, valid, _ = layout.own_gather(window)
    k = kc[index].permute(0, 2, 1, 3)  # (B, Hkv, L, D)
    v = vc[index].permute(0, 2, 1, 3)
    o_own, l_own = _masked_lse_attention(q4, k, v, valid[:, None, None, :])
    pre = layout.prefix_gather(window)
    if pre is None:
        return o_own.reshape(B, Hq, 1, D)
    pindex, pvalid, rows, slots, num_slots = pre
    R, nq, P = pvalid.shape
    qp = q4.new_zeros(num_slots, Hkv, g, D).index_copy_(0, slots, q4.index_select(0, rows))
    qp = qp.view(R, nq, Hkv, g, D).permute(0, 2, 1, 3, 4).reshape(R, Hkv, nq * g, D)
    kp = kc[pindex].permute(0, 2, 1, 3)  # (R, Hkv, P, D)
    vp = vc[pindex].permute(0, 2, 1, 3)
    mask = pvalid[:, None, :, None, :].expand(R, 1, nq, g, P).reshape(R, 1, nq * g, P)
    o_p, l_p = _masked_lse_attention(qp, kp, vp, mask)
    o_p = o_p.view(R, Hkv, nq, g, D).permute(0, 2, 1, 3, 4).reshape(num_slots, Hkv, g, D)
    l_p = l_p.view(R, Hkv, nq, g).permute(0, 2, 1, 3).reshape(num_slots, Hkv, g)
    o_pre = torch.zeros_like(o_own).index_copy_(0, rows, o_p.index_select(0, slots))
    l_pre = torch.full_like(l_own, float("-inf")).index_copy_(0, rows, l_p.index_select(0, slots))
    return merge_attention(o_own, l_own, o_pre, l_pre).reshape(B, Hq, 1, D)


def prefill_mask(T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """(T, T) boolean mask (True = attend) for a prefill of T tokens from position 0 with a
    left `window`; None when plain causal attention is the same (SDPA's is_causal path,
    bit-identical to a no-cache forward)."""
    if window is None or window >= T - 1:
        return None
    i = torch.arange(T, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d <= window)


def prefill_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                 window: int | None) -> torch.Tensor:
    """Batch-invariant prefill attention (CPU): one unmasked causal SDPA call per row over
    exactly its own tokens, so its result cannot depend on the padded length or the other
    rows. q: (B, n_head, T, D); k, v: (B, n_kv_head, T, D). Padding positions get 0."""
    out = q.new_zeros(q.shape)
    gqa = q.shape[1] != k.shape[1]
    for r, n in enumerate(lengths):
        m = prefill_mask(n, window, q.device)
        out[r:r + 1, :, :n] = F.scaled_dot_product_attention(q[r:r + 1, :, :n], k[r:r + 1, :, :n], v[r:r + 1, :, :n],
                                                             attn_mask=m, is_causal=m is None, enable_gqa=gqa)
    return out
