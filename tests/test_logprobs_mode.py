"""logprobs_mode "processed": the log-probability of each token under the distribution the
sampler actually drew it from (temperature, top_k, top_p renormalised, min_p; 0 for greedy).

Three kinds of evidence:
- exact: every processed value equals an independent float64 reference of the truncated
  distribution (Hugging Face's warper order), and a token's value is the same in every row
  that drew it;
- statistical: over 20,000 draws with different noise keys the counts follow
  exp(processed logprob) (Pearson's chi-square, p-value above 1e-4, as tests/test_sampling.py);
- batch invariance: a row's token and processed logprob are bit-identical alone and inside
  a batch of rows with other parameters; in the engine, on the real tiny-random model.
"""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.params import SamplingParams
from engine.sampling import request_key, sample_with_logprobs
from toy import ByteTokenizer, ToyLM

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.7, 1.1])
N = 20000

CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 4, 1.0, 0.0),
    (0.8, 6, 0.75, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.5, 0, 1.0, 0.15),
    (0.9, 7, 0.9, 0.1),
]


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The sampling distribution in float64, written out from its definition: softmax(logits/T),
    keep the top_k, renormalise, keep the smallest prefix reaching top_p, drop tokens below
    min_p * max, renormalise."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    k = top_k if top_k > 0 else len(p)
    keep[order[:k]] = True
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    mass_before = 0.0
    for v in order.tolist():
        if keep[v] and mass_before >= top_p:
            keep[v] = False
        mass_before += float(q[v])
    q = torch.where(keep, q, 0.0)
    q = q / q.sum()
    keep &= q >= min_p * q.max()
    q = torch.where(keep, q, 0.0)
    return q / q.sum()


def draw(temperature, top_k, top_p, min_p, n=N, logits=LOGITS):
    V = logits.shape[0]
    lg = logits.expand(n, V).contiguous()
    keys = torch.tensor([request_key(11, "p", i) for i in range(n)], dtype=torch.long)
    pos = torch.full((n,), 3, dtype=torch.long)
    f = lambda v, dt: torch.full((n,), v, dtype=dt)
    return sample_with_logprobs(lg, f(temperature, torch.float32), f(top_k, torch.long), f(top_p, torch.float32),
                                f(min_p, torch.float32), keys, pos, processed=True)


def chi2_pvalue(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CASES)
def test_processed_logprob_is_the_samplers_probability(temperature, top_k, top_p, min_p):
    toks, lps = draw(temperature, top_k, top_p, min_p)
    ref = reference(LOGITS, temperature, top_k, top_p, min_p)
    probs = torch.zeros(len(LOGITS), dtype=torch.float64)
    for v in toks.unique().tolist():
        vals = lps[toks == v]
        assert torch.equal(vals, vals[:1].expand_as(vals)), f"token {v}: processed logprob varies between draws"
        probs[v] = float(vals[0].double().exp())
        assert probs[v] == pytest.approx(float(ref[v]), abs=1e-6), (v, probs.tolist(), ref.tolist())
    # exact: the values are the distribution: nothing drawn outside its support, and the
    # support tokens never drawn are rare enough (their probability from the reference)
    drawn = set(toks.unique().tolist())
    support = set(torch.nonzero(ref).flatten().tolist())
    assert drawn <= support
    for v in support - drawn:
        assert float(ref[v]) * N < 10
        probs[v] = float(ref[v])
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
    # statistical: the draws follow it
    counts = torch.bincount(toks, minlength=len(LOGITS)).double()
    support = probs > 0
    expected = probs[support] * N
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2_pvalue(stat, df) > 1e-4, (stat, df, counts.tolist(), expected.tolist())


def test_greedy_processed_logprob_is_zero():
    toks, lps = draw(0.0, 0, 1.0, 0.0, n=16)
    assert toks.tolist() == [0] * 16 and lps.tolist() == [0.0] * 16


def test_processed_logprobs_do_not_depend_on_the_batch():
    """Rows of every sampling kind in one batch (greedy, top_k 20 and 5, top_p, min_p, plain)
    give bit-identical tokens and processed logprobs to each row alone, and to a batch of
    64 copies of the row's parameters."""
    g = torch.Generator().manual_seed(4)
    lg = torch.randn(6, 3000, generator=g) * 2.5
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 1.1])
    tk = torch.tensor([0, 20, 0, 5, 0, 0])
    tp = torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0, 1.0])
    mp = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.02, 0.0])
    keys = torch.tensor([request_key(3, "x", i) for i in range(6)], dtype=torch.long)
    pos = torch.tensor([5, 6, 7, 8, 9, 10])
    together, lp_together = sample_with_logprobs(lg, temp, tk, tp, mp, keys, pos, processed=True)
    for i in range(6):
        s = slice(i, i + 1)
        t, lp = sample_with_logprobs(lg[s], temp[s], tk[s], tp[s], mp[s], keys[s], pos[s], processed=True)
        assert torch.equal(t, together[s]) and torch.equal(lp, lp_together[s])
        rep = lambda x: x[s].expand(64, *x.shape[1:]).contiguous()
        t64, lp64 = sample_with_logprobs(rep(lg), rep(temp), rep(tk), rep(tp), rep(mp), rep(keys), rep(pos),
                                         processed=True)
        assert torch.equal(t64, together[s].expand(64)) and torch.equal(lp64, lp_together[s].expand(64))


def _reference_logprobs(model, prompt, sample, params):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sample.tokens]))[0].float()
    out = []
    for i, t in enumerate(sample.tokens):
        row = logits[len(prompt) - 1 + i]
        if params.temperature == 0:
            out.append(0.0)
        else:
            out.append(float(reference(row, params.temperature, params.top_k, params.top_p, params.min_p)[t].log()))
    return out


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=12), dict(temperature=1.2, top_p=0.7),
                                dict(temperature=1.0, min_p=0.05), dict(temperature=0.0)])
def test_engine_processed_logprobs_match_the_reference(kw):
    """Through the engine (prefill, fan-out, decode, a stop token kept at the end), each
    sampled token's processed logprob equals the reference distribution's at that position,
    computed from a cache-free full forward; raw mode keeps the raw log-softmax."""
    model = ToyLM(seed=1).eval()
    tok = ByteTokenizer()
    prompts = [[1, 2, 3, 4], [50, 60]]
    params = SamplingParams(num_samples=4, max_tokens=12, stop_token_ids=list(range(0, 30)),
                            logprobs_mode="processed", **kw)
    res = Engine(model, tok).generate(prompts, params, prompt_ids=["a", "b"])
    for prompt, row in zip(prompts, res):
        for s in row:
            want = _reference_logprobs(model, prompt, s, params)
            assert s.logprobs == pytest.approx(want, abs=2e-5)
    raw = Engine(model, tok).generate(prompts, SamplingParams(**{**{f: getattr(params, f) for f in (
        "num_samples", "max_tokens", "stop_token_ids", "temperature", "top_k", "top_p", "min_p")}}),
        prompt_ids=["a", "b"])
    assert [[s.tokens for s in r] for r in raw] == [[s.tokens for s in r] for r in res]
    s, prompt = raw[0][0], prompts[0]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + s.tokens]))[0].float(), -1)
    assert s.logprobs == pytest.approx([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(s.tokens)], abs=1e-4)


def test_engine_stop_token_processed_logprob():
    """A sample ending on a stop token: the stop token's processed logprob is the sampler's
    probability of it (top_k 3 at temperature 2 over a 265-token vocabulary)."""
    model = ToyLM(seed=7).eval()
    tok = ByteTokenizer()
    params = SamplingParams(num_samples=16, max_tokens=20, temperature=2.0, top_k=3,
                            stop_token_ids=list(range(0, 120)), logprobs_mode="processed")
    res = Engine(model, tok).generate([[9, 9, 9]], params, prompt_ids=["z"])
    ended = [s for s in res[0] if s.finish_reason == "stop"]
    assert len(ended) >= 8
    for s in ended:
        assert s.tokens[-1] < 120 and s.mask[-1] == 1 and s.stop_reason == s.tokens[-1]
        assert s.logprobs[-1] == pytest.approx(_reference_logprobs(model, [9, 9, 9], s, params)[-1], abs=2e-5)


def test_per_request_params_are_bit_identical_alone_and_mixed():
    """On tiny-random (batch-invariant projections), requests with different parameters and
    logprob modes in one engine give exactly what each gives alone."""
    from engine import load_engine

    eng = load_engine("tiny-random", device="cpu", dtype="float32", max_seq_len=128)
    prompts = [[5, 6, 7, 8], [9] * 12, [100, 3], list(range(20, 40))]
    params = [
        SamplingParams(num_samples=3, max_tokens=9, temperature=0.7, top_k=20, stop_token_ids=[]),
        SamplingParams(num_samples=2, max_tokens=6, temperature=1.2, top_p=0.8, logprobs_mode="processed",
                       stop_token_ids=[]),
        SamplingParams(num_samples=1, max_tokens=11, temperature=0.0, logprobs_mode="processed", stop_token_ids=[]),
        SamplingParams(num_samples=4, max_tokens=7, temperature=1.0, min_p=0.02, top_k=0, stop=["a", "e"],
                       stop_token_ids=[]),
    ]
    ids = ["r0", "r1", "r2", "r3"]
    mixed = eng.generate(prompts, params, prompt_ids=ids)
    for i in range(4):
        alone = eng.generate([prompts[i]], params[i], prompt_ids=[ids[i]])[0]
        assert [(s.tokens, s.logprobs, s.finish_reason, s.stop_reason) for s in alone] == \
            [(s.tokens, s.logprobs, s.finish_reason, s.stop_reason) for s in mixed[i]]
    assert all(lp == 0.0 for lp in mixed[2][0].logprobs)


def test_vocabulary_wide_kinds_in_chunks_are_bit_identical(monkeypatch):
    """Top_p rows run _CHUNK_ROWS at a time and plain rows race a cache-sized chunk of rows
    (_CHUNK elements) at a time: 100 rows in chunks of any size, and one by one, give the same
    token and processed-logprob bits."""
    import engine.sampling as S

    g = torch.Generator().manual_seed(9)
    B, V = 100, 5000
    lg = torch.randn(B, V, generator=g) * 3
    keys = torch.tensor([request_key(1, str(i), 0) for i in range(B)], dtype=torch.long)
    for top_p in (1.0, 0.8):
        a = (lg, torch.full((B,), 0.9), torch.zeros(B, dtype=torch.long), torch.full((B,), top_p), torch.zeros(B),
             keys, torch.arange(B))
        t, lp = sample_with_logprobs(*a, processed=True)
        for name, value in (("_CHUNK_ROWS", 10**9), ("_CHUNK", 1), ("_CHUNK", 7 * V), ("_CHUNK", 10**9)):
            monkeypatch.setattr(S, name, value)
            assert all(torch.equal(x, y) for x, y in zip((t, lp), sample_with_logprobs(*a, processed=True))), name
            monkeypatch.undo()
        for i in range(0, B, 7):
            one = sample_with_logprobs(*(x[i:i + 1] for x in a), processed=True)
            assert torch.equal(one[0], t[i:i + 1]) and torch.equal(one[1], lp[i:i + 1])
