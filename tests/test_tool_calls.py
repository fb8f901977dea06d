"""Multi-turn tool use in the Hermes / Qwen format: parsing (engine/tool_calls.py), tools and
their schemas (engine/tool_runner.py), and the engine running calls while other samples decode
(engine/tool_turns.py).

The engine tests run a small random Llama with a Qwen2.5-layout tokenizer and Qwen2.5's real
chat template (tests/hf_cases.py), and script the sampler: a scripted sample's sampled tokens
are replaced by the tokens of a fixed tool call (with the model's own raw logprob of each), and
after its scripts run out it samples freely. So what is tested is the engine's handling of
a call the model makes: detection, the forced result, masks and logprobs, waiting, errors.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

import engine.engine as engine_mod
from engine import SamplingParams
from engine.engine import Engine
from engine.tool_calls import HermesScanner, ToolResponses, parse_tool_call
from engine.tool_runner import Tool, ToolBox, function_schema

pytest.importorskip("transformers")


# ----------------------------------------------------------------------------- parsing
def test_parse_tool_call_accepts_hermes_json_and_names_what_is_wrong():
    """A call is {"name", "arguments"}; arguments may be a JSON string; bad JSON, a non-object
    and a missing name come back as errors naming the problem, never as exceptions."""
    p = parse_tool_call('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n')
    assert (p.name, p.arguments, p.error) == ("add", {"a": 1, "b": 2}, None)
    assert parse_tool_call('{"name": "add", "arguments": "{\\"a\\": 1}"}').arguments == {"a": 1}
    assert parse_tool_call('{"name": "now"}').arguments == {}
    assert "not JSON" in parse_tool_call('{name: add}').error
    assert "JSON object" in parse_tool_call("[1, 2]").error
    assert 'no "name"' in parse_tool_call('{"arguments": {}}').error
    assert "must be a JSON object" in parse_tool_call('{"name": "add", "arguments": [1]}').error


def test_parse_tool_call_never_raises_for_json_that_python_will_not_parse():
    """json.loads raises RecursionError for brackets nested past the recursion limit and a
    plain ValueError (not JSONDecodeError) for an integer of over 4300 digits; a model in a
    repetition loop writes either (Qwen's tokenizer has one token per digit). Both escaped
    parse_tool_call and ended the engine's step loop (a 1,200-deep "[" call crashed
    Engine.generate); each is now an error on the call, in the call or in its JSON-text
    arguments."""
    deep, digits = "[" * 5000, "1" * 5000
    for text, why in [(deep, "nested too deeply"), ('{"name": "add", "arguments": ' + deep, "nested too deeply"),
                      ('{"name": "add", "arguments": {"a": ' + digits + "}}", "4300 digits")]:
        p = parse_tool_call(text)
        assert p.arguments is None and why in p.error and p.error.startswith("the tool call cannot be parsed"), p
    for inner, why in [(deep, "nested too deeply"), ('{"a": ' + digits + "}", "4300 digits")]:
        p = parse_tool_call(json.dumps({"name": "add", "arguments": inner}))
        assert p.name == "add" and p.arguments is None and why in p.error, p
        assert p.error.startswith("the arguments of add cannot be parsed")


def test_scanner_finds_calls_split_across_tokens_and_their_start_token():
    """Tags split over several tokens are found when the closing token arrives; the start is
    the token where "<tool_call>" begins; text outside tags and a lone closing tag are not
    calls; after a call the search starts afresh."""
    toks = [b"Hi <", b"tool", b"_call", b">\n{\"name\"", b": \"x\"}\n</", b"tool_call", b">\n", b"</tool_call>"]
    sc = HermesScanner()
    found = [sc.feed(i, t) for i, t in enumerate(toks)]
    assert found[:6] == [None] * 6
    assert found[6] == (0, '\n{"name": "x"}\n')
    assert found[7] is None and sc.open_at is None
    sc = HermesScanner()
    sc.feed(0, b"<tool_call>")
    sc.feed(1, b'{"name"')
    assert sc.open_start == 0 and sc.open_text() == '{"name"'


def test_scanner_keeps_bounded_memory_on_long_text_without_calls():
    sc = HermesScanner()
    for i in range(5000):
        assert sc.feed(i, b"word> ") is None
    assert len(sc.buf) < 1024
    assert sc.feed(5000, b"<tool_call>{}</tool_call>") == (5000, "{}")


def test_schema_from_signature_and_bad_tools_named():
    """Parameters come from type hints (required: no default), the description from the
    docstring's first paragraph; a bad name, path, timeout or max_calls raises naming it."""
    def area(width: float, height: float = 1.0, unit: str | None = None) -> str:
        """Area of a rectangle.

        More text."""
        return str(width * height)

    desc, params = function_schema(area)
    assert desc == "Area of a rectangle."
    assert params == {"type": "object", "properties": {"width": {"type": "number"}, "height": {"type": "number"},
                                                       "unit": {"type": "string"}}, "required": ["width"]}
    assert Tool.of(area).schema()["function"]["name"] == "area"
    for kw, word in [({"name": "a b", "function": area}, "name"), ({"name": "t", "function": "no colon"}, "function"),
                     ({"name": "t", "function": area, "timeout_s": 0}, "timeout_s"),
                     ({"name": "t", "function": area, "max_calls": 0}, "max_calls")]:
        with pytest.raises(ValueError, match=word):
            Tool(**kw)
    with pytest.raises(ValueError, match="twice"):
        ToolBox([area, area])


def test_runner_replaces_an_abandoned_thread():
    """With one worker thread, a call that hangs and is abandoned (its timeout passed) does
    not hold the next call back: a new thread takes its place. Results and errors come back
    in futures (ToolError for a non-string result)."""
    from engine.tool_runner import ToolError, ToolRunner

    release, started = threading.Event(), threading.Event()
    runner = ToolRunner(max_workers=1)
    hung = runner.submit(Tool("hang", lambda: started.set() or (release.wait(30) and "late")), {})
    started.wait(10)
    queued = runner.submit(Tool("add", add), {"a": 1, "b": 2})  # behind the hung call
    runner.abandon(hung)
    assert queued.result(timeout=10) == "3"
    assert runner.submit(Tool("add", add), {"a": 2, "b": 2}).result(timeout=10) == "4"
    with pytest.raises(ToolError, match="returned int"):
        runner.submit(Tool("n", not_text), {}).result(timeout=10)
    release.set()


def test_runner_starts_a_thread_for_each_call_submitted_while_one_thread_is_idle():
    """Two calls submitted back to back (two samples calling in one step) while one thread
    is idle both run at once: the second does not wait for the first, however long it
    takes, while fewer than max_workers threads exist. (Before, a thread was started only
    when none was idle, and one idle thread stood for both calls: the second ran after the
    first, a hung tool holding it back until its timeout, with three threads unused.)"""
    from engine.tool_runner import ToolRunner

    runner = ToolRunner(max_workers=4)
    assert runner.submit(Tool("add", add), {"a": 1, "b": 2}).result(timeout=10) == "3"
    while runner._idle != 1:  # its thread is back waiting for work (a few bytecodes after the result)
        pass
    gate, first_started = threading.Event(), threading.Event()

    def slow() -> str:
        first_started.set()
        gate.wait(30)
        return "slow"

    try:
        first = runner.submit(Tool("slow", slow), {})
        second = runner.submit(Tool("quick", lambda: "quick"), {})
        assert first_started.wait(10)
        assert second.result(timeout=10) == "quick" and not first.done()
    finally:
        gate.set()
    assert first.result(timeout=10) == "slow"


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(model, tokenizer): a random 2-layer Llama (transformers save_pretrained) and the
    Qwen2.5-layout tokenizer with Qwen2.5's template (which reads `tools`)."""
    import hf_cases as C
    import transformers

    from engine import load_engine

    tok_dir = C.case_dir("qwen2", str(tmp_path_factory.mktemp("tok")))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=3072, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    d = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    eng = load_engine(d, device="cpu", dtype="float32", tokenizer=tok_dir)
    return eng.model, eng.tokenizer


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def call_text(name, args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture
def scripted(monkeypatch):
    """script(engine, {prompt_id: [turn text, ...]}): the sampled tokens of every sample of
    those prompts spell turn k's text right after its k-th forced tool result block (or at the
    start), each with its raw logprob; after the last turn it samples freely."""
    def install(eng, scripts):
        real = engine_mod.sample_step
        enc = {pid: [eng.tokenizer.encode(t) for t in turns] for pid, turns in scripts.items()}

        def step(logits, temperature, top_k, top_p, min_p, keys, positions, kinds, processed, batched=None):
            lsm = torch.log_softmax(logits.float(), -1)
            toks, lps = real(logits, temperature, top_k, top_p, min_p, keys, positions, kinds, processed, batched)
            by_key = {seq.key: seq for seq in eng.running.values()}
            for i, key in enumerate(keys.tolist()):
                seq = by_key.get(tuple(key))  # None: another engine's row (an earlier script's wrapper)
                turns = None if seq is None else enc.get(seq.request.prompt_id)
                if not turns or seq.forced or seq.pending is not None:
                    continue  # not scripted, or its row's token is dropped for a forced one
                # the forced blocks so far (tools.parallel_calls: a turn's calls share one)
                blocks = sorted({c.end for c in seq.tool_calls if c.forced_start is not None})
                done, k = len(blocks), len(seq.tokens) - (blocks[-1] if blocks else 0)
                if done < len(turns) and k < len(turns[done]):
                    toks[i] = turns[done][k]
                    lps[i] = lsm[i, turns[done][k]]
            return toks, lps

        monkeypatch.setattr(engine_mod, "sample_step", step)
    return install


PARAMS = SamplingParams(num_samples=1, max_tokens=100, temperature=1.0, seed=3, stop_token_ids=[])


def gated_add(gate: threading.Event):
    """An `add(a, b)` tool that blocks until `gate` opens (at most 30 s): a call that stays
    running while the test steps the engine, without sleeps."""
    def gated(a: int, b: int) -> str:
        gate.wait(30)
        return str(a + b)
    return gated


def chat(tok, prompt="What is 2+3?", tools=None):
    return tok.render_chat([{"role": "user", "content": prompt}], tools=tools)


def test_a_call_that_returns_before_submit_does_has_a_latency_of_zero_or_more(parts, scripted, monkeypatch):
    """latency_s runs from the call's submission to its tool's return: a tool thread that
    returned before `submit` itself did (a failed import, a quick tool) gave a negative
    latency (seen once in the suite: -2.2e-05 s), since the start was read after submit."""
    from concurrent.futures import Future

    import engine.tool_runner as tool_runner

    def returns_at_once(self, tool, arguments):  # as a thread that finishes first would
        fut = Future()
        fut.set_running_or_notify_cancel()
        fut.batchgen_started_at = fut.batchgen_done_at = time.perf_counter()
        fut.set_result(tool_runner.call_tool(tool, arguments))
        return fut

    monkeypatch.setattr(tool_runner.ToolRunner, "submit", returns_at_once)
    model, tok = parts
    eng = Engine(model, tok, tools=[add])
    scripted(eng, {"q": [call_text("add", {"a": 2, "b": 3})]})
    s = eng.generate([chat(tok, tools=eng.tool_turns.box.schemas())], PARAMS, prompt_ids=["q"])[0][0]
    (c,) = [c for c in s.tool_calls if c.forced_start is not None][:1]
    assert c.output == "5" and c.latency_s >= 0


def test_result_is_forced_as_the_template_renders_it(parts, scripted):
    """A scripted call: the tool runs, and the tokens after the call are exactly the template's
    rendering of the conversation [user, assistant(call), tool(result)] with the generation
    prompt (mask 0, no logprob); then the sample goes on sampling (mask 1, logprobs); the call
    is recorded with name, arguments, output, latency and its forced span."""
    model, tok = parts
    eng = Engine(model, tok, tools=[add])
    schemas = eng.tool_turns.box.schemas()
    text = call_text("add", {"a": 2, "b": 3})
    scripted(eng, {"q": [text]})
    prompt = chat(tok, tools=schemas)
    assert "<tools>" in tok.decode(prompt) and '"name": "add"' in tok.decode(prompt)  # the template lists the tool
    s = eng.generate([prompt], PARAMS, prompt_ids=["q"])[0][0]
    (c,) = [c for c in s.tool_calls if c.forced_start is not None][:1]
    assert (c.name, json.loads(c.arguments), c.output, c.error) == ("add", {"a": 2, "b": 3}, "5", None)
    assert c.start == 0 and c.latency_s >= 0
    assert tok.decode(s.tokens[:c.forced_start]) == text
    conv = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": text},
            {"role": "tool", "content": "5"}]
    assert tok.decode(prompt + s.tokens[:c.end]) == tok.render_chat_text(conv, tools=schemas)
    assert s.tokens[c.forced_start:c.end] == ToolResponses(tok, schemas).suffix("5")
    assert tok.decode(s.tokens[c.forced_start:c.end]) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n"
                                                          "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert set(s.mask[c.forced_start:c.end]) == {0} and set(s.logprobs[c.forced_start:c.end]) == {None}
    rest = range(len(s.tokens))
    sampled = [i for i in rest if not c.forced_start <= i < c.end]
    assert all(s.mask[i] == 1 and s.logprobs[i] is not None for i in sampled)
    assert len(s.tokens) == 100 and c.end < 100  # generation continued after the result


def boom(x: int = 0) -> str:
    raise RuntimeError("kaput")


def not_text() -> str:
    return 42  # type: ignore[return-value]


def test_failures_become_error_messages_and_the_samples_complete(parts, scripted):
    """A tool that raises, hangs past its timeout, returns a non-string or does not import; a
    call that is not JSON; an unknown tool name: each is recorded with an error naming it,
    the model sees "Error: ..." as the tool message, and every sample finishes."""
    model, tok = parts
    release = threading.Event()
    tools = [Tool("boom", boom), Tool("hang", lambda: release.wait(30) and "late", timeout_s=0.2),
             Tool("not_text", not_text), Tool("missing", "no_such_module_xyz.sub:fn")]
    eng = Engine(model, tok, tools=tools)
    cases = {"boom": (call_text("boom", {"x": 1}), "boom raised RuntimeError: kaput"),
             "hang": (call_text("hang", {}), "hang timed out after 0.2 s"),
             "not_text": (call_text("not_text", {}), "not_text returned int, not a string"),
             "missing": (call_text("missing", {}), "'no_such_module_xyz.sub:fn' does not import: ModuleNotFoundError"),
             "json": ("<tool_call>\n{name: boom}\n</tool_call>", "the tool call is not JSON"),
             "unknown": (call_text("weather", {"city": "Oslo"}), "unknown tool 'weather'")}
    scripted(eng, {k: [v[0]] for k, v in cases.items()})
    params = SamplingParams(num_samples=1, max_tokens=200, seed=3, stop_token_ids=[])
    try:
        res = eng.generate([chat(tok, tools=eng.tool_turns.box.schemas())] * len(cases), params, prompt_ids=list(cases))
    finally:
        release.set()
    for (pid, (_, why)), (s,) in zip(cases.items(), res):
        c = s.tool_calls[0]
        assert s.finish_reason == "length" and s.error is None, pid
        assert why in c.error, (pid, c.error)
        assert c.output == f"Error: {c.error}"
        assert f"Error: {c.error}" in tok.decode(s.tokens[c.forced_start:c.end])
        assert set(s.mask[c.forced_start:c.end]) == {0}
    assert res[1][0].tool_calls[0].latency_s >= 0.2


def test_a_call_queued_for_a_thread_does_not_time_out_while_it_waits(parts, scripted):
    """timeout_s counts from when a tool thread starts a call, not from its submission: with
    every thread of the engine busy (one sample per thread, each call blocking on an Event),
    a call queued behind them waits for longer than twice its timeout without timing out;
    once the threads are free it runs and the model gets its result, its latency counting
    the wait. (Before, the wait counted: a load above the threads turned quick calls into
    timeouts.)"""
    model, tok = parts
    release = threading.Event()
    quick_timeout = 0.3
    eng = Engine(model, tok, tools=[Tool("hang", lambda: release.wait(30) and "late", timeout_s=30),
                                    Tool("add", add, timeout_s=quick_timeout)])
    threads = eng.tool_turns.runner.max_workers
    scripted(eng, {"H": [call_text("hang", {})], "Q": [call_text("add", {"a": 2, "b": 3})]})
    prompt = chat(tok, tools=eng.tool_turns.box.schemas())
    params = SamplingParams(max_tokens=60, seed=3, stop_token_ids=[])
    try:
        eng.add_request(prompt, dataclasses.replace(params, num_samples=threads), "H")
        while sum(s.pending is not None for s in eng.running.values()) < threads:
            eng.step()
        eng.add_request(prompt, params, "Q")  # its call comes when every thread runs a hanging one
        while not any(s.request.prompt_id == "Q" and s.pending is not None for s in eng.running.values()):
            eng.step()
        (q,) = [s for s in eng.running.values() if s.request.prompt_id == "Q"]
        submitted = q.pending.t0
        while time.perf_counter() - submitted < 2 * quick_timeout:
            eng.step()  # blocks on the tools (at most MAX_BLOCK_S): every sample waits
            assert q.pending is not None and q.tool_calls[0].error is None, q.tool_calls[0].error
        release.set()
        outs = {}
        while eng.has_unfinished_requests():
            outs.update((o.prompt_id, o.samples) for o in eng.step())
    finally:
        release.set()
    (s,) = outs["Q"]
    c = s.tool_calls[0]
    assert (c.output, c.error) == ("5", None) and c.latency_s >= 2 * quick_timeout
    assert [x.tool_calls[0].output for x in outs["H"]] == ["late"] * threads


def test_max_calls_and_max_turns_are_enforced(parts, scripted):
    """max_calls=1: a second call of the same tool is answered with an error; max_turns=2: a
    third call is recorded but not run (nothing forced) and the sample goes on."""
    model, tok = parts
    eng = Engine(model, tok, tools=ToolBox([Tool("add", add, max_calls=1)], max_turns=2))
    t = call_text("add", {"a": 1, "b": 1})
    scripted(eng, {"q": [t, t, t]})
    s = eng.generate([chat(tok)], SamplingParams(num_samples=1, max_tokens=260, seed=0, stop_token_ids=[]),
                     prompt_ids=["q"])[0][0]
    first, second = s.tool_calls[0], s.tool_calls[1]
    assert (first.output, first.error) == ("2", None)
    assert "may be called 1 times" in second.error
    third = s.tool_calls[2]
    assert "not run: the sample reached max_turns (2)" in third.error
    # the call text's tokens (how many depends on the test tokenizer's merges, learned from
    # GSM8K where ../shared is beside the checkout, else from a built-in paragraph)
    assert third.forced_start is None and third.output is None and third.end == third.start + len(tok.encode(t))
    assert s.mask[third.end:] == [1] * (260 - third.end)  # nothing forced: the model goes on


def big(n: int) -> str:
    """Return n characters."""
    return "x" * n


def test_a_long_result_is_cut_to_max_response_chars_before_it_is_tokenized(parts, scripted):
    """ToolBox(max_response_chars=40) (config: tools.max_response_chars): a 2,000,000-character
    result is shown to the model, and recorded, as its first 40 characters and verl's
    "...(truncated)" marker; an error message is cut the same way; a short result is whole.
    Without the bound the whole result was tokenized (seconds for megabytes) and forced."""
    from engine.tool_runner import TRUNCATED

    model, tok = parts
    eng = Engine(model, tok, tools=ToolBox([Tool("big", big)], max_response_chars=40))
    scripted(eng, {"q": [call_text("big", {"n": 2_000_000}), call_text("big", {"n": 5}),
                         call_text("big", {"n": 1, "junk": "y" * 60})]})
    s = eng.generate([chat(tok)], SamplingParams(num_samples=1, max_tokens=600, seed=0, stop_token_ids=[]),
                     prompt_ids=["q"])[0][0]
    cut, short, bad = s.tool_calls
    assert (cut.output, cut.error) == ("x" * 40 + TRUNCATED, None)
    assert s.tokens[cut.forced_start:cut.end] == ToolResponses(tok, eng.tool_turns.box.schemas()).suffix(cut.output)
    assert (short.output, short.error) == ("xxxxx", None)
    assert bad.output == ("Error: " + bad.error)[:40] + TRUNCATED and bad.error.endswith(TRUNCATED)
    assert len(bad.error) == 40 + len(TRUNCATED) and bad.error.startswith("bad arguments for big")
    with pytest.raises(ValueError, match="max_response_chars: must be an integer >= 1"):
        ToolBox([Tool("big", big)], max_response_chars=0)


def tagged(x: int) -> str:
    """Return x as an answer."""
    return f"<answer>{x}</answer>"


def test_stop_strings_are_matched_on_sampled_text_not_on_forced_tool_output(parts, scripted):
    """Stop strings that the forced result holds (the template's "<|im_end|>" and "user", a
    tool output holding "</answer>") do not end the sample: the result is forced whole and
    the model goes on; its own "</answer>" ends it ("stop", the last token sampled, mask 1),
    and `text` is cut there, not at the forced occurrence. (Before, every sample with such a
    stop string ended at the first forced token, mask 0, its tool result never shown.)"""
    from engine.tokenizers.stop_strings import completion_text

    model, tok = parts
    eng = Engine(model, tok, tools=[tagged])
    scripted(eng, {"q": [call_text("tagged", {"x": 5}), "It is 5.</answer> more"]})
    params = SamplingParams(num_samples=1, max_tokens=150, seed=3, stop_token_ids=[],
                            stop=["</answer>", "<|im_end|>", "user"])
    s = eng.generate([chat(tok)], params, prompt_ids=["q"])[0][0]
    (c,) = s.tool_calls
    assert (c.output, c.error) == ("<answer>5</answer>", None)
    assert s.tokens[c.forced_start:c.end] == ToolResponses(tok, eng.tool_turns.box.schemas()).suffix(c.output)
    assert (s.finish_reason, s.stop_reason, s.mask[-1]) == ("stop", "</answer>", 1) and s.logprobs[-1] is not None
    assert c.end < len(s.tokens) and set(s.mask[c.end:]) == {1}
    text = completion_text(tok, s.tokens, s.stop_reason)
    assert text == tok.decode(s.tokens[:c.end]) + "It is 5."


def test_a_waiting_sample_holds_no_one_back_and_its_tokens_do_not_change(parts, scripted):
    """Sample A calls a tool that blocks; sample B keeps decoding meanwhile (B gains tokens
    while A waits). A's tokens and logprobs equal those of a run where the tool answers at
    once, and B's equal B run alone on an engine without tools, bit for bit: noise is keyed
    by position and a row's logits do not depend on its batch."""
    model, tok = parts
    gate = threading.Event()
    gated = gated_add(gate)

    params = SamplingParams(num_samples=1, max_tokens=100, temperature=1.0, top_k=40, seed=7, stop_token_ids=[])

    def run(pre_open: bool):
        eng = Engine(model, tok, tools=[Tool("add", gated)])
        scripted(eng, {"A": [call_text("add", {"a": 2, "b": 3})]})
        if pre_open:
            gate.set()
        else:
            gate.clear()
        eng.add_request(chat(tok), params, "A")
        eng.add_request(chat(tok, "Name a prime."), params, "B")
        out, waited = {}, 0
        while eng.has_unfinished_requests():
            seqs = {s.request.prompt_id: s for s in eng.running.values()}
            if not pre_open and "A" in seqs and seqs["A"].pending is not None and not gate.is_set():
                a_len, b_len = len(seqs["A"].tokens), len(seqs["B"].tokens)
                for _ in range(5):
                    eng.step()
                assert len(seqs["A"].tokens) == a_len and len(seqs["B"].tokens) == b_len + 5
                waited += 1
                gate.set()
            for o in eng.step():
                out[o.prompt_id] = o.samples[0]
        assert waited == (0 if pre_open else 1)
        return out

    waited, direct = run(False), run(True)
    assert waited["A"].tokens == direct["A"].tokens and waited["A"].logprobs == direct["A"].logprobs
    assert waited["A"].tool_calls[0].output == "5"
    alone = Engine(model, tok).generate([chat(tok, "Name a prime.")], params, prompt_ids=["B"])[0][0]
    assert waited["B"].tokens == alone.tokens and waited["B"].logprobs == alone.logprobs


def test_template_without_tools_gets_hermes_prompt_and_tool_response_tags(parts):
    """A template that never reads `tools` (SmolLM2's ChatML) gets Hermes's tool block in the
    system message, and results inside <tool_response> tags in a "tool" message."""
    _, tok = parts
    from engine.tokenizers.hf_tokenizer import HFTokenizer

    smol = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    plain = HFTokenizer(tok.backend, special_tokens_map=tok.special_tokens_map, chat_template=smol, name="chatml")
    schemas = ToolBox([add]).schemas()
    text = plain.render_chat_text([{"role": "user", "content": "hi"}], tools=schemas)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(schemas[0]) in text
    assert ToolResponses(plain, schemas).suffix_text("5") == (
        "<|im_end|>\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_use_template_that_wraps_results_itself_gets_them_once(parts):
    """A tokenizer with named templates renders prompts with tools with its "tool_use" one
    (Hermes-2-Pro's layout: a ChatML default that never reads `tools`, a tool_use template
    that lists them and writes a tool message inside <tool_response> itself). Whether to wrap
    results was read from the default's source, so the forced result held the tags twice."""
    _, tok = parts
    from engine.tokenizers.hf_tokenizer import HFTokenizer

    default = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
               "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
    tool_use = ("{{'<|im_start|>system\n<tools> ' + (tools | tojson) + ' </tools> Call as <tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-dict>}\n</tool_call><|im_end|>\n'}}"
                "{% for m in messages %}{% if m['role'] == 'tool' %}{{'<|im_start|>tool\n<tool_response>\n' + "
                "m['content'] + '\n</tool_response><|im_end|>\n'}}{% else %}{{'<|im_start|>' + m['role'] + '\n' + "
                "m['content'] + '<|im_end|>\n'}}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
    named = HFTokenizer(tok.backend, special_tokens_map=tok.special_tokens_map,
                        chat_template={"default": default, "tool_use": tool_use}, name="hermes-2-pro")
    schemas = ToolBox([add]).schemas()
    prompt = named.render_chat_text([{"role": "user", "content": "hi"}], tools=schemas)
    assert prompt.startswith("<|im_start|>system\n<tools>")
    assert ToolResponses(named, schemas).suffix_text("5") == (
        "<|im_end|>\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_asks_for_another_call_format_is_refused(tmp_path):
    """Llama 3.x's template lists tools and asks for bare {"name": ..., "parameters": ...}
    JSON, which batchgen does not parse: an engine with function tools loaded and never ran a
    call (every one silently lost). ToolResponses (the engine's and `plan`'s check) refuses
    such a template, naming why."""
    import hf_cases as C

    from engine.tokenizers.loader import load_tokenizer

    tok = load_tokenizer(C.case_dir("llama3", str(tmp_path)))
    schemas = ToolBox([add]).schemas()
    assert '"parameters": dictionary' in tok.render_chat_text([{"role": "user", "content": "hi"}], tools=schemas)
    with pytest.raises(ValueError, match="lists tools in its own call format.*Hermes <tool_call> calls only"):
        ToolResponses(tok, schemas)


# ----------------------------------------------------------------------------- config
def test_config_tools_validated_by_key_and_listed_as_a_list(tmp_path):
    """`tools: [...]` in YAML is tools.functions; a bad entry is a SpecError (exit 2) naming
    the file and key; a function path is checked for syntax only (it imports on workers);
    the fingerprint holds the tools only when there are function tools (older outputs keep
    theirs); Python tools join the config's, and a name used twice is refused."""
    from jobs.config import load_spec
    from jobs.errors import SpecError
    from jobs.spec import JobSpec

    cfg = tmp_path / "job.yaml"
    cfg.write_text("tools:\n  - {name: fetch, function: no_such_module_xyz.sub:fetch, timeout_s: 2, max_calls: 3}\n")
    spec = load_spec(cfg)
    (tool,) = spec.tool_box().tools
    assert (tool.name, tool.function, tool.timeout_s, tool.max_calls) == ("fetch", "no_such_module_xyz.sub:fetch", 2.0, 3)
    assert spec.engine_kwargs()["tools"].max_turns == 8
    assert spec.fingerprint_dict()["tools"]["functions"][0]["function"] == "no_such_module_xyz.sub:fetch"
    assert JobSpec.from_dict({}).fingerprint_dict()["tools"] == {"calculator": True}
    for text, key in [("tools:\n  - {name: f, function: 'not a path'}\n", "tools.functions.0.function"),
                      ("tools:\n  - {function: a:b}\n", "tools.functions.0.name"),
                      ("tools:\n  - {name: f, function: a:b, timeout_s: 0}\n", "tools.functions.0.timeout_s"),
                      ("tools:\n  - {name: f, function: a:b, max_calls: -1}\n", "tools.functions.0.max_calls"),
                      ("tools:\n  - {name: f, function: a:b, parameters: {x: 1}}\n", "tools.functions.0.parameters"),
                      ("tools: {max_turns: 0}\n", "tools.max_turns"),
                      ("tools:\n  - {name: f, function: a:b}\n  - {name: f, function: a:c}\n", "used twice")]:
        cfg.write_text(text)
        with pytest.raises(SpecError, match=key) as e:
            load_spec(cfg)
        assert e.value.exit_code == 2 and str(cfg) in str(e.value)
    cfg.write_text("tools:\n  - {name: add, function: a:b}\n")
    both = load_spec(cfg).with_python_tools([Tool("mul", add)])
    assert [t.name for t in both.tool_box().tools] == ["add", "mul"]
    assert both.fingerprint_dict()["tools"]["functions"][1]["function"] == f"{__name__}:add"
    with pytest.raises(SpecError, match="used twice"):
        load_spec(cfg).with_python_tools([add])


def test_a_model_without_a_chat_template_refuses_function_tools():
    """nanochat's layout has no tool messages (its tool is the calculator): an engine with
    function tools refuses to load, naming why, and its render_chat refuses a tool list."""
    from engine import load_engine

    with pytest.raises(ValueError, match="no chat template: tool results cannot be rendered"):
        load_engine("tiny-random", device="cpu", tools=[add])
    tok = load_engine("tiny-random", device="cpu").tokenizer
    with pytest.raises(ValueError, match="no tool list"):
        tok.render_chat([{"role": "user", "content": "hi"}], tools=ToolBox([add]).schemas())


def _abort_at_second_call(eng: Engine, prompt: list[int], params: SamplingParams):
    """Request "A" stepped until its second tool call waits on its (blocked) tool, then
    aborted: the abort's RequestOutput."""
    eng.add_request(prompt, params, "A")
    while not any(s.pending is not None and len(s.tool_calls) == 2 for s in eng.running.values()):
        assert not eng.step()
    (out,) = eng.abort(["A"])
    return out


def _continue_after_gate(eng: Engine, out, params: SamplingParams, gate: threading.Event):
    """`out` continued, its blocked tool released, run to the end: the continued sample."""
    eng.continue_request(out, params)
    gate.set()
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs[0].samples[0]


def test_a_sample_aborted_while_its_tool_runs_continues_with_every_call_recorded_once(parts, scripted):
    """pause("keep") with tools: sample A makes one call (answered), then a second call whose
    tool blocks; A is aborted while it waits. The aborted sample records the second call as
    not finished; continue_request replays A's tokens, keeps the first call's record, runs the
    second call again and forces its result as the template renders it. The continued sample
    has the uninterrupted run's tokens and masks and the same calls, each recorded once."""
    model, tok = parts
    gate = threading.Event()

    def gated(a: int, b: int) -> str:
        if a == 4:  # the second call blocks until the gate opens
            gate.wait(30)
        return str(a + b)

    params = SamplingParams(num_samples=1, max_tokens=150, temperature=1.0, top_k=40, seed=7, stop_token_ids=[])
    turns = [call_text("add", {"a": 2, "b": 3}), call_text("add", {"a": 4, "b": 5})]

    def engine():
        eng = Engine(model, tok, tools=[Tool("add", gated)])
        scripted(eng, {"A": turns})
        return eng

    gate.set()
    eng = engine()
    (full,) = eng.generate([chat(tok)], params, prompt_ids=["A"])[0]

    gate.clear()
    eng = engine()
    out = _abort_at_second_call(eng, chat(tok), params)
    cut = out.samples[0]
    assert cut.finish_reason == "abort" and not eng.has_unfinished_requests() and eng.kv_used_bytes == 0
    assert [c.output for c in cut.tool_calls] == ["5", None] and "aborted" in cut.tool_calls[1].error
    assert cut.tokens == full.tokens[:len(cut.tokens)]

    s = _continue_after_gate(eng, out, params, gate)
    assert s.tokens == full.tokens and s.mask == full.mask
    key = [(c.name, c.start, c.end, c.forced_start, c.output, c.error) for c in full.tool_calls]
    assert [(c.name, c.start, c.end, c.forced_start, c.output, c.error) for c in s.tool_calls] == key
    assert [c.output for c in s.tool_calls] == ["5", "9"]


def test_a_continued_sample_counts_max_calls_as_the_uninterrupted_one(parts, scripted):
    """max_calls=2: a call of add with arguments that are not JSON, a second (its tool blocks,
    the sample is aborted there and continued), a third. A continuation counts the calls it
    replays from their records, bad one included; the first run counted only the calls whose
    arguments parsed, so the continued sample ran the third call that the uninterrupted one
    refused. Every call naming a tool now counts, in both."""
    model, tok = parts
    gate = threading.Event()

    def gated(a: int, b: int) -> str:
        if a == 4:
            gate.wait(30)
        return str(a + b)

    params = SamplingParams(num_samples=1, max_tokens=260, temperature=1.0, top_k=40, seed=7, stop_token_ids=[])
    turns = ['<tool_call>\n{"name": "add", "arguments": "{oops"}\n</tool_call>', call_text("add", {"a": 4, "b": 5}),
             call_text("add", {"a": 1, "b": 1})]

    def engine():
        eng = Engine(model, tok, tools=[Tool("add", gated, max_calls=2)])
        scripted(eng, {"A": turns})
        return eng

    gate.set()
    (full,) = engine().generate([chat(tok)], params, prompt_ids=["A"])[0]
    assert [c.output.split(" (")[0] for c in full.tool_calls] == [
        "Error: the arguments of add are not JSON", "9", "Error: add may be called 2 times per sample"]
    gate.clear()
    eng = engine()
    out = _abort_at_second_call(eng, chat(tok), params)
    s = _continue_after_gate(eng, out, params, gate)
    assert [(c.start, c.end, c.output, c.error) for c in s.tool_calls] == [
        (c.start, c.end, c.output, c.error) for c in full.tool_calls]
    assert s.tokens == full.tokens and s.mask == full.mask


def test_a_sample_aborted_inside_or_just_before_a_forced_result_continues_with_its_rest(parts, scripted):
    """pause("keep") while a result is being forced: the sample is aborted after 1 and after
    all but one of the result's forced tokens (an answered call), and after none of them (a
    call refused at once, an unknown tool: its error is queued in the step that closes the
    call). Each continuation is forced the rest of the result before it samples again: it has
    the uninterrupted run's tokens, masks, null logprobs and call records (with their forced
    spans), and its logprobs agree to prefill-vs-decode rounding."""
    model, tok = parts
    params = SamplingParams(num_samples=1, max_tokens=110, temperature=1.0, top_k=40, seed=7, stop_token_ids=[])

    def engine(turn):
        eng = Engine(model, tok, tools=[add])
        scripted(eng, {"A": [turn]})
        return eng

    def record(s):
        return [(c.name, c.start, c.end, c.forced_start, c.output, c.error) for c in s.tool_calls]

    for turn, cuts in [(call_text("add", {"a": 2, "b": 3}), (1, -1)), (call_text("weather", {"city": "Oslo"}), (0,))]:
        (full,) = engine(turn).generate([chat(tok)], params, prompt_ids=["A"])[0]
        (c,) = full.tool_calls
        assert c.forced_start is not None and c.end < len(full.tokens)  # sampling goes on after the result
        for fed in cuts:
            n = (c.forced_start if fed >= 0 else c.end) + fed  # tokens of the aborted sample
            eng = engine(turn)
            eng.add_request(chat(tok), params, "A")
            while not eng.running or len(next(iter(eng.running.values())).tokens) < n:
                eng.step()
            (out,) = eng.abort(["A"])
            assert len(out.samples[0].tokens) == n, (turn, fed)
            eng.continue_request(out, params)
            outs = []
            while eng.has_unfinished_requests():
                outs += eng.step()
            s = outs[0].samples[0]
            assert (s.tokens, s.mask, record(s)) == (full.tokens, full.mask, record(full)), (turn, fed)
            assert [x is None for x in s.logprobs] == [x is None for x in full.logprobs]
            assert max(abs(x - y) for x, y in zip(s.logprobs, full.logprobs) if x is not None) < 1e-4


@pytest.mark.parametrize("prefix_sharing", [False, True], ids=["own-copy", "shared"])
def test_compaction_moves_every_cached_position_of_a_continuation_waiting_for_its_tool(parts, scripted,
                                                                                        prefix_sharing):
    """A sample aborted while its tool runs is continued, and its call runs again before its
    first token (Sequence.first_pending): its last replayed token, the call's closing one,
    already has its KV from the prompt's prefill. A compaction then slides its run down over a
    finished request's freed blocks. Without prefix sharing the run holds that position too
    (the prompt's copy), and the compaction moves it: the sample's tokens and logprobs are
    bit-identical to those of the same continuation without the compaction."""
    model, tok = parts
    gate = threading.Event()
    gated = gated_add(gate)

    params = SamplingParams(num_samples=1, max_tokens=80, temperature=1.0, top_k=40, seed=7, stop_token_ids=[])

    def continued(compact: bool):
        gate.clear()
        eng = Engine(model, tok, tools=[Tool("add", gated)], prefix_sharing=prefix_sharing, prefix_caching=False)
        scripted(eng, {"A": [call_text("add", {"a": 2, "b": 3})]})
        eng.add_request(chat(tok), params, "A")
        while not any(s.pending is not None for s in eng.running.values()):
            eng.step()
        (out,) = eng.abort(["A"])
        if compact:  # a short request takes the low blocks, the continuation goes above it
            eng.add_request(chat(tok, "hi"), SamplingParams(max_tokens=3, seed=1, stop_token_ids=[]), "F")
        eng.continue_request(out, params)
        eng.step()
        (seq,) = [s for s in eng.running.values() if s.request.prompt_id == "A"]
        assert seq.first_pending and seq.pending is not None
        if compact:
            while any(s.request.prompt_id == "F" for s in eng.running.values()):
                eng.step()
            before = seq.own_start
            eng._compact()  # what step() runs when the free blocks are too scattered to admit a request
            assert seq.own_start < before and seq.first_pending
        gate.set()
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.prompt_id == "A"]
        return outs[0].samples[0]

    try:
        moved, still = continued(True), continued(False)
    finally:
        gate.set()
    assert moved.tool_calls[0].output == "5"
    assert (moved.tokens, moved.mask, moved.logprobs) == (still.tokens, still.mask, still.logprobs)
