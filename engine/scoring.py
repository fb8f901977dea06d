"""Scoring a continuation as generation sees it: `teacher_forced_logits`."""
from __future__ import annotations

import operator

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
    Raises ValueError for no tokens, a token that is not an id of the model's vocabulary
    (`info.vocab_size`: an id in a padded embedding's extra rows would be scored with an
    untrained row, a negative one failed inside the embedding), and beyond the model's context.
    """
    L = len(tokens)
    info = model.info
    if L == 0:
        raise ValueError("no tokens to score")
    ids = []
    for i, t in enumerate(tokens):
        try:
            v = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            v = None
        if v is None or not 0 <= v < info.vocab_size:
            raise ValueError(f"token {i} is {t!r}: token ids must be integers in [0, {info.vocab_size})")
        ids.append(v)
    if L > info.context_len:
        raise ValueError(f"{L} tokens exceed the model's context of {info.context_len}")
    p = next(model.parameters())
    kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, 1, L, model.kv_dtype, p.device, info.state_dims,
                 state_dtype=model.act_dtype)
    dev = p.device
    batch = StepBatch(slots=torch.zeros(1, dtype=torch.long, device=dev), positions=torch.arange(L, device=dev)[None],
                      last_index=torch.tensor([L - 1], device=dev), prefill=True,
                      layout=KVLayout.for_prefill([0], [L], dev), all_logits=True)
    return model.owned_logits(model.forward_step(torch.tensor([ids], device=dev), batch, kv)[0].float())
