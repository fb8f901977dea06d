"""The scan (plan) and unit reading of OpenAI batch files give exactly what they gave before
they were made fast (pydantic_core's JSON parser with json's as the fallback, the body's
checks remembered across lines of the same shape): a varied file, every kind of line the
reader tells apart (blank, malformed JSON, bad UTF-8, lone surrogates, every envelope, body,
message, prompt and sampling error, ignored keys, duplicates, fallback ids, the same body
again with other seeds, -0.0 and 0.0, 1 and 1.0 and true), under three jobs' sampling; the
public outputs (units, expected rows, byte ranges, duplicates, fallback ids, warnings, and
every line's prompt id, tokens, error, SamplingParams and passthrough) are compared with
tests/data/openai_batch_plan_golden.json, which the reader before the change wrote
(regenerate: `python tests/test_openai_batch_plan.py --write`, with the reference reader).

Also: the fast JSON parser never accepts a line that json rejects, nor decodes one to
another value (hypothesis), and the scan reads no SamplingParams per line.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
GOLDEN = ROOT / "tests" / "data" / "openai_batch_plan_golden.json"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "What is 2+2?"}]


def _line(custom_id="c", url=CHAT, body=None, **env):
    obj = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    obj.update(env)
    return json.dumps(obj)


def _chat(cid, **body):
    body.setdefault("messages", USER)
    return _line(cid, CHAT, {"model": "m", **body})


def _comp(cid, **body):
    body.setdefault("prompt", "Once upon a time")
    return _line(cid, COMP, {"model": "m", **body})


def varied_lines() -> list[bytes]:
    """Every kind of line the reader distinguishes, as raw bytes (no newline)."""
    L: list[str | bytes] = [
        _chat("a"), _chat("b", n=2, temperature=0.7, max_completion_tokens=64, stop=["\n\n"], logprobs=True),
        "", "   ", "\t",
        _comp("c"), _comp("d", prompt=[1, 2, 3], logprobs=0, ignore_eos=True, stop=["a", "b"]),
        # malformed JSON, bytes and encodings
        "{not json", '{"custom_id": "x", "method": "POST"', "[1, 2", '{"a": 1} x', "nul", '{"a": NaN}',
        b'{"custom_id": "bad-utf8", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\xff\xfe"}}',
        b"\xef\xbb\xbf" + _comp("bom").encode(), _comp("utf16").encode("utf-16"),
        b'{"custom_id": "enc-surrogate", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\xed\xa0\x80"}}',
        '{"custom_id": "deep", "x": ' + "[" * 5000 + "]" * 5000 + "}",
        '{"custom_id": "mid-deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "x": '
        + "[" * 300 + "]" * 300 + "}}",
        '{"custom_id": "bigint", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "seed": '
        + "1" * 4301 + "}}",
        '{"custom_id": "bigint2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "seed": '
        + "1" * 4300 + "}}",
        '{"custom_id": "nan", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "temperature": NaN}}',
        '{"custom_id": "inf", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "top_p": -Infinity}}',
        '{"custom_id": "e400", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "temperature": 1e400}}',
        '{"custom_id": "dupkey", "custom_id": "dupkey2", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "p", "n": 1, "n": 2}}',
        # lone surrogates (and a pair, which is text)
        '{"custom_id": "s\\udc80", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}',
        '{"custom_id": "s1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a\\ud800b"}}',
        '{"custom_id": "s2", "method": "POST", "url": "/v1/completions", "body": {"\\udfff": 1, "prompt": "p"}}',
        '{"custom_id": "s3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud83d\\ude00"}}',
        '{"custom_id": "s4", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "stop": ["\\ud800"]}}',
        # the envelope
        "[]", "3", '"text"', "null", _line("e1", CHAT, {"messages": USER}, extra=1),
        json.dumps({"method": "POST", "url": CHAT, "body": {"messages": USER}}), _line("", CHAT, {"messages": USER}),
        _line(7, CHAT, {"messages": USER}), _line(None, COMP, {"prompt": "p"}),
        json.dumps({"custom_id": "e2", "url": CHAT, "body": {"messages": USER}}),
        json.dumps({"custom_id": "e3", "method": "GET", "url": CHAT, "body": {"messages": USER}}),
        json.dumps({"custom_id": "e4", "method": "POST", "body": {"messages": USER}}),
        _line("e5", "/v1/embeddings", {"input": "x"}), _line("e6", 5, {"prompt": "p"}), _line("e7", CHAT, None),
        _line("e8", COMP, [1]), json.dumps({"custom_id": "e9", "method": "POST", "url": COMP}),
        json.dumps({"body": {"prompt": "p"}, "url": COMP, "method": "POST", "custom_id": "order"}),
        # features and parameters accepted only at their default
        _chat("f1", tools=[{"type": "function"}]), _chat("f2", tools=[]), _chat("f3", response_format={"type": "text"}),
        _chat("f4", response_format={"type": "json_object"}), _chat("f5", stream=True), _chat("f6", stream=False),
        _chat("f7", presence_penalty=0.5), _chat("f8", presence_penalty=0), _chat("f9", top_logprobs=2),
        _chat("f10", top_logprobs=0), _chat("f11", logit_bias={"1": 2}), _chat("f12", tool_choice="required"),
        _chat("f13", tool_choice="auto"), _comp("f14", echo=True), _comp("f15", suffix="x"),
        _chat("f16", modalities=["text"]), _chat("f17", modalities=["audio"]), _chat("f18", chat_template="x"),
        _comp("f19", add_special_tokens=False), _chat("f20", add_special_tokens=True),
        _chat("f21", repetition_penalty=1.0), _chat("f22", repetition_penalty=1.1), _chat("f23", min_tokens=2),
        # ignored keys: unknown, null, known-unused
        _chat("i1", foo=1, bar=None), _chat("i2", foo=2, user="u", metadata={"k": "v"}, store=True),
        _comp("i3", presence=1, zzz=[1, 2]), _chat("i4", best_of=3),
        _chat("i5", messages=[{"role": "user", "content": "x", "weird": 1, "name": None, "tool_calls": None}]),
        # messages
        _chat("m1", messages=[]), _chat("m2", messages="hi"), _line("m3", CHAT, {"model": "m"}),
        _chat("m4", messages=["hi"]), _chat("m5", messages=[{"role": "user"}]),
        _chat("m6", messages=[{"content": "x"}]), _chat("m7", messages=[{"role": 3, "content": "x"}]),
        _chat("m8", messages=[{"role": "user", "content": 3}]), _chat("m9", messages=[{"role": "", "content": "x"}]),
        _chat("m10", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        _chat("m11", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        _chat("m12", messages=[{"role": "user", "content": ["a"]}]),
        _chat("m13", messages=[{"role": "user", "content": "a", "name": 5}]),
        _chat("m14", messages=[{"role": "user", "content": "a", "name": "bob"}]),
        _chat("m15", messages=[{"role": "user", "content": "2+2"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}}]},
                               {"role": "tool", "content": "4", "tool_call_id": "t1"}]),
        _chat("m16", messages=[{"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": "{bad"}}]}]),
        _chat("m17", messages=[{"role": "assistant", "content": "x", "tool_calls": "no"}]),
        _chat("m18", messages=[{"role": "user", "content": "a", "tool_call_id": "t"}]),
        _chat("m19", messages=[{"role": "tool", "content": "a", "tool_call_id": 5}]),
        _chat("m20", messages=[{"role": "user", "content": None}]), _chat("m21", messages=USER * 3),
        _chat("m22", messages=[{"role": "system", "content": "s"}, "x", {"role": "user"}]),
        _chat("m23", messages=[{"role": "user", "content": "render-fails"}]),
        # completion prompts
        _comp("p1", prompt=""), _comp("p2", prompt=[]), _comp("p3", prompt=[1, -2]), _comp("p4", prompt=["one"]),
        _comp("p5", prompt=["one", "two"]), _comp("p6", prompt={"a": 1}), _comp("p7", prompt=[[5, 6]]),
        _comp("p8", prompt=[1, True]), _comp("p9", prompt=None), _comp("p10", prompt=[400]),
        # logprobs
        _chat("l1", logprobs=False), _chat("l2", logprobs=1), _comp("l3", logprobs=1), _comp("l4", logprobs=-1),
        _comp("l5", logprobs=True), _comp("l6", logprobs=0.0),
        # sampling values
        _chat("v1", max_tokens=0), _chat("v2", max_tokens="5"), _chat("v3", max_completion_tokens=5, max_tokens=0),
        _chat("v4", max_completion_tokens=None, max_tokens=9), _chat("v5", temperature=-1), _chat("v6", temperature="hot"),
        _chat("v7", temperature=0.0), _chat("v8", temperature=-0.0), _chat("v9", temperature=0),
        _chat("v10", temperature=1), _chat("v11", temperature=1.0), _chat("v12", temperature=True),
        _chat("v13", top_p=0), _chat("v14", top_p=1.5), _chat("v15", top_p=1), _chat("v16", n=0), _chat("v17", n=2.0),
        _chat("v18", n=True), _chat("v19", n=3), _chat("v20", seed=2 ** 64), _chat("v21", seed=-5), _chat("v22", stop=""),
        _chat("v23", stop=["a", 1]), _chat("v24", stop="x"), _chat("v25", stop=[]), _chat("v26", top_k=-1),
        _chat("v27", top_k=-2), _chat("v28", top_k=0), _chat("v29", top_k=5), _chat("v30", min_p=1), _chat("v31", min_p=0.1),
        _chat("v32", stop_token_ids=[-1]), _chat("v33", stop_token_ids=[2, 3]), _chat("v34", ignore_eos="yes"),
        _chat("v35", ignore_eos=True), _chat("v36", ignore_eos=True, stop_token_ids=[4]), _chat("v37", n=None, seed=None),
        _chat("v38", stop="x", skip_special_tokens=False), _chat("v39", skip_special_tokens="no"),
        _chat("v40", skip_special_tokens=True), _chat("v41", stop_token_ids=[True]), _chat("v42", stop_token_ids=[1.0]),
        _chat("v43", temperature=2, top_p=0.5, min_p=0.05, top_k=40, seed=3, n=4, max_tokens=12, stop=["Q:"]),
        _chat("v44", max_tokens=1.0), _chat("v45", temperature=1e308), _chat("v46", n=1000001), _chat("v47", stop=[["a"]]),
        # best_of
        _comp("b1", best_of=2, n=2), _comp("b2", best_of=3, n=2), _comp("b3", best_of=True), _comp("b4", best_of=1),
        _comp("b5", best_of=1, n=None), _comp("b6", best_of=1.0),
    ]
    # duplicates and fallback ids ("<file>:<line>" taken by another line's custom_id); line k is L[k - 1]
    n = len(L)
    L += [_comp(f"in.jsonl:{n + 2}"), _comp(""), _comp(f"in.jsonl:{n + 2}#1"), _comp("dup"), _comp("dup"),
          _comp("dup", n=0), "{broken", _comp(f"in.jsonl:{n + 7}"), _comp(f"in.jsonl:{n + 2}#1")]
    # the same shapes again: the remembered checks must give each line its own answer
    for i in range(40):
        L.append(_chat(f"r{i}", n=1 + i % 3, temperature=[0.7, 0.0, -0.0, 1, 1.0][i % 5], seed=i,
                       max_completion_tokens=[64, 0, 64, 64][i % 4], stop=[["\n\n"], "x", None, []][i % 4]))
        L.append(_comp(f"q{i}", prompt=[i + 1] if i % 2 else f"p{i}", n=[1, 2, 1.0, True][i % 4],
                       logprobs=[0, None, 1, 0][i % 4], best_of=[None, 2, None, None][i % 4], foo=i if i % 3 else None))
        L.append(_chat(f"t{i}", messages=[{"role": "user", "content": f"q{i}", "extra": i % 2}], temperature=0.5,
                       stream=[False, True, None, False][i % 4]))
    L += [_chat("rr", temperature=0.5, seed=1), _chat("rr2", seed=1, temperature=0.5), "\r", _chat("last")]
    return [x if isinstance(x, bytes) else x.encode() for x in L]


class _Tok:
    """A tokenizer for reading units without a model: text as bytes + 10, a conversation as
    its JSON text's bytes + 10 (so the exact messages the template gets are compared)."""

    vocab_size = 300
    bos_token_id = None
    prepend_bos = False

    def encode(self, s):
        return [b + 10 for b in s.encode("utf-8", "surrogatepass")]

    def render_chat(self, messages, date=None, **kw):
        if any(m.get("content") == "render-fails" for m in messages):
            raise ValueError("the template refuses this conversation")
        return [b % 250 + 10 for b in json.dumps(messages, ensure_ascii=True).encode()]


JOBS = {
    "default": {},
    "job-sampling": {"sampling": {"num_samples": 2, "max_tokens": 32, "temperature": 0.3, "stop": ["END"], "seed": 7}},
    "unit-rows-7": {"cluster": {"unit_rows": 7}, "sampling": {"top_k": 5}},
}


def public_outputs(tmp: Path) -> dict:
    """What the scan and the unit reads give for varied_lines() under each of JOBS, as JSON."""
    from jobs.inputs import reader_for
    from jobs.spec import JobSpec

    inp = tmp / "in.jsonl"
    lines = varied_lines()
    inp.write_bytes(b"\n".join(ln + (b"\r" if i % 17 == 5 else b"") for i, ln in enumerate(lines)) + b"\n")
    out: dict = {}
    for name, extra in JOBS.items():
        spec = JobSpec.from_dict({"input": {"path": str(inp), "format": "openai_batch"},
                                  "model": {"chat_template_date": "2026-01-01"}, **extra})
        scan = reader_for(spec).scan(spec)
        bp = scan.reader_state
        got = {"units": [[u.index, u.row_start, u.row_end] for u in scan.units],
               "expected_rows": sorted(scan.expected_rows.items()), "ranges": sorted(bp.ranges.items()),
               "duplicates": sorted(bp.duplicates.items()), "fallback_ids": sorted(bp.fallback_ids.items()),
               "num_rows": [f.num_rows for f in scan.files], "fingerprint_files": scan.fingerprint_files,
               "warnings": scan.warnings, "requests": []}
        reader = reader_for(spec, None, bp)
        for u in scan.units:
            reqs, decoded = reader.read_unit(u, _Tok(), spec.sampling_params())
            for r in reqs:
                got["requests"].append([r.prompt_id, r.prompt_tokens, r.error, repr(dataclasses.astuple(r.params)),
                                        sorted((k, repr(v)) for k, v in r.passthrough.items()), decoded])
        out[name] = json.loads(json.dumps(got))
    return out


def test_plan_and_units_are_what_the_reader_gave_before(tmp_path):
    want = json.loads(GOLDEN.read_text())
    got = public_outputs(tmp_path)
    assert got.keys() == want.keys()
    for job in want:
        for key in want[job]:
            if key == "requests":
                for i, (g, w) in enumerate(zip(got[job][key], want[job][key])):
                    assert g == w, (job, i)
            assert got[job][key] == want[job][key], (job, key)


def test_the_scan_builds_no_sampling_params_per_line(tmp_path, monkeypatch):
    """The scan needs each line's n, not its SamplingParams: building them (dataclasses.replace,
    every field checked again) was a third of the scan's time."""
    from jobs.inputs import reader_for
    from jobs.spec import JobSpec

    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(_chat(f"x{i}", seed=i, n=1 + i % 2, temperature=0.5) for i in range(50)) + "\n")
    spec = JobSpec.from_dict({"input": {"path": str(inp), "format": "openai_batch"}})
    calls = []
    real = dataclasses.replace
    monkeypatch.setattr(dataclasses, "replace", lambda *a, **k: calls.append(1) or real(*a, **k))
    scan = reader_for(spec).scan(spec)
    assert scan.expected_rows == {0: 75} and not calls


def _canon(v):
    """A value's exact identity for comparing two decoders: types, -0.0, nan, key order."""
    if isinstance(v, dict):
        return ("d", [(k, _canon(x)) for k, x in v.items()])
    if isinstance(v, list):
        return ("l", [_canon(x) for x in v])
    if isinstance(v, float):
        return ("f", v.hex())
    return (type(v).__name__, v)


def test_fast_json_never_accepts_or_decodes_what_json_would_not():
    """pydantic_core's parser decodes a line only where json.loads gives the same value; every
    other line (an error there) goes to json.loads, so errors and leniencies (NaN, BOM, lone
    surrogates, encoded surrogates, deep nesting) are json's."""
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    from jobs.inputs.openai_batch import _decode

    pieces = st.sampled_from([b"{", b"}", b"[", b"]", b'"', b":", b",", b" ", b"\\", b"u", b"d", b"8", b"0", b"1", b"-",
                              b".", b"e", b"E", b"+", b"NaN", b"Infinity", b"true", b"null", b"\xff", b"\xed\xa0\x80",
                              b"\xc3\xa9", b"\t", b"\x00", b"\xef\xbb\xbf", b"a", b'"k"', b"9" * 30, b"0.1", b"5e-324"])
    numbers = st.one_of(st.integers(), st.floats(allow_nan=False)).map(lambda x: json.dumps({"x": x}).encode())
    texts = st.text().map(lambda s: json.dumps({"k": s, "l": [s, 1.5]}, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    decimals = st.tuples(st.integers(0, 10 ** 30), st.integers(0, 10 ** 30), st.integers(-400, 400)).map(
        lambda t: f'{{"x": {t[0]}.{t[1]}e{t[2]}}}'.encode())

    @settings(max_examples=2000, deadline=None, derandomize=True)
    @given(st.one_of(st.lists(pieces, max_size=12).map(b"".join), numbers, texts, decimals))
    def check(raw):
        try:
            want = ("ok", _canon(json.loads(raw)))
        except (ValueError, RecursionError) as e:
            want = ("error", type(e).__name__, str(e))
        try:
            got = ("ok", _canon(_decode(raw)[0]))
        except (ValueError, RecursionError) as e:
            got = ("error", type(e).__name__, str(e))
        assert got == want

    check()


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(public_outputs(Path(d)), indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
