"""Decode attention for any device in a fixed number of calls: the path GPUs run.

The prompts and the rows' own runs (engine/kernels/kv_layout.py) are gathered into padded
blocks and attended with plain tensor ops (matmul, masked log-sum-exp); the two parts of a
row are merged exactly by their log-sum-exps (engine/kernels/attention.py, `merge_attention`).
The number of calls per step does not grow with the batch. Not batch-invariant: padding
changes reduction lengths, so a row's last bits move with the rest of the step.
"""
from __future__ import annotations

import torch

from engine.kernels.attention import merge_attention
from engine.kernels.kv_layout import KVLayout


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

    Same arguments and result as `decode_grouped` (engine/kernels/attention.py). Each
    prompt's keys are gathered once and attended by the queries of all its rows; each row's
    own keys are gathered and padded to the longest own run of the step.
    """
    B, Hq, _, D = q.shape
    Hkv = kc.shape[1]
    g = Hq // Hkv
    q4 = q.reshape(B, Hkv, g, D)
    index, valid, _ = layout.own_gather(window)
    k = kc[index].permute(0, 2, 1, 3).to(q.dtype)  # (B, Hkv, L, D)
    v = vc[index].permute(0, 2, 1, 3).to(q.dtype)
    o_own, l_own = _masked_lse_attention(q4, k, v, valid[:, None, None, :])
    pre = layout.prefix_gather(window)
    if pre is None:
        return o_own.reshape(B, Hq, 1, D)
    pindex, pvalid, rows, slots, num_slots = pre
    R, nq, P = pvalid.shape
    qp = q4.new_zeros(num_slots, Hkv, g, D).index_copy_(0, slots, q4.index_select(0, rows))
    qp = qp.view(R, nq, Hkv, g, D).permute(0, 2, 1, 3, 4).reshape(R, Hkv, nq * g, D)
    kp = kc[pindex].permute(0, 2, 1, 3).to(q.dtype)  # (R, Hkv, P, D)
    vp = vc[pindex].permute(0, 2, 1, 3).to(q.dtype)
    mask = pvalid[:, None, :, None, :].expand(R, 1, nq, g, P).reshape(R, 1, nq * g, P)
    o_p, l_p = _masked_lse_attention(qp, kp, vp, mask)
    o_p = o_p.view(R, Hkv, nq, g, D).permute(0, 2, 1, 3, 4).reshape(num_slots, Hkv, g, D)
    l_p = l_p.view(R, Hkv, nq, g).permute(0, 2, 1, 3).reshape(num_slots, Hkv, g)
    o_pre = torch.zeros_like(o_own).index_copy_(0, rows, o_p.index_select(0, slots))
    l_pre = torch.full_like(l_own, float("-inf")).index_copy_(0, rows, l_p.index_select(0, slots))
    return merge_attention(o_own, l_own, o_pre, l_pre).reshape(B, Hq, 1, D)
