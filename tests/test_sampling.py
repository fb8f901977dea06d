"""Statistical and determinism tests for engine/sampling.py on a small vocabulary.

Each test draws many tokens with different noise keys from one fixed distribution and
checks the empirical counts against the distribution the parameters define (Pearson's
chi-square, with a critical value at p = 1e-4 so a correct sampler fails about once in
10,000 runs, while a wrong one, e.g. top_p applied before top_k, fails every time).
"""
import math

import pytest
import torch

from engine.sampling import request_key, sample_tokens, token_logprobs

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 20000


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, n=N, logits=LOGITS):
    """n draws from one row of logits, each with its own key (seed, prompt_id, sample_index)."""
    V = logits.shape[0]
    lg = logits.expand(n, V).contiguous()
    keys = torch.tensor([request_key(7, "p", i) for i in range(n)], dtype=torch.long)
    pos = torch.full((n,), 11, dtype=torch.long)
    f = lambda v, dt: torch.full((n,), v, dtype=dt)
    toks = sample_tokens(lg, f(temperature, torch.float32), f(top_k, torch.long), f(top_p, torch.float32),
                         f(min_p, torch.float32), keys, pos)
    return torch.bincount(toks, minlength=V).double()


def chi2_critical(df, p=1e-4):
    """Upper critical value of chi-square (Wilson-Hilferty approximation)."""
    z = {1e-4: 3.719}[p]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def check(counts, probs):
    probs = probs / probs.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support were drawn: {counts.tolist()}"
    exp = probs[support] * counts.sum()
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} counts={counts.tolist()} expected={exp.tolist()}"


def softmax(x):
    return torch.softmax(x.double(), -1)


def test_temperature_matches_softmax():
    """Plain sampling follows softmax(logits / T) for several temperatures."""
    for t in (0.5, 1.0, 2.0):
        check(draw(temperature=t), softmax(LOGITS / t))


def test_top_k_keeps_k_most_likely_renormalised():
    p = softmax(LOGITS)
    p[3:] = 0
    check(draw(top_k=3), p)


def test_top_p_keeps_smallest_set_reaching_p():
    """softmax(LOGITS) = .38 .23 .14 .08 ...: top_p .7 keeps the first three (.38+.23 < .7)."""
    p = softmax(LOGITS)
    cum = torch.cumsum(p, 0)
    keep = (cum - p) < 0.7
    assert keep.tolist()[:4] == [True, True, True, False]
    check(draw(top_p=0.7), p * keep)


def test_top_p_after_top_k_and_temperature():
    """top_p applies to the renormalised top_k distribution at the given temperature."""
    p = softmax(LOGITS / 0.8)
    p[4:] = 0
    p = p / p.sum()
    cum = torch.cumsum(p, 0)
    keep = (cum - p) < 0.6
    check(draw(temperature=0.8, top_k=4, top_p=0.6), p * keep)


def test_min_p_drops_tokens_below_fraction_of_max():
    p = softmax(LOGITS)
    keep = p >= 0.2 * p.max()
    check(draw(min_p=0.2), p * keep)


def test_greedy_is_argmax():
    assert draw(temperature=0.0, n=50)[0] == 50


def test_same_key_same_token_whatever_the_batch():
    """A row's token depends on its own key and logits only, not on the other rows."""
    V = 1000
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(64, V, generator=g) * 3
    keys = torch.tensor([request_key(1, f"p{i}", i % 4) for i in range(64)], dtype=torch.long)
    pos = torch.arange(64)
    args = lambda sl, tk: (lg[sl], torch.ones(len(lg[sl])), torch.full((len(lg[sl]),), tk, dtype=torch.long),
                           torch.full((len(lg[sl]),), 0.9), torch.full((len(lg[sl]),), 0.01), keys[sl], pos[sl])
    for tk in (0, 40):
        full = sample_tokens(*args(slice(None), tk))
        for sl in (slice(0, 1), slice(5, 9), slice(30, 64)):
            assert torch.equal(sample_tokens(*args(sl, tk)), full[sl])


def test_mixed_params_in_one_batch_equal_separate_batches():
    """Per-request parameters in one batch give what each would get alone."""
    g = torch.Generator().manual_seed(1)
    lg = torch.randn(4, 500, generator=g) * 2
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3])
    tk = torch.tensor([0, 20, 0, 5])
    tp = torch.tensor([1.0, 1.0, 0.8, 0.9])
    mp = torch.tensor([0.0, 0.0, 0.05, 0.0])
    keys = torch.tensor([request_key(3, "x", i) for i in range(4)], dtype=torch.long)
    pos = torch.tensor([5, 6, 7, 8])
    together = sample_tokens(lg, temp, tk, tp, mp, keys, pos)
    for i in range(4):
        s = slice(i, i + 1)
        assert together[i] == sample_tokens(lg[s], temp[s], tk[s], tp[s], mp[s], keys[s], pos[s])[0]


def test_logprobs_are_raw_log_softmax():
    lg = torch.randn(3, 50)
    toks = torch.tensor([1, 7, 49])
    expect = torch.log_softmax(lg, -1)[torch.arange(3), toks]
    assert torch.allclose(token_logprobs(lg, toks), expect, atol=1e-6)


def test_inplace_logprobs_equal_and_do_not_depend_on_other_rows():
    """The engine's in-place form gives the same values as the plain one, and a row's logprob
    is bit-identical computed alone or among 64 rows of a vocabulary-sized batch."""
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(64, 50257, generator=g) * 4
    toks = torch.randint(0, 50257, (64,), generator=g)
    plain = token_logprobs(lg, toks)
    together = token_logprobs(lg.clone(), toks, inplace=True)
    assert torch.equal(plain, together)
    for i in (0, 5, 63):
        assert torch.equal(token_logprobs(lg[i:i + 1].clone(), toks[i:i + 1], inplace=True), together[i:i + 1])
    padded = torch.cat([lg, torch.zeros(64, 47)], dim=1)[:, :50257]  # a cropped padded vocabulary: a view
    for n in (1, 4, 64):
        assert torch.equal(token_logprobs(padded[:n].clone()[:, :50257], toks[:n], inplace=True), plain[:n])
        assert torch.equal(token_logprobs(padded[:n], toks[:n], inplace=True), plain[:n])


def test_request_key_is_stable():
    """Keys come from a fixed hash (not Python's per-process hash()), so every process agrees."""
    assert request_key(0, "a", 0) == request_key(0, "a", 0)
    assert request_key(0, "a", 0) != request_key(0, "a", 1)
    assert request_key(0, "a", 0) != request_key(1, "a", 0)
    assert request_key(123, "file.parquet:7", 3) == (779661763, 627667325)  # golden: changing the hash changes every dataset


def _lowbias32_int64(x):
    """lowbias32 on int64 tensors holding uint32 values, as the engine first wrote it."""
    M = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def _race_hash_int64(keys, positions, token_ids):
    """The noise's hash: lowbias32 chained over token id ^ 0x9E3779B9, position, key word 1,
    key word 0."""
    h = _lowbias32_int64(token_ids ^ 0x9E3779B9)
    for word in (positions[:, None], keys[:, 1:2], keys[:, 0:1]):
        h = _lowbias32_int64(h ^ word)
    return h


def _race_noise_int64(keys, positions, token_ids):
    """The noise's definition, as the engine first wrote it: lowbias32 on int64 tensors."""
    return torch.log(-torch.log(_uniforms(_race_hash_int64(keys, positions, token_ids))))


def _uniforms(h):
    return (h.double() + 0.5) * (1.0 / 2**32)


def test_race_noise_is_exactly_lowbias32():
    """The int32, in-place hash (and its whole-vocabulary form) gives exactly the values of the
    int64 definition, so samples do not change with the implementation."""
    from engine.sampling import race_noise, race_noise_vocab

    keys = torch.tensor([request_key(s, f"p{s}", s % 5) for s in range(16)] + [(0xFFFFFFFF, 0x80000000)],
                        dtype=torch.long)
    pos = torch.tensor([0, 1, 7, 2**20, 8191] * 3 + [5, 2**31 - 1], dtype=torch.long)
    V = 3000
    full = torch.arange(V).expand(len(keys), V)
    want = _race_noise_int64(keys, pos, full)
    assert torch.equal(race_noise_vocab(keys, pos, V), want)
    cand = torch.randint(0, V, (len(keys), 50), generator=torch.Generator().manual_seed(0))
    assert torch.equal(race_noise(keys, pos, cand), want.gather(1, cand))
    # plain sampling (no truncation) is the race over the whole vocabulary, exactly
    logits = torch.randn(len(keys), V, generator=torch.Generator().manual_seed(1)) * 4
    temp = torch.full((len(keys),), 0.7)
    off = (torch.zeros(len(keys), dtype=torch.long), torch.ones(len(keys)), torch.zeros(len(keys)))
    race = (logits / temp[:, None]).double() - want
    assert torch.equal(sample_tokens(logits, temp, *off, keys, pos), race.argmax(dim=-1))


def test_compiled_race_uniforms_are_the_definitions_on_every_build():
    """The whole-vocabulary race's hash and uniform, compiled (sampling_ops.cpp), equal the
    int64 definition bit for bit in every build this CPU runs, on 1 and 2 threads, for a
    vocabulary that is not a multiple of the vector width and for keys and positions with
    the top bit set."""
    from conftest import every_build
    from engine.kernels.native import supported_isas
    from engine.sampling import _token_hash

    if not supported_isas():
        pytest.skip("the compiled kernels are unavailable here")
    keys = torch.tensor([request_key(s, f"p{s}", s) for s in range(6)] + [(0xFFFFFFFF, 0x80000000)], dtype=torch.long)
    pos = torch.tensor([0, 1, 7, 2**20, 8191, 2**31 - 1, 5], dtype=torch.long)
    V = 3001
    want = _uniforms(_race_hash_int64(keys, pos, torch.arange(V).expand(len(keys), V)))
    for kernels in every_build():  # on a CPU without AVX-512, its AVX-512 code in software too
        for threads in (1, 2):
            out = torch.full((len(keys), V), float("nan"), dtype=torch.float64)
            kernels.race_uniforms(_token_hash(V, torch.device("cpu")), keys, pos, out, threads)
            assert torch.equal(out, want), (kernels.isa, threads)


def test_race_noise_is_stable_and_shared_ids_hash_the_same():
    """Golden values of the noise (changing the hash changes every dataset), and the (K,)
    shared-candidates form plain sampling uses equals the per-row (B, K) form."""
    from engine.sampling import race_noise

    keys = torch.tensor([request_key(123, "file.parquet:7", 3), request_key(0, "a", 1)], dtype=torch.long)
    pos = torch.tensor([17, 0])
    got = race_noise(keys, pos, torch.tensor([[0, 5, 49151], [2, 3, 100000]]))
    assert got.tolist() == [[-0.9586945307457354, -0.7938122088899546, -0.49943557426851076],
                            [1.213688908191209, 1.8066017905482934, 0.5279359020829093]]
    shared = torch.arange(300)
    assert torch.equal(race_noise(keys, pos, shared), race_noise(keys, pos, shared.expand(2, 300).contiguous()))


@pytest.mark.parametrize("V", [3001, 49152])
def test_race_over_candidates_picks_the_whole_vocabularys_token(V, monkeypatch):
    """On CPU the whole-vocabulary race takes its two logs only for the tokens that can win
    (engine/sampling.py _race_candidates, sampling_ops.cpp batchgen_race_candidates): its
    tokens and processed logprobs equal the race over every token, bit for bit, for rows
    shaped as a model's logits (a few hundred candidates of the vocabulary), nearly flat rows
    (too many candidates: they race the whole vocabulary), rows with -inf entries, exact ties
    at the top, a single finite logit, and temperatures from 0.3 to 2."""
    from engine.kernels.native import native_kernels
    from engine.sampling import _race_plain, _token_hash, race_noise

    kernels = native_kernels()
    if kernels is None:
        pytest.skip("the compiled kernels are unavailable here")
    g = torch.Generator().manual_seed(V)
    B = 40
    logits = torch.randn(B, V, generator=g) * 3 + torch.randn(B, 1, generator=g)
    logits[:8] = torch.randn(8, V, generator=g) * 1e-3  # nearly flat
    logits[8:12, ::3] = -torch.inf
    logits[12:16, 5] = logits[12:16, 9] = logits[12:16].amax(dim=-1) + 0.5  # a tie at the top
    logits[16] = -torch.inf
    logits[16, 77] = 1.0
    temperature = torch.linspace(0.3, 2.0, B)
    keys = torch.tensor([request_key(3, f"p{b}", b) for b in range(B)], dtype=torch.long)
    pos = torch.arange(B, dtype=torch.long) * 97
    import engine.sampling as S

    if V < 4096:
        monkeypatch.setattr(S, "_RACE_CAP", 1024)  # so that the flat rows overflow here too
    for processed in (False, True):
        want = _race_plain(logits, temperature, keys, pos, processed, whole_vocabulary=True)
        got = _race_plain(logits, temperature, keys, pos, processed)
        assert torch.equal(got[0], want[0])
        assert processed == (got[1] is not None) and (not processed or torch.equal(got[1], want[1]))
        for b in (0, 13, 16, 39):  # a row alone gets its bits in the batch
            one = _race_plain(logits[b:b + 1], temperature[b:b + 1], keys[b:b + 1], pos[b:b + 1], processed)
            assert torch.equal(one[0], got[0][b:b + 1])
    q = logits / temperature[:, None]
    v0 = q.argmax(dim=-1)
    s0 = q.gather(1, v0[:, None])[:, 0].double() - race_noise(keys, pos, v0[:, None])[:, 0]
    _, _, count = kernels.race_candidates(_token_hash(V, torch.device("cpu")), keys, pos, q, s0, S._RACE_CAP, 2)
    assert (count[:8] == S._RACE_CAP + 1).all()  # flat rows overflow to the whole vocabulary
    assert count[17:].float().mean() < V / 10, count[17:]  # shaped rows keep a small part


def test_a_tiny_temperature_races_as_the_whole_vocabulary_does():
    """Temperatures down to 1e-37 (logits / T near float32's largest) give the whole
    vocabulary's race, bit for bit: the argmax token and a processed logprob of 0. (The
    candidate bound cannot resolve float64 scores that large: from about 1e-14 it kept no
    token in about a third of the rows, which took token 0 with a processed logprob of -1e16.)"""
    from engine.sampling import _race_plain

    g = torch.Generator().manual_seed(5)
    B, V = 32, 49152
    logits = torch.randn(B, V, generator=g) * 3
    keys = torch.tensor([request_key(1, f"p{b}", b) for b in range(B)], dtype=torch.long)
    pos = torch.arange(B, dtype=torch.long) + 10
    for t in (1e-9, 1e-14, 1e-15, 1e-20, 1e-37):
        temperature = torch.full((B,), t)
        want = _race_plain(logits, temperature, keys, pos, True, whole_vocabulary=True)
        got = _race_plain(logits, temperature, keys, pos, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), t
        assert torch.equal(got[0], logits.argmax(dim=-1)) and (got[1] == 0).all(), t


@pytest.mark.parametrize("batched", [False, True], ids=["cpu", "gpu_path"])
def test_temperatures_below_1e_5_are_greedy_with_finite_logprobs(batched):
    """A temperature below 1e-5 is greedy, as in vLLM: the argmax token and a processed
    logprob of 0, with every kind of truncation (logits / T overflowed float32 from about
    1e-38: the first infinite token won the race, often token 0, with a NaN processed
    logprob). 1e-5 itself still samples."""
    from engine.sampling import row_kinds, sample_step

    g = torch.Generator().manual_seed(9)
    B, V = 8, 300
    logits = torch.randn(B, V, generator=g) * 3
    keys = torch.tensor([request_key(2, "t", b) for b in range(B)], dtype=torch.long)
    pos = torch.arange(B, dtype=torch.long) + 4
    for t in (1e-38, 1e-40, 1e-45, 1e-20, 9e-6):
        for tk, tp, mp in ((0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1)):
            args = (torch.full((B,), t), torch.full((B,), tk), torch.full((B,), tp), torch.full((B,), mp))
            kinds = row_kinds(*args)
            for processed in (True, False):
                toks, lps = sample_step(logits.clone(), *args, keys, pos, kinds, [processed] * B, batched=batched)
                assert torch.equal(toks, logits.argmax(dim=-1)), (t, tk, tp, mp)
                assert torch.isfinite(lps).all() and (not processed or (lps == 0).all()), (t, tk, tp, mp, lps)
            assert kinds == [("greedy",)] * B, t
    assert row_kinds(torch.full((1,), 1e-5), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.zeros(1)) \
        == [("plain",)]
