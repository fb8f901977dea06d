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
the most likely token), then the race among the surviving tokens. A temperature below
1e-5 (0 included) is argmax (GREEDY_BELOW).

Logprobs come in two kinds (SamplingParams.logprobs_mode), both in nats, fp32:
- raw (token_logprobs): log_softmax(logits)[token] at temperature 1 with no truncation;
  what a trainer recomputes from the same weights;
- processed (sample_with_logprobs): the log-probability of the token under the distribution
  the race drew it from (after temperature, top_k, top_p, min_p; 0 for greedy); what an
  importance-sampling correction between the rollout and the trainer's policy needs
  (verl's rollout_is, TRL's vllm_importance_sampling_correction).
"""
from __future__ import annotations

import hashlib
import threading

import torch

from engine.kernels.native import native_kernels

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
# The GPU path (`batched`): elements per pass of a whole-vocabulary race or sort, so that its
# scratch (16 bytes an element: the int32 hash, its scratch and the float64 noise) stays
# within 256 MiB; a pass is a fixed number of kernels, whatever its rows.
_BATCHED_CHUNK = 1 << 24


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
    being sampled; token_ids: (B, K) int64 candidate ids, or (K,) candidates shared by every
    row (their first round hashed once). Returns (B, K) float64.
    u = (lowbias32 chained over token id ^ 0x9E3779B9, position, key word 1, key word 0, plus
    0.5) / 2**32.
    """
    h = token_ids.to(torch.int32) ^ _SEED
    _mix32_(h, torch.empty_like(h))
    if h.dim() == 1:
        h = h.expand(keys.shape[0], h.shape[0]).contiguous()
    tmp = torch.empty_like(h)
    out = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    return _race_noise_from(h, tmp, out, keys, positions)


def race_noise_vocab(keys: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """race_noise for every token id 0..V-1: (B, V) float64, the same values (a fresh tensor;
    the sampler itself never holds the whole (B, V) noise: see _race_plain)."""
    out = torch.empty(keys.shape[0], V, dtype=torch.float64, device=keys.device)
    for a, b, noise, _ in _vocab_noise_chunks(keys, positions, V):
        out[a:b] = noise
    return out


def _vocab_noise_chunks(keys: torch.Tensor, positions: torch.Tensor, V: int, batched: bool = False):
    """Yield (a, b, noise, spare) for consecutive row ranges: noise is rows a..b-1 of
    race_noise_vocab's (B, V) and spare a float64 scratch of its shape, both in buffers the
    next chunk overwrites. A chunk holds about _CHUNK elements, so each of the race's ~40
    passes over it stays in cache.

    batched (the GPU path): chunks of up to _BATCHED_CHUNK elements (every row at once for
    most batches), each in fresh tensors (a GPU's caching allocator hands the same memory
    back at the next step), and spare None. The same values."""
    B, dev = keys.shape[0], keys.device
    if batched:
        step = max(1, _BATCHED_CHUNK // V)
        first = _token_hash(V, dev)
        for a in range(0, B, step):
            b = min(B, a + step)
            h = torch.empty(b - a, V, dtype=torch.int32, device=dev).copy_(first)  # never a view of `first`
            noise = _race_noise_from(h, torch.empty_like(h), torch.empty(h.shape, dtype=torch.float64, device=dev),
                                     keys[a:b], positions[a:b])
            del h  # its memory serves the next allocation (the scaled logits)
            yield a, b, noise, None
        return
    step = max(1, _CHUNK // V)  # rows per chunk
    bufs = getattr(_VOCAB_BUFFERS, "race", None)
    if bufs is None or bufs[0].shape != (step, V) or bufs[0].device != dev:
        bufs = _VOCAB_BUFFERS.race = (torch.empty(step, V, dtype=torch.int32, device=dev),
                                      torch.empty(step, V, dtype=torch.int32, device=dev),
                                      torch.empty(step, V, dtype=torch.float64, device=dev),
                                      torch.empty(step, V, dtype=torch.float64, device=dev))
    h, tmp, out, spare = bufs
    first = _token_hash(V, dev)
    # on CPU the hash rounds and the uniform are one compiled pass (sampling_ops.cpp:
    # integer arithmetic and exact steps, the same bits), the two logs stay torch's
    kernels = native_kernels() if dev.type == "cpu" else None
    if kernels is not None:
        keys, positions = keys.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    for a in range(0, B, step):
        b = min(B, a + step)
        n = b - a
        if kernels is not None:
            u = kernels.race_uniforms(first, keys[a:b], positions[a:b], out[:n], torch.get_num_threads())
            yield a, b, u.log_().neg_().log_(), spare[:n]
            continue
        h[:n].copy_(first.expand(n, V))
        yield a, b, _race_noise_from(h[:n], tmp[:n], out[:n], keys[a:b], positions[a:b]), spare[:n]


def _race_plain(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                processed: bool, batched: bool = False, whole_vocabulary: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The race over the whole vocabulary (no truncation), a cache-sized chunk of rows at a time.

    Per row: x = float64(logits / T), token = argmax(x - log E) (E from race_noise_vocab),
    and with `processed` its logprob x[token] - logsumexp(x). Each chunk's noise, x and race
    are made and consumed while they are in cache (one pass over (B, V) float64 buffers
    that do not fit was 13% of the sampler). Rows are independent: a row's bits do not
    depend on the chunk it lands in (_row_sums for the chunk of one row).

    batched (the GPU path): every row in one pass of about 70 operations (up to
    _BATCHED_CHUNK elements a pass), instead of 3 rows a pass for a 152k vocabulary; the
    float32 quotient is widened by the subtraction itself (no float64 copy of x unless
    `processed`). The same bits.

    On CPU with the compiled kernels the race runs on the tokens that can win only
    (_race_candidates: the same bits); whole_vocabulary=True races every token regardless
    (its fallback, and the tests' reference).
    """
    B, V = logits.shape
    kernels = None if batched or whole_vocabulary else _vocab_kernels(logits)
    if kernels is not None and B > 0:
        return _race_candidates(kernels, logits, temperature, keys, positions, processed)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    lps = torch.empty(B, dtype=torch.float32, device=logits.device) if processed else None
    for a, b, noise, x in _vocab_noise_chunks(keys, positions, V, batched):
        if x is None:  # batched
            q = logits[a:b] / temperature[a:b, None]  # float32 division
            torch.argmax(torch.sub(q, noise, out=noise), dim=-1, out=tokens[a:b])  # float64(q) - log E
            x = q.double() if lps is not None else None
        else:
            x.copy_(logits[a:b] / temperature[a:b, None])  # float32 division, then exact widening
            torch.argmax(torch.sub(x, noise, out=noise), dim=-1, out=tokens[a:b])  # x - log E
        if lps is not None:
            lps[a:b] = x.gather(1, tokens[a:b, None])[:, 0] - _logsumexp_rows(x)
    return tokens, lps


_RACE_CAP = 4096  # candidates per row before a row races its whole vocabulary
# |s0| from which a row races its whole vocabulary: the compiled bound tells scores 1e-6
# apart, and float64 scores round by their ulp, 2**-23 below 2**30 (logits of a few units at
# a temperature of 1e-14 and below made it miss every token, the winner included: token 0)
_RACE_MAGNITUDE = 2.0 ** 30


def _race_candidates(kernels, logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                     positions: torch.Tensor, processed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_race_plain on CPU with the compiled kernels: the same tokens and logprobs, with the
    race's two float64 logs (most of its time: 15 of a 333 ms step on the RL shape) taken for
    the tokens that can win only.

    Per row: q = logits / T (float32, as _race_plain divides), v0 = argmax q and s0 = its race
    score (race_noise: the same uniform and operations). The winner scores at least s0, so
    the compiled pass (sampling_ops.cpp, batchgen_race_candidates) lists, in token order,
    every token whose uniform can lift it to s0: typically a few hundred of a 49k vocabulary.
    Their scores are computed as _race_plain computes every token's (float64(q) - log(-log
    u)), and the first maximum wins, as torch.argmax picks it over the whole row. A row with
    more than _RACE_CAP candidates (a nearly flat distribution) or a non-finite s0 races its
    whole vocabulary instead, as does one whose scores are too large for the bound to resolve
    (|s0| >= _RACE_MAGNITUDE: a tiny temperature). Each row's arithmetic is its own, so
    batching cannot change it.
    """
    B, V = logits.shape
    threads = torch.get_num_threads()
    q = torch.div(logits, temperature[:, None], out=_scaled_buffer(B, V))  # float32; exact widening where compared
    keys, positions = keys.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    v0 = torch.argmax(q, dim=-1)
    s0 = q.gather(1, v0[:, None])[:, 0].double() - race_noise(keys, positions, v0[:, None])[:, 0]
    idx, u, count = kernels.race_candidates(_token_hash(V, logits.device), keys, positions, q, s0.contiguous(),
                                            _RACE_CAP, threads)
    full = (count > _RACE_CAP) | ~(s0.abs() < _RACE_MAGNITUDE)  # NaN and infinities too
    c = max(1, int(count.clamp(max=_RACE_CAP).max()))
    pad = torch.arange(c) >= count[:, None]
    idx, u = idx[:, :c].masked_fill(pad, 0), u[:, :c].masked_fill(pad, 0.5)
    scores = q.gather(1, idx).double() - u.log_().neg_().log_()  # x - log E, as _race_plain
    tokens = idx.gather(1, torch.argmax(scores.masked_fill_(pad, -torch.inf), dim=-1)[:, None])[:, 0]
    if bool(full.any()):
        rows = full.nonzero()[:, 0]
        tokens[rows] = _race_plain(logits[rows], temperature[rows], keys[rows], positions[rows], False,
                                   whole_vocabulary=True)[0]
    lps = None
    if processed:
        lps = torch.empty(B, dtype=torch.float32)
        step = max(1, _CHUNK // V)
        for a in range(0, B, step):
            x = q[a:a + step].double()
            lps[a:a + step] = x.gather(1, tokens[a:a + step, None])[:, 0] - _logsumexp_rows(x)
    return tokens, lps


def _scaled_buffer(B: int, V: int) -> torch.Tensor:
    """(B, V) float32 rows of this thread's reused buffer for logits / T (a fresh 25 MB tensor
    each step cost its pages' first-touch faults: 5 ms of a 220 ms RL step)."""
    buf = getattr(_VOCAB_BUFFERS, "scaled", None)
    if buf is None or buf.shape[0] < B or buf.shape[1] != V:
        buf = _VOCAB_BUFFERS.scaled = torch.empty(max(B, 64), V)
    return buf[:B]


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Choose one token per row: sample_with_logprobs without the processed logprobs.

    logits: (B, V) float32 raw model logits. temperature, top_p, min_p: (B,) float32;
    top_k: (B,) int64 (0 = off); keys: (B, 2) int64; positions: (B,) int64.
    Returns (B,) int64 token ids.
    """
    return sample_with_logprobs(logits, temperature, top_k, top_p, min_p, keys, positions)[0]


def sample_with_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         min_p: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                         processed: bool = False, kinds: list[tuple] | None = None, batched: bool | None = None,
                         top: list[int] | None = None) -> tuple:
    """Choose one token per row and, with `processed`, its log-probability under the
    distribution it was drawn from.

    top (with `processed`): per row, how many of the processed distribution's most likely
    tokens to report (0: none, and no work for that row); then a third value comes back, a
    list with per row None or (ids, logprobs) (see top_entries).

    logits: (B, V) float32 raw model logits. temperature, top_p, min_p: (B,) float32;
    top_k: (B,) int64 (0 = off); keys: (B, 2) int64; positions: (B,) int64.
    kinds: row_kinds of the same parameters when the caller has them on the host (the engine
    computes them once per batch), so that choosing the path costs no device-to-host copy;
    None derives them from the tensors.
    Returns (tokens (B,) int64, processed logprobs (B,) float32 or None). Parameters may
    differ per row (one batch, many requests).

    The processed logprob is log(p_v / sum of p over the surviving tokens), where p is the
    exact distribution the race samples from: softmax(logits / T) renormalised over top_k,
    restricted by top_p and min_p (computed in float64 from the same float32 values the
    race uses); 0 for greedy rows, whose "distribution" is the argmax.

    Rows are grouped by how they are sampled (greedy; top_k = k, per k; top_p / min_p without
    top_k; plain), and each group runs on its own, so a row's arithmetic (the candidate count
    its softmax runs over, the path it takes) depends on its own parameters only: a request
    gets the same token and logprob bits whatever other requests share its batch.

    Cost: one top-k (or, without top_k, one sort when top_p/min_p is on) over the vocabulary
    and the rest over the K candidates, except plain sampling, which races the whole
    vocabulary without sorting (on CPU, its logs taken only for the tokens that can win:
    _race_candidates).

    batched: the GPU path (None: on any device but the CPU). The CPU path works in
    cache-sized chunks of rows (3 rows of a 152k vocabulary per chunk of about 70
    operations) and reads a few device values on the host (whether any row uses top_p or
    min_p, how many candidates survive); on a GPU that was thousands of kernel launches
    and several synchronisations per step. The batched path samples each kind of row in
    one pass of a fixed number of operations (passes of up to _BATCHED_CHUNK elements),
    reads nothing back (it applies top_p and min_p rows' masks unconditionally, and races
    every candidate column, the dropped ones at -inf) and copies the rows of each kind to
    the device asynchronously. Every row's arithmetic is the CPU path's, so on CPU tensors
    it gives the same bits (tests/test_gpu_path.py).
    """
    if kinds is None:
        kinds = row_kinds(temperature, top_k, top_p, min_p)
    if batched is None:
        batched = logits.device.type != "cpu"
    groups: dict[tuple, list[int]] = {}
    for i, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(i)
    B, V = logits.shape
    dev = logits.device
    want = top is not None and processed and any(top)
    if len(groups) == 1 and B <= _rows_per_pass(kinds[0], V, batched):
        t, lp, tops = _sample_group(kinds[0], logits, temperature, top_p, min_p, keys, positions, processed, batched,
                                    top if want else None)
        return (t, lp) if top is None else (t, lp, tops if want else [None] * B)
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    lps = torch.empty(B, dtype=torch.float32, device=dev) if processed else None
    all_tops: list = [None] * B
    order = _to_device(torch.tensor([i for rows in groups.values() for i in rows]), dev) if batched else None
    start = 0
    for kind, rows in groups.items():
        step = min(len(rows), _rows_per_pass(kind, V, batched))
        for i in range(0, len(rows), step):
            if order is not None:  # already on the device: no host-to-device copy here
                r = order[start + i:start + min(i + step, len(rows))]
            else:
                r = torch.tensor(rows[i:i + step], device=dev)
            part = rows[i:i + step]
            ks = [top[j] for j in part] if want else None
            t, lp, tops = _sample_group(kind, logits[r], temperature[r], top_p[r], min_p[r], keys[r],
                                        positions[r], processed, batched, ks if ks and any(ks) else None)
            tokens[r] = t
            if lps is not None:
                lps[r] = lp
            if tops is not None:
                for j, entry in zip(part, tops):
                    all_tops[j] = entry
        start += len(rows)
    return (tokens, lps) if top is None else (tokens, lps, all_tops)


def _rows_per_pass(kind: tuple, V: int, batched: bool) -> int:
    """Most rows of `kind` sampled in one call of _sample_group. Sorted rows on the CPU run
    _CHUNK_ROWS at a time: their (rows, V) float64 buffers then stay in cache (256 rows at
    once were 3x slower per row than 64); on the GPU path, as many as fit _BATCHED_CHUNK
    elements. Plain rows chunk themselves (_vocab_noise_chunks); the others work on K
    candidates."""
    if kind[0] != "sorted":
        return 1 << 62
    return max(1, _BATCHED_CHUNK // V) if batched else _CHUNK_ROWS


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on `dev` without a host synchronisation: on CUDA through pinned memory,
    copied asynchronously (a plain .to() waits for the GPU to finish its queued work)."""
    if dev.type == "cpu":
        return host
    if dev.type == "cuda":
        host = host.pin_memory()
    return host.to(dev, non_blocking=True)


_CHUNK_ROWS = 32

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / T overflows float32
# from about 1e-38 (|logit| / T past 3.4e38), where the first infinite token won the race and
# the processed logprob was NaN; long before that, the race is an argmax but among logits
# within a few T of the best. Compared with the float32 value the engine holds, so 1e-5
# itself still samples.
GREEDY_BELOW = float(torch.tensor(1e-5, dtype=torch.float32))


def row_kinds(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> list[tuple]:
    """How each row is sampled: ("greedy",) (temperature below GREEDY_BELOW), ("top_k", k),
    ("sorted",) (top_p / min_p without top_k) or ("plain",). Arguments as sample_with_logprobs's
    (a device-to-host copy when they live on a GPU: call it on the host tensors)."""
    out = []
    for t, k, p, m in zip(temperature.tolist(), top_k.tolist(), top_p.tolist(), min_p.tolist()):
        if t < GREEDY_BELOW:
            out.append(("greedy",))
        elif k > 0:
            out.append(("top_k", int(k)))
        elif p < 1.0 or m > 0.0:
            out.append(("sorted",))
        else:
            out.append(("plain",))
    return out


def _sample_group(kind: tuple, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                  processed: bool, batched: bool = False, top: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, list | None]:
    """Rows that share `kind` (see sample_with_logprobs; `batched` reads no device value on
    the host). top: per row the number of processed top entries wanted (None: none at all);
    the third value is then per row None or (ids, logprobs), else None."""
    B, V = logits.shape
    if kind[0] == "greedy":
        tokens = torch.argmax(logits, dim=-1)
        tops = None
        if top is not None:  # the distribution is the argmax: one token, at log 1 = 0
            host = tokens.tolist()
            tops = [([host[i]], [0.0]) if k > 0 else None for i, k in enumerate(top)]
        return tokens, (torch.zeros(B, dtype=torch.float32, device=logits.device) if processed else None), tops
    t = temperature[:, None]
    if kind[0] == "plain":  # no truncation: race over the whole vocabulary
        tokens, lps = _race_plain(logits, temperature, keys, positions, processed, batched)
        return tokens, lps, (None if top is None else _plain_top(logits, temperature, top))
    if kind[0] == "top_k":
        # Dividing by a positive temperature keeps the order, so the top-k of the raw
        # logits are the candidates; only they are scaled.
        vals, idx = _topk(logits, min(kind[1], V))
    else:
        vals, idx = torch.sort(logits, dim=-1, descending=True)
    # log-probabilities renormalised over the top_k survivors (HF's and vLLM's order)
    logp = torch.log_softmax(vals / t, dim=-1)
    keep = torch.ones_like(logp, dtype=torch.bool)
    p_on = top_p < 1.0
    # (the batched path applies both masks without asking: a row with top_p 1 or min_p 0
    # keeps every candidate either way)
    if batched or bool(p_on.any()):
        p = torch.exp(logp)
        before = torch.cumsum(p, dim=-1) - p  # mass strictly before this token
        keep = keep & ((before < top_p[:, None]) | ~p_on[:, None])
    m_on = min_p > 0.0
    if batched or bool(m_on.any()):
        keep = keep & ((logp >= logp[:, :1] + torch.log(min_p.clamp_min(1e-30))[:, None]) | ~m_on[:, None])
    keep[:, 0] = True  # the most likely token always survives
    lpd = logp.double().masked_fill(~keep, float("-inf"))
    # Only survivors can win the race, and they come first (top_p and min_p keep a prefix of
    # the sorted candidates), so the noise is hashed for the columns up to the last survivor:
    # the same winner, without hashing the whole vocabulary for top_p / min_p. The batched
    # path races every column (the dropped ones at -inf - log E = -inf, never the winner)
    # rather than read the width back.
    width = keep.shape[1] if batched else int((keep * torch.arange(1, keep.shape[1] + 1, device=keep.device)).max())
    race = lpd[:, :width] - race_noise(keys, positions, idx[:, :width])
    choice = torch.argmax(race, dim=-1, keepdim=True)
    tokens = idx.gather(1, choice)[:, 0]
    if not processed:
        return tokens, None, None
    lse = _logsumexp_rows(lpd)
    tops = None
    if top is not None:
        rows = [i for i, k in enumerate(top) if k > 0]
        r = torch.tensor(rows, device=lpd.device)  # (indexing: index_select of whole rows is slow on CPU)
        lr, ir, er = (lpd, idx, lse[:, None]) if len(rows) == B else (lpd[r], idx[r], lse[r][:, None])
        K = lr.shape[1]  # every token outside the candidates is at -inf: the columns are complete
        m = min(K, max(top) + _TIE_SLACK)
        found = _best((lr[:, :m] - er).float(), ir[:, :m], max(top), m == K,
                      lambda j: ((lr[j] - er[j]).float(), ir[j]))
        tops = _scatter_tops(B, rows, [top[i] for i in rows], found)
    return tokens, (lpd.gather(1, choice)[:, 0] - lse).float(), tops


# Candidates beyond k that a top-logprobs row orders (engine/params.py top_logprobs): the k best
# by (logprob, then lower id) are exact unless the k-th value ties past them (then the row's
# whole distribution is ordered: rare, float ties of a bfloat16 model's logits included)
_TIE_SLACK = 8


def _best(values: torch.Tensor, ids: torch.Tensor, k: int, complete: bool, full) -> list[tuple[list[int], list[float]]]:
    """The k best (value descending, then id ascending) of each row's candidates, finite
    values only, as host lists [(ids, values)] per row.

    values (n, m) float32 and ids (n, m) int64: each row's m candidates, the m largest values
    of its distribution (any order among equal ones). complete: no other token has a finite
    value. full(j): row j's whole distribution as (values (V,), ids (V,)), for a row whose
    k-th value ties with its m-th (a tie that may go on past the candidates). Each row is
    ordered on its own (two stable sorts), so its result does not depend on the others."""
    n, m = values.shape
    k = min(k, m) if complete else k
    i, p = torch.sort(ids, dim=1, stable=True)
    v, p = torch.sort(values.gather(1, p), dim=1, descending=True, stable=True)
    i = i.gather(1, p)
    fix: list[int] = []
    if not complete and m > k:
        fix = ((v[:, m - 1] == v[:, k - 1]) & torch.isfinite(v[:, k - 1])).nonzero()[:, 0].tolist()
    vh, ih = v[:, :k].tolist(), i[:, :k].tolist()
    for j in fix:
        fv, fi = full(j)
        fi, p = torch.sort(fi, stable=True)
        fv, p = torch.sort(fv.gather(0, p), descending=True, stable=True)
        vh[j], ih[j] = fv[:k].tolist(), fi.gather(0, p)[:k].tolist()
    out = []
    for vs, js in zip(vh, ih):
        keep = [x == x and x != float("-inf") for x in vs]  # non-survivors (processed) are left out
        out.append(([t for t, ok in zip(js, keep) if ok], [x for x, ok in zip(vs, keep) if ok]))
    return out


def _scatter_tops(B: int, rows: list[int], ks: list[int], found: list) -> list:
    """Per row of B: None, or row rows[j]'s entries cut to its own k ks[j]."""
    out: list = [None] * B
    for r, k, (ids, vals) in zip(rows, ks, found):
        out[r] = (ids[:k], vals[:k])
    return out


def _plain_top(logits: torch.Tensor, temperature: torch.Tensor, top: list[int]) -> list:
    """Processed top entries of plain rows (no truncation): x = float64(logits / T), entries
    x[v] - logsumexp(x) rounded to float32, as _race_plain's (and _race_candidates') logprob
    of the sampled token, from the same float32 quotient."""
    B, V = logits.shape
    rows = [i for i, k in enumerate(top) if k > 0]
    r = torch.tensor(rows, device=logits.device)
    lr, tr = (logits, temperature) if len(rows) == B else (logits[r], temperature[r])
    q = lr / tr[:, None]  # float32 division, as the race
    lse = _logsumexp_rows(q.double())[:, None]
    m = min(V, max(top) + _TIE_SLACK)
    cv, ci = _topk(q, m)
    found = _best((cv.double() - lse).float(), ci, max(top), m == V,
                  lambda j: ((q[j].double() - lse[j]).float(), torch.arange(V, device=q.device)))
    return _scatter_tops(B, rows, [top[i] for i in rows], found)


def top_entries(logits: torch.Tensor, top: list[int]) -> list:
    """Raw top entries (logprobs_mode "raw") for the rows with top[i] > 0: the top[i] most
    likely tokens of log_softmax(logits[i]) (lower id first among equal logprobs) and their
    logprobs, computed as token_logprobs computes a sampled token's, so a sampled token among
    them has the same value. Returns per row None or (ids, logprobs). Does not modify `logits`.
    Rows with top[i] = 0 cost nothing."""
    B, V = logits.shape
    rows = [i for i, k in enumerate(top) if k > 0]
    out: list = [None] * B
    if not rows:
        return out
    # the rows that ask (advanced indexing: index_select of whole rows took 1 s for 128 x 49,152 on CPU)
    lr = logits if len(rows) == B else logits[torch.tensor(rows, device=logits.device)]
    m = min(V, max(top) + _TIE_SLACK)
    arange = torch.arange(V, device=logits.device)
    kernels = _vocab_kernels(lr)
    if kernels is not None:  # token_logprobs: logits[token] - the compiled logsumexp (per row)
        lse = kernels.logsumexp(lr, torch.get_num_threads())[:, None]
        cv, ci = _topk(lr, m)
        found = _best(cv - lse, ci, max(top), m == V, lambda j: (lr[j] - lse[j], arange))
    else:  # token_logprobs: log_softmax(logits)[token]
        ls = torch.log_softmax(lr, dim=-1)
        cv, ci = torch.topk(ls, m, dim=-1)
        found = _best(cv, ci, max(top), m == V, lambda j: (ls[j], arange))
    return _scatter_tops(B, rows, [top[i] for i in rows], found)


_NATIVE_TOPK_MAX = 1024  # beyond this k, torch.topk (the compiled one sorts k candidates per row)


def _vocab_kernels(x: torch.Tensor):
    """The compiled kernels (engine/kernels/native.py) for x (B, V) float32 on CPU with contiguous
    rows, else None (then torch's operations)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    return native_kernels()


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, k, dim=-1) for (B, V) logits: (values, ids), largest first. On CPU
    the compiled kernel (engine/kernels/csrc/sampling_ops.cpp: one read of each row from memory;
    1.7-1.9 ms against torch.topk's 5.7 ms for 128 x 49,152 and k = 50, 2 threads), which
    also fixes the order of equal values (smaller id first); a row's candidates are the same
    set either way, and the race does not depend on their order."""
    kernels = _vocab_kernels(logits)
    if kernels is not None and k <= _NATIVE_TOPK_MAX:
        return kernels.topk(logits, k, torch.get_num_threads())
    return torch.topk(logits, k, dim=-1)


def _logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of (B, K) (-inf entries allowed, the row max finite),
    summed in the same order whatever B is (see _row_sums)."""
    m = x.amax(dim=-1, keepdim=True)
    return _row_sums(torch.exp(x - m)).log() + m[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """log_softmax(logits)[token] per row: logits (B, V) float32, tokens (B,) -> (B,) float32.

    On CPU (float32) it is logits[token] - logsumexp(row), the logsumexp compiled
    (engine/kernels/csrc/sampling_ops.cpp: 1.9 ms against log_softmax's 4.6 ms for 128 x 49,152 on
    2 threads, and nothing written). Without the compiled kernel (another device or dtype, or
    no library), inplace=True overwrites CPU `logits` with their log-softmax when they are
    contiguous (the engine's last use of them): torch's fused kernel reads each row twice and
    writes it once, without a second vocabulary-sized tensor.
    Either way a row's result does not depend on the other rows (a row is reduced by one
    thread).
    """
    kernels = _vocab_kernels(logits)
    if kernels is not None:
        return logits.gather(1, tokens[:, None])[:, 0] - kernels.logsumexp(logits, torch.get_num_threads())
    if inplace and logits.device.type == "cpu" and logits.is_contiguous():
        out = torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)
    else:
        out = torch.log_softmax(logits, dim=-1)
    return out.gather(1, tokens[:, None])[:, 0]


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """x.sum(dim=-1) for x (B, V), added up in the same order whatever B is.

    On CPU, torch sums a lone row (an output of one element) by splitting it across threads
    (its two-pass reduction), while the rows of a larger batch are each summed by one
    thread; the two orders differ in the last bits, so a batch of one is summed as two
    copies of its row.
    """
    if x.shape[0] == 1 and x.device.type == "cpu":
        return x.repeat(2, 1).sum(dim=-1)[:1]
    return x.sum(dim=-1)


def sample_step(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, kinds: list[tuple],
                processed: list[bool], batched: bool | None = None, top: list[int] | None = None) -> tuple:
    """One engine step's sampling: tokens ((B,) int64) and each row's logprob ((B,) float32) in
    its request's logprobs_mode: processed (under the distribution sampled from) where `processed[i]`, raw
    (log_softmax of the logits) elsewhere. Overwrites `logits`. batched: the GPU path (see
    sample_with_logprobs; None: on any device but the CPU).

    top: per row its top_logprobs k (0: none); given, a third value comes back: per row None
    or (ids, logprobs), the k most likely tokens under the same distribution as the row's
    logprob (top_entries for raw rows, sample_with_logprobs' for processed ones). Rows with
    k = 0 cost nothing more, and their tokens and logprobs are the same bits."""
    if batched is None:
        batched = logits.device.type != "cpu"
    any_p = any(processed)
    want = top is not None and any(top)
    ptop = [k if p else 0 for k, p in zip(top, processed)] if want else None
    res = sample_with_logprobs(logits, temperature, top_k, top_p, min_p, keys, positions,
                               processed=any_p, kinds=kinds, batched=batched, top=ptop)
    toks, proc = res[0], res[1]
    tops = res[2] if ptop is not None else None
    if want:
        raw_top = [0 if p else k for k, p in zip(top, processed)]
        if any(raw_top):  # before token_logprobs, which may overwrite the logits
            for i, entry in enumerate(top_entries(logits, raw_top)):
                if entry is not None:
                    tops[i] = entry
    extra = () if top is None else (tops if tops is not None else [None] * len(processed),)
    if any_p and all(processed):
        return (toks, proc, *extra)
    raw = token_logprobs(logits, toks, inplace=True)  # last: it overwrites the logits
    if not any_p:
        return (toks, raw, *extra)
    mask = torch.tensor(processed)
    mask = _to_device(mask, logits.device) if batched else mask.to(logits.device)
    return (toks, torch.where(mask, proc, raw), *extra)
