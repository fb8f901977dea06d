"""Parallel tool calls (ToolBox.parallel_calls, config tools.parallel_calls): a model writes
several Hermes <tool_call>s in one assistant turn and ends the turn itself with its
end-of-turn token (<|im_end|>); the engine then runs every call of the turn and forces the
tool messages as the chat template renders consecutive tool messages (Qwen2.5's: one user
block, one <tool_response> each), then the next assistant header (engine/tool_turns.py).

Same model, tokenizer (Qwen2.5's real template) and scripted sampler as tests/test_tool_calls.py,
except that a script's turn k starts after the k-th forced block (one block per turn, shared by
the turn's calls) and ends with a scripted <|im_end|> (sampled: mask 1, the model's own raw
logprob).
"""
from __future__ import annotations

import json
import threading

import pytest

from engine import SamplingParams
from engine.engine import Engine
from engine.tool_calls import ToolResponses
from engine.tool_runner import Tool, ToolBox
from test_tool_calls import add, call_text, chat, parts, scripted  # noqa: F401 - parts, scripted: fixtures

pytest.importorskip("transformers")

END = "<|im_end|>"


def turn(*calls, end: str = END) -> str:
    """The assistant text of a turn of calls as Qwen2.5's template renders an assistant
    message with tool_calls (calls joined by a newline), ended by `end`."""
    return "\n".join(call_text(name, args) for name, args in calls) + end


def assistant(*calls) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}


def params(tok, max_tokens=320, **kw) -> SamplingParams:
    return SamplingParams(num_samples=1, max_tokens=max_tokens, temperature=1.0, top_k=40, seed=7,
                          stop_token_ids=[tok.special(END)], **kw)


def record(s):
    return [(c.name, c.arguments, c.start, c.end, c.forced_start, c.output, c.error) for c in s.tool_calls]


def test_the_calls_of_a_turn_run_when_the_model_ends_it_and_their_messages_are_forced_together(parts, scripted):
    """Two calls in one turn, then <|im_end|>: neither runs when its </tool_call> closes; the
    <|im_end|> stays as sampled (mask 1, a logprob); then the tokens after it are exactly the
    template's rendering of [user, assistant(two tool_calls), tool, tool] with the generation
    prompt (mask 0, no logprobs), one block shared by both records ([forced_start, end)); the
    model answers and ends its next turn with <|im_end|>, which, with no call in that turn,
    ends the sample ("stop"). Off (the default), the same script runs the first call at once."""
    model, tok = parts
    im_end = tok.special(END)
    calls = [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]
    eng = Engine(model, tok, tools=ToolBox([add], parallel_calls=True))
    schemas = eng.tool_turns.box.schemas()
    scripted(eng, {"q": [turn(*calls), "They are 5 and 9." + END]})
    prompt = chat(tok, tools=schemas)
    s = eng.generate([prompt], params(tok), prompt_ids=["q"])[0][0]
    first, second = s.tool_calls
    assert [(c.name, json.loads(c.arguments), c.output, c.error) for c in s.tool_calls] == [
        ("add", a, out, None) for (_, a), out in zip(calls, ["5", "9"])]
    assert first.start == 0 and tok.decode(s.tokens[:second.start]) == call_text(*calls[0]) + "\n"
    f, e = first.forced_start, first.end
    assert (second.forced_start, second.end) == (f, e) and first.latency_s >= 0 and second.latency_s >= 0
    assert s.tokens[f - 1] == im_end and s.mask[f - 1] == 1 and s.logprobs[f - 1] is not None
    conv = [{"role": "user", "content": "What is 2+3?"}, assistant(*calls),
            {"role": "tool", "content": "5"}, {"role": "tool", "content": "9"}]
    assert tok.decode(prompt + s.tokens[:e]) == tok.render_chat_text(conv, tools=schemas)
    assert s.tokens[f:e] == ToolResponses(tok, schemas).after_turn_end(["5", "9"])
    assert tok.decode(s.tokens[f:e]) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
                                         "<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert set(s.mask[f:e]) == {0} and set(s.logprobs[f:e]) == {None}
    assert all(s.mask[i] == 1 and s.logprobs[i] is not None for i in range(len(s.tokens)) if not f <= i < e)
    assert (s.finish_reason, s.stop_reason, s.tokens[-1]) == ("stop", im_end, im_end)
    whole = conv + [{"role": "assistant", "content": "They are 5 and 9."}]
    rendered = tok.render_chat_text(whole, tools=schemas, add_generation_prompt=False)
    assert tok.decode(prompt + s.tokens) + "\n" == rendered

    off = Engine(model, tok, tools=[add])
    scripted(off, {"q": [turn(*calls)]})
    o = off.generate([prompt], params(tok), prompt_ids=["q"])[0][0]
    assert o.tool_calls[0].forced_start == len(tok.encode(call_text(*calls[0])))  # run as soon as it closed


def test_max_calls_counts_in_order_a_turn_counts_once_and_past_max_turns_the_sample_ends(parts, scripted):
    """max_calls=2, max_turns=2: turn 1 holds three calls of add (the third refused, its error
    forced as the third tool message, in order), turn 2 one more (refused: the count goes on
    across turns), turn 3 one call: past max_turns, recorded as not run (nothing forced), and
    the sample ends on that turn's <|im_end|> ("stop", mask 1)."""
    model, tok = parts
    eng = Engine(model, tok, tools=ToolBox([Tool("add", add, max_calls=2)], max_turns=2, parallel_calls=True))
    schemas = eng.tool_turns.box.schemas()
    one, two, three = ("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2}), ("add", {"a": 3, "b": 3})
    scripted(eng, {"q": [turn(one, two, three), turn(one), turn(two)]})
    s = eng.generate([chat(tok)], params(tok, max_tokens=400), prompt_ids=["q"])[0][0]
    refused = "add may be called 2 times per sample"
    assert [(c.output, c.error) for c in s.tool_calls] == [
        ("2", None), ("4", None), (f"Error: {refused}", refused), (f"Error: {refused}", refused),
        (None, "not run: the sample reached max_turns (2)")]
    block = s.tool_calls[0]
    assert {(c.forced_start, c.end) for c in s.tool_calls[:3]} == {(block.forced_start, block.end)}
    assert s.tokens[block.forced_start:block.end] == ToolResponses(tok, schemas).after_turn_end(
        ["2", "4", f"Error: {refused}"])
    last = s.tool_calls[-1]
    assert last.forced_start is None and last.end == last.start + len(tok.encode(call_text(*two)))
    assert (s.finish_reason, s.stop_reason, s.mask[-1]) == ("stop", tok.special(END), 1)
    assert len(s.tokens) == last.end + 1 and s.logprobs[-1] is not None


def test_each_call_of_a_turn_has_its_own_timeout_and_errors_are_forced_in_order(parts, scripted):
    """A turn of a call that hangs past its 0.2 s timeout, a quick one and an unknown tool:
    the quick one's result is not forced before the hung one is given up; then the three tool
    messages come in call order, each recorded with its own answer."""
    model, tok = parts
    release = threading.Event()
    eng = Engine(model, tok, tools=ToolBox([Tool("hang", lambda: release.wait(30) and "late", timeout_s=0.2),
                                            add], parallel_calls=True))
    scripted(eng, {"q": [turn(("hang", {}), ("add", {"a": 2, "b": 3}), ("weather", {}))]})
    try:
        s = eng.generate([chat(tok)], params(tok), prompt_ids=["q"])[0][0]
    finally:
        release.set()
    hang, quick, unknown = s.tool_calls
    assert (hang.error, quick.output) == ("hang timed out after 0.2 s", "5") and hang.latency_s >= 0.2
    assert unknown.error.startswith("unknown tool 'weather'") and unknown.latency_s == 0
    outputs = [c.output for c in s.tool_calls]
    assert outputs == ["Error: hang timed out after 0.2 s", "5", f"Error: {unknown.error}"]
    assert s.tokens[hang.forced_start:hang.end] == eng.tool_turns.responses.after_turn_end(outputs)


def test_a_turn_that_does_not_end_on_the_end_of_turn_token_runs_nothing(parts, scripted):
    """Closed calls whose turn never ends on a sampled <|im_end|> are recorded as not run:
    the sample reaches max_tokens, completes a stop string, or samples another stop token
    (<|endoftext|>, which Qwen's template does not end an assistant turn with); the sample
    ends as it would without tools. A <tool_call> left open when the turn ends is recorded
    as not finished, and the next turn searches afresh."""
    model, tok = parts
    eng = Engine(model, tok, tools=ToolBox([add], parallel_calls=True))
    c = ("add", {"a": 2, "b": 3})
    n = len(tok.encode(call_text(*c)))
    eot = tok.special("<|endoftext|>")
    scripted(eng, {"len": [turn(c, end="")], "str": [turn(c, end=" DONE")], "eot": [turn(c, end="<|endoftext|>")],
                   "open": [turn(c, end='\n<tool_call>\n{"name"' + END)]})
    ps = {"len": params(tok, max_tokens=n + 1), "str": params(tok, max_tokens=120, stop=["DONE"]),
          "eot": SamplingParams(max_tokens=120, seed=7, stop_token_ids=[tok.special(END), eot])}
    for pid, why in [("len", "length"), ("str", "stop"), ("eot", "stop")]:
        s = eng.generate([chat(tok)], ps[pid], prompt_ids=[pid])[0][0]
        (rec,) = s.tool_calls
        assert s.finish_reason == why, pid
        assert (rec.output, rec.forced_start, rec.end) == (None, None, n), pid
        assert rec.error == f"not run: the sample ended ({why}) before the turn's calls ran", pid
        assert set(s.mask) == {1}
    assert s.stop_reason == eot and s.tokens[-1] == eot
    s = eng.generate([chat(tok)], params(tok), prompt_ids=["open"])[0][0]
    ran, open_ = s.tool_calls
    assert (ran.output, open_.error) == ("5", "call not finished: the turn ended before </tool_call>")
    assert open_.end == ran.forced_start - 1 and s.tokens[open_.end] == tok.special(END)
    assert tok.decode(s.tokens[open_.start:open_.end]) == '<tool_call>\n{"name"'


def _full_and_engine(model, tok, scripted, gate, turns, **box):
    def engine():
        eng = Engine(model, tok, tools=ToolBox([Tool("add", gated(gate))], parallel_calls=True, **box))
        scripted(eng, {"A": turns})
        return eng
    gate.set()
    (full,) = engine().generate([chat(tok)], params(tok), prompt_ids=["A"])[0]
    return full, engine


def gated(gate: threading.Event):
    """add(a, b) that blocks while `gate` is closed when a == 4 (at most 30 s)."""
    def add_(a: int, b: int) -> str:
        if a == 4:
            gate.wait(30)
        return str(a + b)
    return add_


def _run_out(eng):
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs[0].samples[0]


TURNS = [turn(("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})), "So 5 and 9, " + turn(("add", {"a": 1, "b": 1}))]


def test_a_sample_aborted_while_its_turns_calls_run_continues_as_if_never_stopped(parts, scripted):
    """The turn's first call is answered, the second blocks; the sample is aborted there: it
    ends on its sampled <|im_end|>, the first call keeps its answer, the second is recorded as
    not finished. continue_request replays it, runs only the second call again, forces both
    tool messages and goes on: tokens, mask and records equal the uninterrupted sample's,
    later turn included."""
    model, tok = parts
    gate = threading.Event()
    full, engine = _full_and_engine(model, tok, scripted, gate, TURNS)
    assert [c.output for c in full.tool_calls] == ["5", "9", "2"]
    gate.clear()
    eng = engine()
    p = params(tok)
    try:
        eng.add_request(chat(tok), p, "A")
        while not any(s.pending is not None and s.pending.calls[0].output is not None for s in eng.running.values()):
            assert not eng.step()
        (out,) = eng.abort(["A"])
        cut = out.samples[0]
        assert cut.tokens[-1] == tok.special(END) and cut.mask[-1] == 1 and cut.finish_reason == "abort"
        assert [c.output for c in cut.tool_calls] == ["5", None] and "aborted" in cut.tool_calls[1].error
        assert cut.tokens == full.tokens[:len(cut.tokens)] and eng.kv_used_bytes == 0
        ran = []
        eng.continue_request(out, p)
        eng.step()
        (seq,) = eng.running.values()
        assert seq.first_pending and [c.output for c in seq.pending.calls] == ["5", None]
        ran.append(len(seq.pending.running))
        gate.set()
        s = _run_out(eng)
    finally:
        gate.set()
    assert ran == [1]  # the answered call was not run again
    assert (s.tokens, s.mask, record(s)) == (full.tokens, full.mask, record(full))
    assert [x is None for x in s.logprobs] == [x is None for x in full.logprobs]


def test_a_sample_aborted_anywhere_in_a_turn_continues_with_the_same_tokens(parts, scripted):
    """Aborted (the tools answering at once) after the first call closes, between the two
    calls, on the second call's closing token, on the turn's <|im_end|> (its calls submitted,
    not answered), on the first forced token and on all but one of the block's, and right
    after a turn whose every call is refused (its block queued, none fed): each continuation
    has the uninterrupted sample's tokens, masks and records, and its logprobs agree to
    prefill-vs-decode rounding."""
    model, tok = parts
    gate = threading.Event()
    refused = [call_text("nope", {}) + "\n<tool_call>\n{oops}\n</tool_call>" + END]
    close = tok.encode("</tool_call>")[-1]
    for turns in [TURNS, refused]:
        full, engine = _full_and_engine(model, tok, scripted, gate, turns)
        a = full.tool_calls[0]
        f, e = a.forced_start, a.end
        assert f is not None and e < len(full.tokens)
        closed = [i + 1 for i, t in enumerate(full.tokens) if t == close]  # tokens up to each </tool_call>
        cuts = [closed[0], closed[0] + 1, closed[1], f, f + 1, e - 1] if turns is TURNS else [f]
        for n in cuts:
            eng = engine()
            p = params(tok)
            eng.add_request(chat(tok), p, "A")
            while not eng.running or len(next(iter(eng.running.values())).tokens) < n:
                eng.step()
            (out,) = eng.abort(["A"])
            cut = out.samples[0]
            assert len(cut.tokens) == n
            if turns is TURNS and n == closed[0] + 1:  # between the calls: the first waits for its turn's end
                assert [c.error for c in cut.tool_calls] == [
                    "not run: the sample ended (abort) before the turn's calls ran"]
            elif turns is TURNS and n == f:  # on <|im_end|>: both submitted, neither answered yet
                assert [c.error for c in cut.tool_calls] == [
                    "not finished: the sample was aborted while the tool ran"] * 2
            elif n == f:  # both refused at once: their block queued, none of it fed
                assert [c.forced_start for c in cut.tool_calls] == [None] * 2
                assert None not in [c.output for c in cut.tool_calls]
            eng.continue_request(out, p)
            s = _run_out(eng)
            assert (s.tokens, s.mask, record(s)) == (full.tokens, full.mask, record(full)), (turns, n)
            assert [x is None for x in s.logprobs] == [x is None for x in full.logprobs]
            assert max(abs(x - y) for x, y in zip(s.logprobs, full.logprobs) if x is not None) < 1e-4


def test_parallel_turns_do_not_depend_on_the_batch(parts, scripted):
    """Three prompts x 2 samples, two of the prompts with parallel turns (samples waiting on
    their calls while others decode, with 8 slots): the same samples, bit for bit, with
    max_num_seqs 1 and 8."""
    model, tok = parts
    gate = threading.Event()
    gate.set()
    scripts = {"A": TURNS, "B": [turn(("add", {"a": 7, "b": 1}))], "C": ["Plain text. " + END]}
    prompts = [chat(tok, tools=ToolBox([add]).schemas()), chat(tok, "Name a prime."), chat(tok, "Hi")]
    p = SamplingParams(num_samples=2, max_tokens=300, temperature=1.0, top_k=40, seed=5,
                       stop_token_ids=[tok.special(END)])
    got = []
    for max_num_seqs in (1, 8):
        eng = Engine(model, tok, tools=ToolBox([Tool("add", gated(gate))], parallel_calls=True),
                     max_num_seqs=max_num_seqs)
        scripted(eng, scripts)
        res = eng.generate(prompts, p, prompt_ids=list(scripts))
        got.append([(s.tokens, s.mask, s.logprobs, record(s)) for r in res for s in r])
    assert got[0] == got[1]
    assert [len(x[3]) for x in got[0]] == [3, 3, 1, 1, 0, 0]



def test_parallel_calls_are_refused_at_load_when_the_template_cannot_render_two_tool_messages(parts):
    """parallel_calls forces a turn's tool messages as one block, rendered by the chat template.
    A template that renders one tool message but raises on a second in a row is refused when
    the engine loads, naming it (in a step the error would fail every request of the step);
    without parallel_calls it needs only one, and loads."""
    from engine.tool_turns import ToolTurns

    model, tok = parts
    plain = tok.render_chat_text

    def one_tool_message_only(msgs, *a, **kw):
        if sum(m.get("role") == "tool" for m in msgs) > 1:
            raise ValueError("two tool messages in a row")
        return plain(msgs, *a, **kw)

    tok.render_chat_text = one_tool_message_only
    try:
        with pytest.raises(ValueError, match="cannot render two tool messages in a row"):
            ToolTurns(ToolBox([add], parallel_calls=True), tok)
        ToolTurns(ToolBox([add]), tok)
    finally:
        tok.render_chat_text = plain
