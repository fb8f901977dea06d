"""How samples end: stop tokens kept and scored, stop strings found across token boundaries.

A scripted model (tests/toy.py: it puts all mass on the next token of a fixed script)
"writes" text tokenized by SmolLM2's real byte-level BPE tokenizer (from the installed GGUF
file), so stop strings fall across 2, 3 and 4 real tokens, and inside a 4-byte character
that the tokenizer splits into 3 byte-level tokens.
"""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.params import SamplingParams
from engine.tokenizers.stop_strings import StopStringMatcher, completion_text
from toy import ByteTokenizer, ScriptedLM, ToyLM


@pytest.fixture(scope="module")
def tok():
    from engine.loading.builtin import resolve_builtin
    from engine.tokenizers.base import Tokenizer

    return Tokenizer.load(str(resolve_builtin("smollm2")))


class CountingTokenizer:
    """Wraps a tokenizer and counts decode() calls (the engine must not re-decode samples)."""

    def __init__(self, inner):
        self.inner = inner
        self.decodes = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids):
        self.decodes += 1
        return self.inner.decode(ids)


def generate(tok, text, stop, prompt="Q:", max_tokens=64):
    """Run the script `prompt + text` greedily with stop strings; returns (sample, generated ids)."""
    p = tok.encode(prompt)
    gen = tok.encode(text)
    counting = CountingTokenizer(tok)
    eng = Engine(ScriptedLM(p + gen, tok.vocab_size), counting)
    s = eng.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop))[0][0]
    assert counting.decodes == 0  # matched on token bytes, never by decoding the sample
    return s, gen


@pytest.mark.parametrize("text, stop, pieces, cut", [
    # "er i" starts inside " answer" and ends inside " is": 2 tokens
    ("The answer is 42.", "er i", [" answer", " is"], "The answ"),
    # "##END##" starts inside " ###", spans "END" and ends inside "###": 3 tokens
    ("Answer: 7 ###END### more", "##END##", [" ###", "END", "###"], "Answer: 7 #"),
    # the few-shot stop string: "\n", "\n", "Question", ":"
    ("The answer is 42.\n\nQuestion: what", "\n\nQuestion:", ["\n", "\n", "Question", ":"], "The answer is 42."),
    # a 4-byte character split into 3 byte-level tokens: b" \xf0\x9f", b"\x8e", b"\x89"
    ("x \U0001F389 y", "\U0001F389", [None, None, None], "x "),
])
def test_stop_string_across_tokens(tok, text, stop, pieces, cut):
    """The sample ends at the token that completes the stop string (every token up to it kept),
    finish_reason "stop", stop_reason the string, and its text ends right before the string."""
    s, gen = generate(tok, text, [stop])
    n = len(s.tokens)
    assert s.tokens == gen[:n] and s.mask == [1] * n
    assert (s.finish_reason, s.stop_reason) == ("stop", stop)
    last = [t for t in gen[n - len(pieces):n]]
    for t, piece in zip(last, pieces):
        if piece is not None:
            assert tok.decode([t]) == piece
    joined = b"".join(tok.decode_token_bytes(t) for t in gen[:n])
    assert stop.encode() in joined and stop.encode() not in joined[:-len(tok.decode_token_bytes(gen[n - 1]))]
    assert completion_text(tok, s.tokens, s.stop_reason) == cut


def test_first_of_several_stop_strings_and_no_match(tok):
    """With several stop strings the earliest completed one ends the sample; with none matching
    the sample runs to max_tokens and its text is the whole decode."""
    s, gen = generate(tok, "The answer is 42.\n\nQuestion: what", ["Question", "42", "zzz"])
    assert s.stop_reason == "42" and completion_text(tok, s.tokens, s.stop_reason) == "The answer is "
    s, gen = generate(tok, "The answer is 42.", ["zzz"], max_tokens=5)
    assert (s.finish_reason, s.stop_reason, s.tokens) == ("length", None, gen[:5])
    assert completion_text(tok, s.tokens, None) == tok.decode(gen[:5])


def test_stop_string_versus_stop_token(tok):
    """A stop token sampled before a stop string completes ends the sample as the token; text
    then excludes the token. <|im_end|> is SmolLM2's stop token (id 2)."""
    s, gen = generate(tok, "Hi there<|im_end|>Question:", ["Question:"])
    assert 2 in gen
    assert (s.finish_reason, s.stop_reason, s.tokens[-1]) == ("stop", 2, 2)
    assert completion_text(tok, s.tokens, s.stop_reason) == "Hi there"


def test_matcher_keeps_a_bounded_window():
    """The matcher holds at most len(longest stop) - 1 bytes between tokens, however long the sample."""
    m = StopStringMatcher(("abcd", "xy"))
    for _ in range(10_000):
        assert m.feed(b"zzabc") is None
        assert len(m.tail) <= 3
    assert m.feed(b"d") == "abcd"
    m = StopStringMatcher(("\u00e9",))  # é = c3 a9
    assert m.feed(b"caf\xc3") is None and m.feed(b"\xa9") == "\u00e9"
    with pytest.raises(ValueError):
        StopStringMatcher(("",))


def test_stop_strings_keep_samples_reproducible():
    """Stop strings on a random model: each sample equals the same sample without stop strings,
    cut after the first token whose bytes complete one ("|b" also matches inside the special
    token <|bos|>, whose text is its name)."""
    tok = ByteTokenizer()
    model = ToyLM(seed=5).eval()
    stops = ["@", "R", "|b"]
    p_free = SamplingParams(num_samples=6, max_tokens=40, top_k=0, stop_token_ids=[])
    p_stop = SamplingParams(num_samples=6, max_tokens=40, top_k=0, stop_token_ids=[], stop=stops)
    prompts, ids = [[1, 2, 3], [97, 98]], ["a", "b"]
    free = Engine(model, tok).generate(prompts, p_free, prompt_ids=ids)
    cut = Engine(model, tok).generate(prompts, p_stop, prompt_ids=ids)
    stopped = 0
    for row_f, row_c in zip(free, cut):
        for f, c in zip(row_f, row_c):
            ends, data = [], b""
            for t in f.tokens:
                data += tok.decode_token_bytes(t)
                ends.append(len(data))
            hits = [(data.find(x.encode()) + len(x.encode()), x) for x in stops if x.encode() in data]
            if hits:
                end, which = min(hits)
                n = next(i + 1 for i, e in enumerate(ends) if e >= end)
                assert (c.finish_reason, c.stop_reason) == ("stop", which)
            else:
                n = len(f.tokens)
                assert c.finish_reason == "length"
            # (ToyLM's F.linear is not batch-invariant: logprobs agree to float tolerance only)
            assert c.tokens == f.tokens[:n] and c.logprobs == pytest.approx(f.logprobs[:n], abs=1e-4)
            stopped += bool(hits)
    assert stopped >= 6


def test_stop_token_logprob_is_the_full_forwards():
    """A sample that ends on a stop token keeps it: mask 1, and its raw logprob equals
    log_softmax of a cache-free full forward at that position."""
    tok = ByteTokenizer()
    model = ToyLM(seed=2).eval()
    stop_ids = list(range(100, 140))
    res = Engine(model, tok).generate([[5, 6, 7], [8]], SamplingParams(num_samples=8, max_tokens=30, top_k=0,
                                                                        stop_token_ids=stop_ids))
    ended = 0
    for prompt, row in zip([[5, 6, 7], [8]], res):
        for s in row:
            if s.finish_reason != "stop":
                continue
            ended += 1
            assert s.tokens[-1] in stop_ids and s.stop_reason == s.tokens[-1] and s.mask[-1] == 1
            lp = torch.log_softmax(model(torch.tensor([prompt + s.tokens]))[0], -1)
            assert abs(lp[len(prompt) + len(s.tokens) - 2, s.tokens[-1]].item() - s.logprobs[-1]) < 1e-4
    assert ended >= 8


def test_stop_string_without_utf8_encoding_is_refused():
    """Stop strings are matched on UTF-8 bytes: one holding a lone surrogate (JSON's "\\ud83d",
    half of an emoji's escape) has none, and is refused by name where the parameters are
    checked (an OpenAI batch line, a row's params, a job's sampling: a 400 line or an error
    row), instead of failing the engine's step for the whole batch."""
    from engine.params import check_sampling_value

    with pytest.raises(ValueError, match="lone surrogate"):
        SamplingParams(max_tokens=5, stop=["ok", "\ud83d"])
    with pytest.raises(ValueError, match="lone surrogate"):
        check_sampling_value("stop", "\ud83d\ude00x\udc00")
    assert check_sampling_value("stop", "\U0001F600") == ("\U0001F600",)


def special_run(tok, text, stop, skip, prompt="Q:"):
    """`text` scripted after `prompt` (special tokens spelled in it become them), greedy, no stop
    tokens; returns (sample, text column, OpenAI chat content with special tokens skipped)."""
    from types import SimpleNamespace

    from jobs.outputs.batch_responses import sample_columns
    import json

    p, gen = tok.encode(prompt), tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=len(gen), stop=stop, stop_token_ids=[], skip_special_tokens=skip)
    s = Engine(ScriptedLM(p + gen, tok.vocab_size), tok).generate([p], params)[0][0]
    assert s.tokens == gen[:len(s.tokens)]
    col = completion_text(tok, s.tokens, s.stop_reason)
    req = SimpleNamespace(passthrough={"_kind": "chat", "_skip_special": True})
    content = json.loads(sample_columns(req, s, col, tok)["choice"])["message"]["content"]
    return s, col, content


def test_stop_strings_and_special_tokens(tok):
    """Stop strings are matched on the text vLLM matches them on. By default on the sampled
    text with special tokens' text, as the `text` column shows it (vLLM with
    skip_special_tokens false): "<|im_start|>", or "im" inside it, ends a sample at a sampled
    <|im_start|>. With skip_special_tokens (vLLM's default, the OpenAI content: vLLM's
    detokenizer leaves special tokens out of the text it checks) a special token's text matches
    nothing, and a stop string matches across the special token: the sample ends where vLLM's
    does, and content is cut before the stop string as vLLM cuts its output text. (Before, an
    OpenAI line with stop "im" ended at <|im_start|> with content "Sure", stop_reason "im".)"""
    assert tok.special("<|im_start|>") is not None
    text = "Sure<|im_start|>user\nok time to go"
    s, col, content = special_run(tok, text, ["im"], skip=False)
    assert (s.finish_reason, s.stop_reason, tok.decode(s.tokens[-1:])) == ("stop", "im", "<|im_start|>")
    assert col == "Sure<|"
    s, col, content = special_run(tok, text, ["<|im_start|>"], skip=False)
    assert (s.stop_reason, col, content) == ("<|im_start|>", "Sure", "Sure")

    # vLLM's default: its output text is "Sureuser\nok time to go"; "im" first completes in " time"
    s, col, content = special_run(tok, text, ["im"], skip=True)
    assert (s.finish_reason, s.stop_reason, tok.decode(s.tokens[-1:])) == ("stop", "im", " time")
    assert (col, content) == ("Sure<|im_start|>user\nok t", "Sureuser\nok t")
    s, col, content = special_run(tok, text, ["<|im_start|>"], skip=True)  # vLLM: never matched
    assert (s.finish_reason, s.stop_reason, content) == ("length", None, "Sureuser\nok time to go")
    # across a special token: vLLM's text "Say Hello world" holds "Hello"
    s, col, content = special_run(tok, "Say Hel<|im_start|>lo world", ["Hello"], skip=True)
    assert (s.finish_reason, s.stop_reason, tok.decode(s.tokens[-1:])) == ("stop", "Hello", "lo")
    assert (col, content) == ("Say ", "Say ")
    s, col, content = special_run(tok, "Say Hel<|im_start|>lo world", ["Hello"], skip=False)
    assert (s.finish_reason, col) == ("length", "Say Hel<|im_start|>lo world")
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=1)
