"""SamplingParams.top_logprobs (vLLM's logprobs=k, OpenAI's top_logprobs): each sampled
position's k most likely tokens and their logprobs, under the distribution of the row's
`logprobs` (raw: the model's log_softmax; processed: the distribution sampled from).

Checked against a cache-free forward of the model (teacher forcing: the prompt and the
sample's tokens in one call), torch's own log_softmax and topk, and the float64 reference of
the processed distribution (tests/test_logprobs_mode.py); the sampled token's logprob is its
top entry's value bit for bit; ties go to the lower id; rows with k = 0 are unchanged and
cost nothing; a row's entries do not depend on its batch; forced tool output has none.
"""
from __future__ import annotations

import pytest
import torch

import engine.sampling as sampling
from engine.engine import Engine
from engine.params import SamplingParams
from test_logprobs_mode import reference
from toy import ByteTokenizer, ScriptedLM, ToyLM

TOK = ByteTokenizer()
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20, [42]]
IDS = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def model():
    return ToyLM(window=6).eval()


def run(model, params, max_num_seqs=64, prompts=PROMPTS, ids=IDS):
    return Engine(model, TOK, max_num_seqs=max_num_seqs).generate(prompts, params, prompt_ids=ids)


def forward_logits(model, prompt, tokens):
    """The logits predicting each of `tokens` (teacher forcing, no KV cache)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens]))[0].float()
    return out[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def params(**kw):
    return SamplingParams(**{"num_samples": 2, "max_tokens": 10, "stop_token_ids": [], "top_k": 0, **kw})


def consistent(s):
    """The sampled token's logprob equals its top entry's value exactly, when listed."""
    for t, lp, ids, vals in zip(s.tokens, s.logprobs, s.top_logprob_ids, s.top_logprobs):
        if t in ids:
            assert vals[ids.index(t)] == lp


@pytest.mark.parametrize("sampling", [dict(temperature=1.3), dict(temperature=0.7, top_k=9),
                                      dict(temperature=1.0, top_p=0.8), dict(temperature=0.0)])
def test_raw_entries_are_the_models_log_softmax_topk(model, sampling):
    k = 5
    for prompt, row in zip(PROMPTS, run(model, params(top_logprobs=k, **sampling))):
        for s in row:
            lsm = torch.log_softmax(forward_logits(model, prompt, s.tokens), -1)
            want_v, want_i = torch.topk(lsm, k, dim=-1)
            assert len(s.top_logprob_ids) == len(s.tokens) == len(s.top_logprobs)
            for i in range(len(s.tokens)):
                assert s.top_logprob_ids[i] == want_i[i].tolist()
                assert s.top_logprobs[i] == pytest.approx(want_v[i].tolist(), abs=1e-4)
            consistent(s)


@pytest.mark.parametrize("case", [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 4, 1.0, 0.0), (0.8, 6, 0.75, 0.0),
                                  (1.0, 0, 0.8, 0.0), (1.5, 0, 1.0, 0.15), (0.9, 7, 0.9, 0.1)])
def test_processed_entries_follow_the_distribution_sampled_from(model, case):
    t, top_k, top_p, min_p = case
    k = 6
    res = run(model, params(top_logprobs=k, logprobs_mode="processed", temperature=t, top_k=top_k, top_p=top_p,
                            min_p=min_p))
    for prompt, row in zip(PROMPTS, res):
        for s in row:
            logits = forward_logits(model, prompt, s.tokens)
            for i in range(len(s.tokens)):
                q = reference(logits[i], t, top_k, top_p, min_p)
                n = min(k, int((q > 0).sum()))  # only tokens the sampler can draw are listed
                want_v, want_i = torch.topk(q, n)
                assert s.top_logprob_ids[i] == want_i.tolist()
                assert s.top_logprobs[i] == pytest.approx(want_v.log().tolist(), abs=1e-4)
                assert s.tokens[i] in s.top_logprob_ids[i] or n == k  # drawn tokens are listed unless k is full
            consistent(s)


def test_greedy_processed_lists_the_argmax_at_zero(model):
    for row in run(model, params(top_logprobs=3, logprobs_mode="processed", temperature=0.0)):
        for s in row:
            assert s.top_logprob_ids == [[t] for t in s.tokens] and s.top_logprobs == [[0.0]] * len(s.tokens)


def test_k_zero_rows_are_unchanged_and_null(model):
    """A row without top_logprobs gives the same bits beside rows that ask, and null lists."""
    base = dict(temperature=0.9, top_k=7)
    alone = run(model, params(**base))
    mixed = run(model, [params(**base), params(top_logprobs=4, **base), params(**base),
                        params(top_logprobs=2, logprobs_mode="processed", **base)])
    for i in (0, 2):
        for a, b in zip(alone[i], mixed[i]):
            assert (a.tokens, a.logprobs) == (b.tokens, b.logprobs)
            assert b.top_logprob_ids is None and b.top_logprobs is None
    # asking for top logprobs changes nothing else
    for a, b in zip(alone[1], mixed[1]):
        assert (a.tokens, a.logprobs) == (b.tokens, b.logprobs)


def test_k_zero_costs_no_top_k(monkeypatch):
    """sample_step with every row at k = 0 orders nothing (no _best, no top_entries work)."""
    def boom(*a, **k):
        raise AssertionError("top logprobs computed for a row that did not ask")

    monkeypatch.setattr(sampling, "_best", boom)
    g = torch.Generator().manual_seed(0)
    B, V = 6, 300
    logits = torch.randn(B, V, generator=g)
    temp = torch.tensor([1.0, 0.7, 0.0, 1.2, 0.9, 1.0])
    top_k = torch.tensor([0, 5, 0, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0])
    keys = torch.arange(2 * B).view(B, 2)
    pos = torch.arange(B)
    kinds = sampling.row_kinds(temp, top_k, top_p, min_p)
    for proc in (False, True):
        args = (temp, top_k, top_p, min_p, keys, pos, kinds, [proc] * B)
        a = sampling.sample_step(logits.clone(), *args)
        b = sampling.sample_step(logits.clone(), *args, top=[0] * B)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and b[2] == [None] * B


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_batch_invariance(model, mode):
    p = [params(top_logprobs=k, logprobs_mode=mode, **kw) for k, kw in
         [(3, dict(temperature=1.1)), (5, dict(temperature=0.8, top_k=6)), (2, dict(temperature=1.0, top_p=0.7)),
          (4, dict(temperature=0.0))]]
    ref = run(model, p, max_num_seqs=1)
    for n in (3, 64):
        got = run(model, p, max_num_seqs=n)
        for ra, rb in zip(ref, got):
            for a, b in zip(ra, rb):
                assert (a.tokens, a.logprobs, a.top_logprob_ids, a.top_logprobs) == \
                       (b.tokens, b.logprobs, b.top_logprob_ids, b.top_logprobs)


def test_ties_go_to_the_lower_id_and_forced_positions_are_null():
    """ScriptedLM puts every token but one at the same logit: the listed runners-up are the
    lowest ids (the tie runs far past the candidates the sampler orders first); the
    calculator's forced output has no entries, as it has no logprobs."""
    sp = TOK.specials
    prompt = [65]
    gen = [sp["<|python_start|>"], *TOK.encode("1+1"), sp["<|python_end|>"], 66, 67] + [70] * 40
    m = ScriptedLM(prompt + gen, TOK.vocab_size)
    for mode in ("raw", "processed"):
        s = Engine(m, TOK).generate([prompt], SamplingParams(temperature=0, max_tokens=14, top_logprobs=3,
                                                             logprobs_mode=mode))[0][0]
        assert 0 in s.mask
        for t, mk, lp, ids, vals in zip(s.tokens, s.mask, s.logprobs, s.top_logprob_ids, s.top_logprobs):
            if mk == 0:
                assert lp is None and ids is None and vals is None
            elif mode == "raw":
                assert ids == [t] + [x for x in (0, 1, 2) if x != t][:2] and vals[0] == lp
                assert vals[1] == vals[2] < vals[0]
            else:
                assert ids == [t] and vals == [0.0] == [lp]


def test_sample_step_ties_and_per_row_k():
    """Equal logits: lower id first, also at the k-th place; each row gets its own k."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 1.0, -2.0, 1.0] * 4,
                           [5.0] * 32])
    B = 2
    one = torch.ones(B)
    args = (one, torch.zeros(B, dtype=torch.long), one, torch.zeros(B), torch.zeros(B, 2, dtype=torch.long),
            torch.zeros(B, dtype=torch.long))
    kinds = sampling.row_kinds(*args[:4])
    for proc in (False, True):
        _, _, tops = sampling.sample_step(logits.clone(), *args, kinds, [proc] * B, top=[5, 2])
        assert tops[0][0] == [1, 3, 9, 11, 17]
        assert tops[1][0] == [0, 1] and tops[1][1][0] == tops[1][1][1]


def test_resume_keeps_the_entries(model):
    """An aborted sample continued (Engine.abort / continue_request) keeps its tokens' entries
    and gets the rest: the same lists as a run never cut."""
    p = params(top_logprobs=3, temperature=0.9, num_samples=1, max_tokens=12)
    whole = run(model, p, prompts=[PROMPTS[0]], ids=["a"])[0][0]
    eng = Engine(model, TOK, max_num_seqs=8)
    eng.add_request(PROMPTS[0], p, "a", request_id="r")
    for _ in range(5):
        eng.step()
    (out,) = eng.abort(["r"])
    assert 0 < len(out.samples[0].tokens) < 12 and len(out.samples[0].top_logprob_ids) == len(out.samples[0].tokens)
    eng.continue_request(out, p, request_id="r2")
    done = []
    while not done:
        done = [o for o in eng.step() if o.request_id == "r2"]
    s, n = done[0].samples[0], len(out.samples[0].tokens)
    assert s.tokens == whole.tokens and s.top_logprob_ids == whole.top_logprob_ids
    assert s.top_logprobs[:n] == out.samples[0].top_logprobs  # kept as they were
    for i in range(n, len(s.tokens)):  # recomputed after the cut (its KV from a prefill): equal to rounding
        assert s.top_logprobs[i] == pytest.approx(whole.top_logprobs[i], abs=1e-4)
    consistent(s)


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3", None])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="SamplingParams.top_logprobs: must be an integer from 0 to 20"):
        SamplingParams(top_logprobs=bad)


def test_openai_batch_lines_get_the_top_entries():
    """chat top_logprobs k (logprobs true) and completions logprobs k run with top_logprobs k,
    and the choice carries the entries in vLLM's layout."""
    import json

    from cluster.unit import UnitRequest  # noqa: F401 - the request type sample_columns reads
    from engine.params import Sample
    from jobs.inputs.openai_batch import parse_line
    from jobs.outputs.batch_responses import sample_columns

    base = SamplingParams(num_samples=1, max_tokens=None, top_k=0)
    chat = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}})
    comp = json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "hi", "logprobs": 2}})
    pc, pd = parse_line(chat.encode(), 1, base, "f"), parse_line(comp.encode(), 2, base, "f")
    assert pc.error is None and pc.params.top_logprobs == 2 and pc.logprobs
    assert pd.error is None and pd.params.top_logprobs == 2 and pd.logprobs
    s = Sample(prompt_id="c", sample_index=0, tokens=[104, 105, 106], mask=[1, 0, 1], logprobs=[-0.5, None, -1.0],
               finish_reason="length", top_logprob_ids=[[104, 97], None, [98, 106]],
               top_logprobs=[[-0.5, -2.0], None, [-0.25, -1.0]])

    class Req:
        def __init__(self, kind):
            self.passthrough = {"custom_id": "c", "batch_line": 1, "endpoint": "x", "_kind": kind, "_logprobs": True}

    c = json.loads(sample_columns(Req("chat"), s, TOK.decode(s.tokens), TOK)["choice"])["logprobs"]["content"]
    assert [[(e["token"], e["logprob"]) for e in x["top_logprobs"]] for x in c] == \
        [[("h", -0.5), ("a", -2.0)], [], [("b", -0.25), ("j", -1.0)]]
    d = json.loads(sample_columns(Req("completion"), s, TOK.decode(s.tokens), TOK)["choice"])["logprobs"]
    assert d["top_logprobs"] == [{"h": -0.5, "a": -2.0}, {"i": None}, {"j": -1.0, "b": -0.25}]


def test_openai_batch_lines_own_zero_overrides_the_jobs_top_logprobs():
    """A line's explicit 0 (chat top_logprobs 0, completions logprobs 0) is its own k, not
    "left out": in a job with sampling.top_logprobs 3 it gets no top entries; a line that
    leaves the key out gets the job's 3."""
    import json

    from jobs.inputs.openai_batch import parse_line

    base = SamplingParams(num_samples=1, max_tokens=None, top_k=0, top_logprobs=3)
    msgs = [{"role": "user", "content": "hi"}]
    cases = [("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 0}, 0),
             ("/v1/chat/completions", {"messages": msgs, "top_logprobs": 0}, 0),
             ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 5}, 5),
             ("/v1/chat/completions", {"messages": msgs, "logprobs": True}, 3),
             ("/v1/completions", {"prompt": "hi", "logprobs": 0}, 0),
             ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 2),
             ("/v1/completions", {"prompt": "hi"}, 3)]
    for i, (url, body, want) in enumerate(cases):
        line = json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})
        p = parse_line(line.encode(), i + 1, base, "f")
        assert p.error is None and p.params.top_logprobs == want, (body, p.error)
