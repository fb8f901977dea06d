"""Turning logits into tokens, reproducibly, and the logprobs a trainer can trust.

Reproducibility: a sample's tokens must be a pure function of (weights, prompt, params,
seed, prompt_id, sample_index), whatever batch, slot, neighbour or process computes them.
A shared torch.Generator cannot give that (its stream depends on everything drawn before),
so the noise here is counter-based: every (sample, position, token) gets its own uniform
from a hash of (seed, prompt_id, sample_index, position, token id), and the token is chosen
by an exponential race, argmax_v p_v / E_v with E_v = -log(u_v) (equivalently Gumbel-max,
argmax_v log p_v + G_v). The winner is distributed exactly as p (the minimum of independent
exponentials with rates p_v lands on v with probability p_v / sum p), and since each row's
noise depends only on its own key, batching cannot change it. See "Gumbel-max trick"
(Gumbel 1954; Maddison et al. 2014, "A* Sampling") and counter-based RNGs (Salmon et al.
2011, "Parallel random numbers: as easy as 1, 2, 3"). The hash is 32-bit "lowbias32"
(C. Wellons, "Prospecting for hash functions", 2018), chained over the key words.

Order of operations (the same as Hugging Face's warpers and vLLM): logits / temperature,
then top_k, then top_p on the renormalised top_k distribution, then min_p (relative to
the most likely token), then the race among the surviving tokens. temperature 0 is argmax.

Logprobs are always those of the raw model: log_softmax(logits)[token] at temperature 1
with no truncation, in nats, fp32; they are what a trainer recomputes from the same weights.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def request_key(seed: int, prompt_id: str, sample_index: int) -> tuple[int, int]:
    """Two 32-bit words keying one sample's noise (stable across processes and machines)."""
    h = hashlib.blake2b(f"{seed}\x1f{prompt_id}\x1f{sample_index}".encode("utf-8", "surrogatepass"), digest_size=8)
    v = int.from_bytes(h.digest(), "little")
    return v & _M32, v >> 32


# The hash runs on int32 tensors holding the uint32 bit patterns: multiplication wraps modulo
# 2**32 as uint32's does, right shifts are made logical by masking, and every step is in place
# (over the whole vocabulary, in buffers reused from step to step: a fresh 50 MB tensor costs
# its page faults every time), so a (batch, vocabulary) race touches half the memory of int64
# arithmetic: 128 x 49,152 in 0.1 s instead of 1.85 s on one core. The values are exactly
# lowbias32's (tests/test_sampling.py).
_SEED = 0x9E3779B9 - 2**32
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B - 2**32
_TOKEN_HASH: dict[tuple[int, torch.device], torch.Tensor] = {}
_VOCAB_BUFFERS = threading.local()  # per thread: two engines stepping in two threads do not share
_CHUNK = 1 << 19  # elements per chunk of the whole-vocabulary race (2 MiB of int32: it stays in cache)


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on int32 `x` (uint32 bit patterns); tmp: scratch of x's shape."""
    x ^= torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
    x.mul_(_MUL1)
    x ^= torch.bitwise_right_shift(x, 15, out=tmp).bitwise_and_(0x1FFFF)
    x.mul_(_MUL2)
    x ^= torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
    return x


def _token_hash(V: int, device: torch.device) -> torch.Tensor:
    """(V,) int32: the first hash round of every token id (it depends on nothing else)."""
    key = (V, device)
    if key not in _TOKEN_HASH:
        h = torch.arange(V, dtype=torch.int32, device=device) ^ _SEED
        _TOKEN_HASH[key] = _mix32_(h, torch.empty_like(h))
    return _TOKEN_HASH[key]


def _race_noise_from(h: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor, keys: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """The remaining rounds on `h` ((B, K) int32, first round done; h and tmp are overwritten)
    -> log E into `out` ((B, K) float64)."""
    for word in (positions, keys[:, 1], keys[:, 0]):
        h ^= word.to(torch.int32)[:, None]
        _mix32_(h, tmp)
    out.copy_(h.view(torch.uint32))  # the uint32 value, exactly
    return out.add_(0.5).mul_(1.0 / 2**32).log_().neg_().log_()


def race_noise(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log E for each candidate: E = -log(u), u uniform in (0, 1) hashed from the counters.

    keys: (B, 2) int64 (request_key words); positions: (B,) int64, the position of the token
    being sampled; token_ids: (B, K) int64 candidate ids. Returns (B, K) float64.
    u = (lowbias32 chained over token id ^ 0x9E3779B9, position, key word 1, key word 0, plus
    0.5) / 2**32.
    """
    h = token_ids.to(torch.int32) ^ _SEED
    tmp = torch.empty_like(h)
    out = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    return _race_noise_from(_mix32_(h, tmp), tmp, out, keys, positions)


def race_noise_vocab(keys: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """race_noise for every token id 0..V-1: (B, V) float64, the same values, in a buffer that
    the next call overwrites."""
    B, dev = keys.shape[0], keys.device
    bufs = getattr(_VOCAB_BUFFERS, "race", None)
    if bufs is None or bufs[0].shape != (B, V) or bufs[0].device != dev:
        bufs = _VOCAB_BUFFERS.race = (torch.empty(B, V, dtype=torch.int32, device=dev),
                                      torch.empty(B, V, dtype=torch.int32, device=dev),
                                      torch.empty(B, V, dtype=torch.float64, device=dev))
    h, tmp, out = bufs
    first = _token_hash(V, dev)
    step = max(1, _CHUNK // V)  # rows per chunk: every pass over a chunk stays in cache
    for a in range(0, B, step):
        b = min(B, a + step)
        h[a:b].copy_(first.expand(b - a, V))
        _race_noise_from(h[a:b], tmp[a:b], out[a:b], keys[a:b], positions[a:b])
    return out


@dataclass(slots=True, frozen=True)
class SamplingFlags:
    """Which sampling path a batch takes, decided on the host from the rows' parameters (so
    choosing it costs no device-to-host transfer). Build with `sampling_flags`.

    all_greedy: every row has temperature 0. all_top_k: every row is greedy or has top_k > 0.
    any_truncation: some row uses top_k, top_p, min_p or is greedy. any_top_p, any_min_p: some
    row uses that filter. max_top_k: the largest top_k of the batch (greedy rows count 1).
    """

    all_greedy: bool
    all_top_k: bool
    any_truncation: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int


def sampling_flags(params) -> SamplingFlags:
    """SamplingFlags of a batch from each row's engine.params.SamplingParams (or any objects
    with temperature, top_k, top_p and min_p)."""
    greedy = [p.temperature <= 0 for p in params]
    k = [1 if gr else (p.top_k or 0) for gr, p in zip(greedy, params)]
    top_p = [p.top_p < 1.0 for p in params]
    min_p = [p.min_p > 0.0 for p in params]
    return SamplingFlags(all_greedy=all(greedy), all_top_k=all(x > 0 for x in k),
                         any_truncation=any(x > 0 for x in k) or any(top_p) or any(min_p),
                         any_top_p=any(top_p), any_min_p=any(min_p), max_top_k=max(k, default=0))


def _flags_from_tensors(temperature, top_k, top_p, min_p) -> SamplingFlags:
    greedy = temperature <= 0
    k = torch.where(greedy, torch.ones_like(top_k), top_k)
    return SamplingFlags(all_greedy=bool(greedy.all()), all_top_k=bool((k > 0).all()),
                         any_truncation=bool(((k > 0) | (top_p < 1.0) | (min_p > 0.0)).any()),
                         any_top_p=bool((top_p < 1.0).any()), any_min_p=bool((min_p > 0.0).any()),
                         max_top_k=int(k.max()) if k.numel() else 0)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                  flags: SamplingFlags | None = None) -> torch.Tensor:
    """Choose one token per row.

    logits: (B, V) float32 raw model logits. temperature, top_p, min_p: (B,) float32;
    top_k: (B,) int64 (0 = off); keys: (B, 2) int64; positions: (B,) int64.
    flags: the batch's SamplingFlags when the caller knows them (the engine decides them on
    the host); None derives them from the tensors (a device-to-host sync on a GPU).
    Returns (B,) int64 token ids. Parameters may differ per row (one batch, many requests).

    Cost: one top-k (or, without top_k, one sort when top_p/min_p is on) over the vocabulary
    and the rest over the K candidates, except plain sampling, which races the whole
    vocabulary without sorting.
    """
    B, V = logits.shape
    if flags is None:
        flags = _flags_from_tensors(temperature, top_k, top_p, min_p)
    if flags.all_greedy:
        return torch.argmax(logits, dim=-1)
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    k_on = (top_k > 0) | greedy
    top_k = torch.where(greedy, torch.ones_like(top_k), top_k)  # greedy = top-1
    if flags.all_top_k:
        # Dividing by a positive temperature keeps the order, so the top-k of the raw
        # logits are the candidates; only they are scaled.
        vals, idx = torch.topk(logits, min(flags.max_top_k, V), dim=-1)
    elif flags.any_truncation:
        vals, idx = torch.sort(logits, dim=-1, descending=True)
    else:  # no truncation anywhere: race over the whole vocabulary
        score = race_noise_vocab(keys, positions, V).neg_().add_((logits / t).double())  # = scaled - noise
        return torch.argmax(score, dim=-1)
    K = vals.shape[1]
    vals = vals / t
    rank = torch.arange(K, device=logits.device)[None, :]
    keep = (rank < top_k[:, None]) | ~k_on[:, None]
    # log-probabilities renormalised over the top_k survivors (HF's and vLLM's order)
    logp = torch.log_softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    if flags.any_top_p:
        p_on = top_p < 1.0
        p = torch.exp(logp)
        before = torch.cumsum(p, dim=-1) - p  # mass strictly before this token
        keep = keep & ((before < top_p[:, None]) | ~p_on[:, None])
    if flags.any_min_p:
        m_on = min_p > 0.0
        keep = keep & ((logp >= logp[:, :1] + torch.log(min_p.clamp_min(1e-30))[:, None]) | ~m_on[:, None])
    keep[:, 0] = True  # the most likely token always survives
    score = logp.double() - race_noise(keys, positions, idx)
    score = score.masked_fill(~keep, float("-inf"))
    return idx.gather(1, torch.argmax(score, dim=-1, keepdim=True))[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """log_softmax(logits)[token] per row: logits (B, V) float32, tokens (B,) -> (B,) float32.

    inplace=True overwrites `logits` with their log-softmax on CPU when they are contiguous
    (the engine's last use of them): torch's fused kernel reads each row twice and writes it
    once (3x faster than max, subtract, exp, sum), without a second vocabulary-sized tensor. Each row's result
    does not depend on the other rows (its CPU kernel reduces a row on one thread).
    """
    if inplace and logits.device.type == "cpu" and logits.is_contiguous():
        out = torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)
    else:
        out = torch.log_softmax(logits, dim=-1)
    return out.gather(1, tokens[:, None])[:, 0]
