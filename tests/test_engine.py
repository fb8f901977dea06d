"""Engine behaviour on small stand-in models (tests/toy.py): KV cache, fan-out, batching,
reproducibility, finish reasons, errors and the calculator state machine.

The same properties are checked on the real architectures in tests/test_engine_models.py.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.params import SamplingParams
from toy import ByteTokenizer, ScriptedLM, ToyLM

TOK = ByteTokenizer()
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20, [42], list(range(30, 45))]
IDS = ["a", "b", "c", "d", "e"]


@pytest.fixture(scope="module")
def model():
    return ToyLM(window=6).eval()


def run(model, prompts=PROMPTS, ids=IDS, max_num_seqs=64, **kw):
    params = SamplingParams(**{"num_samples": 3, "max_tokens": 12, "top_k": 0, "stop_token_ids": [], **kw})
    return Engine(model, TOK, max_num_seqs=max_num_seqs).generate(prompts, params, prompt_ids=ids)


def toks(results):
    return [[s.tokens for s in row] for row in results]


def test_greedy_decode_equals_full_forward_every_step(model):
    """KV-cached decode (with a sliding window that bites) gives the full forward's argmax at every step."""
    res = run(model, temperature=0.0, num_samples=1, max_tokens=25)
    for prompt, row in zip(PROMPTS, res):
        seq = list(prompt)
        for _ in range(25):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert row[0].tokens == seq[len(prompt):]


def test_logprobs_equal_full_forward_log_softmax(model):
    """Each sampled token's logprob is log_softmax of the raw logits of a cache-free forward."""
    res = run(model, temperature=1.3, top_k=5, num_samples=2)
    for prompt, row in zip(PROMPTS, res):
        for s in row:
            full = torch.tensor([prompt + s.tokens])
            lp = torch.log_softmax(model(full)[0], -1)
            for i, (t, got) in enumerate(zip(s.tokens, s.logprobs)):
                assert abs(lp[len(prompt) - 1 + i, t].item() - got) < 1e-4


@pytest.mark.parametrize("max_num_seqs", [1, 4, 32])
def test_batch_size_independence(model, max_num_seqs):
    """The same requests give identical tokens at max batch sizes 1, 4 and 32."""
    ref = toks(run(model, max_num_seqs=64))
    assert toks(run(model, max_num_seqs=max_num_seqs)) == ref


def test_neighbours_do_not_matter(model):
    """A request gives the same samples alone, with other neighbours, or in another order."""
    ref = toks(run(model))
    alone = toks(run(model, prompts=[PROMPTS[2]], ids=[IDS[2]]))
    assert alone[0] == ref[2]
    others = toks(run(model, prompts=[[99] * 7, PROMPTS[2], [5, 6]], ids=["x", IDS[2], "y"]))
    assert others[1] == ref[2]
    rev = toks(run(model, prompts=PROMPTS[::-1], ids=IDS[::-1]))
    assert rev[::-1] == ref


def test_fanned_out_samples_equal_samples_run_alone(model):
    """num_samples=4 from one prefill equals four prefills of one sample each (max_num_seqs=1)."""
    fan = run(model, num_samples=4)
    alone = run(model, num_samples=4, max_num_seqs=1)
    assert toks(fan) == toks(alone)
    assert all(len({tuple(s.tokens) for s in row}) > 1 for row in fan)  # samples differ from each other


def test_seed_changes_samples(model):
    assert toks(run(model, seed=1)) != toks(run(model, seed=2))


def test_continuous_batching_admits_while_others_decode(model):
    """With 4 slots and prompts of 2 samples each, a finished request's slots are reused at once."""
    eng = Engine(model, TOK, max_num_seqs=4)
    p_short = SamplingParams(num_samples=2, max_tokens=3, top_k=0, stop_token_ids=[])
    p_long = SamplingParams(num_samples=2, max_tokens=10, top_k=0, stop_token_ids=[])
    eng.add_request([1, 2], p_long, "long")
    eng.add_request([3, 4], p_short, "short")
    eng.add_request([5, 6], p_short, "waiting")
    finished_at = {}
    step = 0
    while eng.has_unfinished_requests():
        step += 1
        for out in eng.step():
            finished_at[out.prompt_id] = step
        if step == 1:
            assert len(eng.running) == 4 and len(eng.scheduler.waiting) == 1
    # "waiting" was admitted after "short" freed its slots, and finished before "long".
    assert finished_at["short"] < finished_at["waiting"] < finished_at["long"]


def test_stop_tokens_and_lengths():
    """A stop token ends a sample with "stop" and is kept as its last token (mask 1, a
    logprob, stop_reason its id); max_tokens counts it and otherwise gives "length"."""
    end = TOK.specials["<|assistant_end|>"]
    script = [1, 2, 3, 50, 51, end, 60, 61]
    m = ScriptedLM(script, TOK.vocab_size)
    eng = Engine(m, TOK)
    s = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10))[0][0]
    assert (s.tokens, s.mask, s.finish_reason, s.stop_reason) == ([50, 51, end], [1, 1, 1], "stop", end)
    assert all(lp is not None for lp in s.logprobs) and len(s.logprobs) == 3
    s = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[51]))[0][0]
    assert (s.tokens, s.finish_reason, s.stop_reason) == ([50, 51], "stop", 51)
    s = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0][0]
    assert (s.tokens, s.finish_reason, s.stop_reason) == ([50, 51, end], "stop", end)  # the stop token wins at the limit
    s = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0][0]
    assert (s.tokens, s.finish_reason, s.stop_reason) == ([50, 51], "length", None)


def test_context_window_ends_with_length_and_long_prompt_is_an_error(model):
    """Generation stops at the context window; a prompt longer than it fails alone."""
    eng = Engine(model, TOK)
    ctx = model.info.context_len
    res = eng.generate([[1] * (ctx - 5), [2] * (ctx + 1), [], [3, 999], [4, 5]],
                       SamplingParams(num_samples=2, max_tokens=50, stop_token_ids=[]))
    assert [len(s.tokens) for s in res[0]] == [5, 5] and res[0][0].finish_reason == "length"
    assert [s.finish_reason for s in res[1]] == ["error", "error"]
    assert "context window" in res[1][0].error
    assert "empty" in res[2][0].error
    assert "prompt token 1 is 999" in res[3][0].error
    assert [len(s.tokens) for s in res[4]] == [50, 50]


def test_top_k_beyond_the_vocabulary_keeps_it_all_and_past_int64_is_refused(model):
    """A top_k above the vocabulary keeps every token (the same samples as top_k = V), up to
    2**63 - 1; 2**63 is refused by SamplingParams naming the field (it passed, then failed
    the whole step converting to an int64 tensor and left the engine unusable)."""
    V = model.info.vocab_size
    kw = dict(num_samples=2, max_tokens=6, stop_token_ids=[], logprobs_mode="processed")
    want = Engine(model, TOK).generate(PROMPTS[:2], SamplingParams(top_k=V, **kw))
    for k in (V + 1, 2**63 - 1):
        got = Engine(model, TOK).generate(PROMPTS[:2], SamplingParams(top_k=k, **kw))
        assert toks(got) == toks(want) and [[s.logprobs for s in r] for r in got] == \
            [[s.logprobs for s in r] for r in want]
    with pytest.raises(ValueError, match=r"SamplingParams.top_k: must be an integer >= 0 .* below 2\*\*63"):
        SamplingParams(top_k=2**63)


def test_max_seq_len_must_be_a_positive_integer(model):
    """Engine(max_seq_len=...) refuses 0, negatives and floats naming the argument (0 meant
    the whole context window, -5 made every prompt an error row "more than the context
    window of -5 tokens", 2.5 failed inside torch); a limit above the context is clipped."""
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_seq_len must be an integer >= 1"):
            Engine(model, TOK, max_seq_len=bad)
    assert Engine(model, TOK, max_seq_len=10**9).max_seq_len == model.info.context_len
    assert Engine(model, TOK, max_seq_len=None).max_seq_len == model.info.context_len


def test_params_that_are_not_sampling_params_are_a_type_error(model):
    """A dict (or None) for params is a TypeError naming params, raised before any request
    is queued (a dict failed inside add_request with "'str' object has no attribute
    'stop_token_ids'"), and the engine still serves the next call."""
    eng = Engine(model, TOK)
    for bad in ({"temperature": 0}, [{"temperature": 0}], None, [SamplingParams(), {"temperature": 0}]):
        with pytest.raises(TypeError, match="params must be a SamplingParams"):
            eng.generate([[1, 2], [3]][:len(bad) if isinstance(bad, list) else 1], bad)
        assert not eng.has_unfinished_requests()
    with pytest.raises(TypeError, match="add_request: params must be"):
        eng.add_request([1, 2], {"temperature": 0}, "x")
    assert len(eng.generate([[1, 2]], SamplingParams(max_tokens=3, stop_token_ids=[]))[0][0].tokens) == 3


def test_num_samples_larger_than_the_cache():
    """A request with more samples than slots runs in groups and equals a big-cache run."""
    m = ToyLM(seed=3).eval()
    p = SamplingParams(num_samples=10, max_tokens=6, top_k=0, stop_token_ids=[])
    small = Engine(m, TOK, max_num_seqs=3).generate([[1, 2, 3], [4]], p, prompt_ids=["x", "y"])
    big = Engine(m, TOK, max_num_seqs=64).generate([[1, 2, 3], [4]], p, prompt_ids=["x", "y"])
    assert toks(small) == toks(big)
    assert [s.sample_index for s in small[0]] == list(range(10))


def _gsm8k_calls(limit):
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not path.exists():
        pytest.skip("../shared/data/gsm8k/train.jsonl is not beside this checkout")
    import re

    calls = []
    for line in path.open():
        for expr, result in re.findall(r"<<([^=<>]*)=([^<>]*)>>", json.loads(line)["answer"]):
            calls.append((expr, result))
            if len(calls) >= limit:
                return calls
    return calls


def test_calculator_state_machine_on_gsm8k_calls():
    """A scripted model writes real GSM8K calculator calls; the engine evaluates each, forces
    <|output_start|> result <|output_end|> with mask 0 and no logprob, and records the call."""
    sp = TOK.specials
    calls = _gsm8k_calls(40)
    for expr, annotated in calls:
        prompt = TOK.encode("Q: ")
        out_toks = [sp["<|output_start|>"], *TOK.encode(annotated), sp["<|output_end|>"]]
        gen = [*TOK.encode("so "), sp["<|python_start|>"], *TOK.encode(expr), sp["<|python_end|>"],
               *out_toks, *TOK.encode(" done"), sp["<|assistant_end|>"]]
        m = ScriptedLM(prompt + gen, TOK.vocab_size)
        s = Engine(m, TOK).generate([prompt], SamplingParams(temperature=0, max_tokens=200))[0][0]
        assert s.finish_reason == "stop"
        (call,) = s.tool_calls
        assert call.expr == expr and call.error is None
        assert float(call.output) == pytest.approx(float(annotated), rel=1e-6)
        start = s.tokens.index(sp["<|python_start|>"])
        o0 = s.tokens.index(sp["<|output_start|>"])
        o1 = s.tokens.index(sp["<|output_end|>"])
        assert (call.start, call.end) == (start, o1 + 1)
        assert TOK.decode(s.tokens[o0 + 1:o1]) == call.output
        assert s.mask[o0:o1 + 1] == [0] * (o1 + 1 - o0) and s.logprobs[o0:o1 + 1] == [None] * (o1 + 1 - o0)
        assert all(m == 1 for m in s.mask[:o0] + s.mask[o1 + 1:])
        assert all(lp is not None for lp in s.logprobs[:o0] + s.logprobs[o1 + 1:])


def test_failed_calculator_call_is_recorded_and_shown_to_the_model():
    sp = TOK.specials
    prompt = [65]
    gen = [sp["<|python_start|>"], *TOK.encode("__import__('os')"), sp["<|python_end|>"], 66, 67, 68, 69] + [70] * 300
    s = Engine(ScriptedLM(prompt + gen, TOK.vocab_size), TOK).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=250))[0][0]
    (call,) = s.tool_calls
    assert call.error and call.output.startswith("Error:")
    o0, o1 = s.tokens.index(sp["<|output_start|>"]), s.tokens.index(sp["<|output_end|>"])
    assert TOK.decode(s.tokens[o0 + 1:o1]) == call.output


def test_calculator_off_and_unfinished_call():
    sp = TOK.specials
    prompt = [65]
    gen = [sp["<|python_start|>"], *TOK.encode("1+1"), sp["<|python_end|>"], 66] + [67] * 20
    m = ScriptedLM(prompt + gen, TOK.vocab_size)
    s = Engine(m, TOK).generate([prompt], SamplingParams(temperature=0, max_tokens=8, calculator=False))[0][0]
    assert s.tool_calls == [] and s.mask == [1] * 8
    s = Engine(m, TOK).generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0][0]
    (call,) = s.tool_calls
    assert call.expr == "1+" and "not finished" in call.error and call.end == 3


# ----------------------------------------------------------------------------- failures inside a step
def _inject(monkeypatch, model, where, exc, start=2):
    """Make `where` raise `exc` from the `start`-th forward of its kind on (a prefill's or a
    decode's): the model's forward, or the tokenizer in the stop-string check of a first token
    (drawn from a prefill's logits: "first token") or of a decoded one ("token"). Returns a
    set: clear it to stop."""
    real_forward, real_bytes = model.forward_step, TOK.decode_token_bytes
    armed, count = {True}, {"prefill": 0, "decode": 0, None: 0}
    phase = {"first token": "prefill", "token": "decode"}.get(where, where)
    last = [None]

    def forward_step(tokens, batch, kv):
        last[0] = "prefill" if batch.prefill else "decode"
        count[last[0]] += 1
        if armed and where == last[0] and count[phase] >= start:
            raise exc
        return real_forward(tokens, batch, kv)

    def decode_token_bytes(token):
        if armed and where != phase and last[0] == phase and count[phase] >= start:
            raise exc
        return real_bytes(token)

    monkeypatch.setattr(model, "forward_step", forward_step)
    monkeypatch.setattr(TOK, "decode_token_bytes", decode_token_bytes)
    return armed


def _free(eng):
    return eng.scheduler.allocator.num_free, eng.scheduler.num_free, eng.kv_used_bytes


@pytest.mark.parametrize("where", ["prefill", "decode", "first token", "token"])
@pytest.mark.parametrize("exc_type", [RuntimeError, MemoryError, KeyboardInterrupt])
def test_a_generate_that_raises_leaves_the_engine_as_a_fresh_one(model, monkeypatch, where, exc_type):
    """Whatever raises inside generate (the model's forward: a CUDA error, MemoryError; the
    tokenizer in a stop-string check; Ctrl-C) reaches the caller as it was, and the engine is
    left empty: every KV block and slot free again after each of two failures, nothing left
    queued, and its next generate gives a fresh engine's tokens and logprobs. It used to keep
    the half-made step: samples admitted but never started (every later call then raised
    `KVLayout.for_decode: inconsistent row`), KV runs and slots leaked (then "nothing fits an
    empty KV cache"), or the failed call's requests running on in later calls."""
    params = SamplingParams(num_samples=3, max_tokens=12, top_k=0, stop_token_ids=[], stop=["zq"], seed=5)
    prompts = PROMPTS[:3] + [[10] * 18 + [1, 2]] + PROMPTS[3:]  # it copies c's first block (prefix caching)
    ids = IDS[:3] + ["f"] + IDS[3:]
    fresh = Engine(model, TOK, max_num_seqs=4)
    want = fresh.generate(prompts, params, prompt_ids=ids)
    assert fresh.num_cached_prompt_tokens > 0
    eng = Engine(model, TOK, max_num_seqs=4)
    empty = _free(eng)
    boom = exc_type(f"injected in the {where}")
    armed = _inject(monkeypatch, model, where, boom)
    for _ in range(2):
        with pytest.raises(exc_type) as e:
            eng.generate(prompts, params, prompt_ids=ids)
        assert e.value is boom
        assert _free(eng) == empty and not eng.has_unfinished_requests()
    armed.clear()
    before = eng.num_cached_prompt_tokens
    got = eng.generate(prompts, params, prompt_ids=ids)
    key = lambda res: [[(s.tokens, s.logprobs, s.finish_reason) for s in row] for row in res]
    assert key(got) == key(want)
    assert eng.num_cached_prompt_tokens - before == fresh.num_cached_prompt_tokens  # no stale stored prompt


def test_a_step_that_raises_returns_its_requests_as_errors_from_the_next_step(model, monkeypatch):
    """Streaming (add_request / step): a step that raises ends every request in flight, and
    the next step returns each once, its unfinished samples with finish_reason "error" naming
    the exception (a continued request once, whole), after the outputs the failed step had
    not returned yet (here a bad prompt's); the memory is free and later requests give a
    fresh engine's samples. The failed step's undelivered outputs used to be lost."""
    params = SamplingParams(num_samples=2, max_tokens=12, top_k=0, stop_token_ids=[], seed=5)
    eng = Engine(model, TOK, max_num_seqs=4)
    empty = _free(eng)
    eng.add_request([1, 2, 3], params, "c")
    eng.step()
    (cut,) = eng.abort(["c"])
    eng.continue_request(cut, params)  # two continuations of one request
    eng.add_request(PROMPTS[0], params, "a")
    eng.add_request(PROMPTS[1], params, "b")
    eng.step()
    eng.add_request([], params, "bad")  # an error output, ready before the next step
    armed = _inject(monkeypatch, model, "decode", RuntimeError("CUDA error: an illegal memory access"), start=1)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        eng.step()
    armed.clear()
    assert _free(eng) == empty
    outs = eng.step()
    assert outs[0].request_id == "bad" and sorted(o.request_id for o in outs[1:]) == ["a", "b", "c"]
    for o in outs[1:]:
        assert [s.sample_index for s in o.samples] == [0, 1]
        assert all(s.finish_reason == "error" and "RuntimeError: CUDA error" in s.error for s in o.samples)
    assert not eng.has_unfinished_requests() and not eng.step()
    eng.add_request(PROMPTS[2], params, "z")
    got = []
    while eng.has_unfinished_requests():
        got += eng.step()
    (fresh,) = Engine(model, TOK, max_num_seqs=4).generate([PROMPTS[2]], params, prompt_ids=["z"])
    assert [(s.tokens, s.logprobs) for s in got[0].samples] == [(s.tokens, s.logprobs) for s in fresh]


def test_a_generate_that_raises_keeps_streaming_outputs_and_queues_none_of_its_own(model, monkeypatch):
    """A streaming request that finishes during a generate that then raises still comes back
    from the next step (it used to be lost with the call); a prompt that is not a sequence
    fails the call without leaving its earlier prompts queued (they used to run on, and come
    back from every later step, so the engine never went idle and refused weight swaps)."""
    params = SamplingParams(num_samples=1, max_tokens=8, top_k=0, stop_token_ids=[], seed=5)
    eng = Engine(model, TOK, max_num_seqs=4)
    empty = _free(eng)
    with pytest.raises(TypeError):
        eng.generate([[1, 2, 3], 7], params)
    assert _free(eng) == empty and not eng.has_unfinished_requests()
    eng.add_request([4, 5], dataclasses.replace(params, max_tokens=1), "s")
    armed = _inject(monkeypatch, model, "decode", MemoryError())
    with pytest.raises(MemoryError):
        eng.generate(PROMPTS, params, prompt_ids=IDS)
    armed.clear()
    (out,) = eng.step()
    assert out.request_id == "s" and out.samples[0].finish_reason == "length" and len(out.samples[0].tokens) == 1
    assert _free(eng) == empty and not eng.has_unfinished_requests()


def test_an_interrupt_between_two_requests_finishing_returns_each_once(model, monkeypatch):
    """Ctrl-C can land anywhere in a step, also between two requests' finishing: the request
    finished already comes back from the next step as it was, the other as an error, each
    once (the first used to be lost with the step, the other left half finished)."""
    from engine.sequence import Sequence

    params = SamplingParams(num_samples=1, max_tokens=1, top_k=0, stop_token_ids=[], seed=5)
    eng = Engine(model, TOK, max_num_seqs=4)
    empty = _free(eng)
    eng.add_request([1, 2, 3], params, "x")
    eng.add_request([4, 5], params, "y")
    real, finished = Sequence.to_sample, []

    def to_sample(seq, tokenizer):
        finished.append(seq.request.request_id)
        if len(finished) == 2:
            raise KeyboardInterrupt
        return real(seq, tokenizer)

    monkeypatch.setattr(Sequence, "to_sample", to_sample)
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    monkeypatch.undo()
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["x", "y"]
    by_id = {o.request_id: o.samples[0] for o in outs}
    assert by_id[finished[0]].finish_reason == "length" and len(by_id[finished[0]].tokens) == 1
    assert by_id[finished[1]].finish_reason == "error" and "KeyboardInterrupt" in by_id[finished[1]].error
    assert _free(eng) == empty and not eng.has_unfinished_requests()
