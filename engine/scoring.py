"""Scoring a continuation as generation sees it: `teacher_forced_logits`."""
from __future__ import annotations

import torch

from engine.kernels.kv_layout import KVLayout
from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM


@torch.no_grad()
def teacher_forced_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """The logits at every position of `tokens` (L token ids) as the engine's step computes
    them: one prefill through the model's forward_step, its kernels and a KV cache of the
    model's dtype. (L, V) float32; row t is the next-token logits after tokens[: t + 1].

    Each row equals the logits of prefilling tokens[: t + 1] alone, bit for bit where the
    step is batch-invariant (CPU with the compiled kernels: a prefill row depends on its own
    keys only), so this scores a continuation (teacher forcing) as generation would see it.
    Raises ValueError beyond the model's context.
    """
    L = len(tokens)
    info = model.info
    if L > info.context_len:
        raise ValueError(f"{L} tokens exceed the model's context of {info.context_len}")
    p = next(model.parameters())
    kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, 1, L, model.kv_dtype, p.device, info.state_dims,
                 state_dtype=model.act_dtype)
    dev = p.device
    batch = StepBatch(slots=torch.zeros(1, dtype=torch.long, device=dev), positions=torch.arange(L, device=dev)[None],
                      last_index=torch.tensor([L - 1], device=dev), prefill=True,
                      layout=KVLayout.for_prefill([0], [L], dev), all_logits=True)
    return model.owned_logits(model.forward_step(torch.tensor([tokens], device=dev), batch, kv)[0].float())
