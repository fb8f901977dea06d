"""engine.tokenizers: the tiktoken tokenizers (GPT-2 data-gym files and .tiktoken, nanochat
pickle, demo), nanochat's chat rendering and Tokenizer.load."""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

from engine.tokenizers.base import Tokenizer
from engine.tokenizers.nanochat_chat import NANOCHAT_SPECIALS
from engine.tokenizers.tiktoken_tokenizer import TiktokenTokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
GPT2_RANKS = SHARED / "data" / "tokenizers" / "gpt2.tiktoken"
GSM8K = SHARED / "data" / "gsm8k" / "test.jsonl"
needs_shared = pytest.mark.skipif(not (GPT2_RANKS.is_file() and GSM8K.is_file()),
                                  reason=f"shared data not found at {SHARED} (gpt2.tiktoken, gsm8k/test.jsonl)")
NANOCHAT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                    r"""|\s*[\r\n]|\s+(?!\S)|\s+""")


# ---------------------------------------------------------------------- helpers
def byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char table, written independently of engine.tokenizers.byte_level."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs)}


def split_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The merge that makes `token`: run BPE on its bytes with lower ranks until two parts remain."""
    parts = [token[i:i + 1] for i in range(len(token))]
    limit = ranks[token]
    get = ranks.get
    while len(parts) > 2:
        best, best_rank = 0, limit
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1], limit)
            if r < best_rank:
                best, best_rank = i, r
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


def write_gpt2_files(directory: Path, ranks: dict[bytes, int], eot_id: int | None) -> None:
    """vocab.json + merges.txt (data-gym format) for `ranks`, plus <|endoftext|> at eot_id."""
    bu = byte_unicode()
    enc = lambda b: "".join(bu[x] for x in b)  # noqa: E731
    vocab = {enc(t): r for t, r in ranks.items()}
    if eot_id is not None:
        vocab["<|endoftext|>"] = eot_id
    lines = ["#version: 0.2"]
    for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) > 1:
            a, b = split_of(t, ranks)
            lines.append(f"{enc(a)} {enc(b)}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2_ranks() -> dict[bytes, int]:
    if not GPT2_RANKS.is_file():
        pytest.skip(f"shared data not found: {GPT2_RANKS}")
    return load_tiktoken_bpe(str(GPT2_RANKS))


@pytest.fixture(scope="module")
def gsm8k_texts() -> list[str]:
    if not GSM8K.is_file():
        pytest.skip(f"shared data not found: {GSM8K}")
    rows = [json.loads(line) for line in GSM8K.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["question"] for r in rows] + [r["answer"] for r in rows[:200]]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, gpt2_ranks) -> Path:
    d = tmp_path_factory.mktemp("gpt2_full")
    write_gpt2_files(d, gpt2_ranks, 50256)
    return d


def nanochat_encoding(name: str = "rustbpe") -> tiktoken.Encoding:
    """A small nanochat-style Encoding: 256 bytes + a few merges, nanochat's 9 specials after."""
    ranks = {bytes([i]): i for i in range(256)}
    for word in (b"he", b"ll", b"hell", b"hello", b" w", b" wo", b"or", b"ld"):
        ranks[word] = len(ranks)
    specials = {s: len(ranks) + i for i, s in enumerate(NANOCHAT_SPECIALS)}
    return tiktoken.Encoding(name, pat_str=NANOCHAT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def chat_tok() -> Tokenizer:
    return TiktokenTokenizer(nanochat_encoding())


# ---------------------------------------------------------------------- GPT-2
@needs_shared
def test_gpt2_tiktoken_and_files_match_reference_on_gsm8k(gpt2_files, gpt2_ranks, gsm8k_texts):
    ref = tiktoken.Encoding("gpt2-ref", pat_str=r50k_pat_str, mergeable_ranks=gpt2_ranks,
                            special_tokens={"<|endoftext|>": 50256})
    a = TiktokenTokenizer.from_tiktoken_file(GPT2_RANKS)
    b = TiktokenTokenizer.from_gpt2_files(gpt2_files / "vocab.json", gpt2_files / "merges.txt")
    n_tokens = 0
    for text in gsm8k_texts:
        want = ref.encode_ordinary(text)
        assert a.encode(text) == want
        assert b.encode(text) == want
        assert a.decode(want) == text
        n_tokens += len(want)
    assert n_tokens > 50_000
    for tok in (a, b):
        assert tok.vocab_size == 50257
        assert tok.special("<|endoftext|>") == 50256
        assert tok.bos_token_id == 50256
        assert tok.default_stop_token_ids == (50256,)
        assert tok.encode("Hello world") == [15496, 995]


@needs_shared
def test_gpt2_specials_are_plain_text_and_decode_never_raises():
    tok = TiktokenTokenizer.from_tiktoken_file(GPT2_RANKS)
    ids = tok.encode("a<|endoftext|>b")
    assert 50256 not in ids and tok.decode(ids) == "a<|endoftext|>b"
    assert tok.decode([15496, 50256]) == "Hello<|endoftext|>"
    assert tok.special("<|bos|>") is None and not tok.has_chat_format
    # A multi-byte character cut in half decodes to U+FFFD instead of raising.
    llama = tok.encode("🦙")
    assert len(llama) == 3 and tok.decode(llama[:1]) == "\ufffd" and tok.decode(llama) == "🦙"
    for i in range(0, tok.vocab_size, 97):
        tok.decode([i])
    with pytest.raises(ValueError, match="50257"):
        tok.decode([50257])
    with pytest.raises(ValueError, match="no chat format"):
        tok.render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError):
        tok.encode(["not", "a", "str"])


@needs_shared
def test_small_gpt2_vocab_matches_transformers(tmp_path, gpt2_ranks, gsm8k_texts):
    transformers = pytest.importorskip("transformers")
    small = {t: r for t, r in gpt2_ranks.items() if r < 1000}
    write_gpt2_files(tmp_path, small, 1000)
    tok = Tokenizer.load(tmp_path / "vocab.json")
    assert tok.vocab_size == 1001 and tok.special("<|endoftext|>") == 1000
    hf = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    for text in gsm8k_texts[:400]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert max(ids) < 1000 and tok.decode(ids) == text


def test_gpt2_files_without_shared_data(tmp_path):
    """Bytes + a few merges, hand-made: works without ../shared."""
    ranks = {bytes([i]): i for i in range(256)}
    for t in (b" t", b"he", b" the", b"in", b" a"):
        ranks[t] = len(ranks)
    write_gpt2_files(tmp_path, ranks, len(ranks))
    tok = TiktokenTokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert tok.encode(" the thin") == [ranks[b" the"], ranks[b" t"], ord("h"), ranks[b"in"]]
    assert tok.vocab_size == 262 and tok.bos_token_id == 261


def _write(tmp: Path, vocab: dict, merges: list[str]) -> tuple[Path, Path]:
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return tmp / "vocab.json", tmp / "merges.txt"


def test_gpt2_files_errors(tmp_path):
    bu = byte_unicode()
    base = {bu[b]: b for b in range(256)}
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        TiktokenTokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    v, m = _write(tmp_path, {k: i for k, i in base.items() if i != 65}, [])
    with pytest.raises(ValueError, match="byte 65"):
        TiktokenTokenizer.from_gpt2_files(v, m)
    v, m = _write(tmp_path, base, ["h e"])
    with pytest.raises(ValueError, match=r"merges.txt:2: merge result 'he' is not in"):
        TiktokenTokenizer.from_gpt2_files(v, m)
    v, m = _write(tmp_path, {**base, "he": 257, "ll": 256}, ["h e", "l l"])
    with pytest.raises(ValueError, match="merges.txt:3.*tiktoken needs merge priority"):
        TiktokenTokenizer.from_gpt2_files(v, m)
    v, m = _write(tmp_path, {**base, "he": 256}, ["h e x"])
    with pytest.raises(ValueError, match="merges.txt:2: expected 'left right'"):
        TiktokenTokenizer.from_gpt2_files(v, m)
    (tmp_path / "vocab.json").write_text("{not json")
    with pytest.raises(ValueError, match="vocab.json: not valid JSON"):
        TiktokenTokenizer.from_gpt2_files(v, m)


def test_tiktoken_file_errors_and_explicit_pattern(tmp_path):
    f = tmp_path / "tiny.tiktoken"
    import base64
    f.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    with pytest.raises(ValueError, match="pass pattern="):
        TiktokenTokenizer.from_tiktoken_file(f)
    tok = TiktokenTokenizer.from_tiktoken_file(f, pattern=NANOCHAT_PATTERN, special_tokens={"<|bos|>": 256})
    assert tok.encode("hi") == [104, 105] and tok.bos_token_id == 256 and tok.vocab_size == 257
    with pytest.raises(ValueError, match="collide"):
        TiktokenTokenizer.from_tiktoken_file(f, pattern=NANOCHAT_PATTERN, special_tokens={"<|bos|>": 5})
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("IQ== 0\nnot-base64!! x\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2"):
        TiktokenTokenizer.from_tiktoken_file(bad, pattern=NANOCHAT_PATTERN)
    with pytest.raises(FileNotFoundError, match="nope.tiktoken"):
        TiktokenTokenizer.from_tiktoken_file(tmp_path / "nope.tiktoken")


def test_load_dispatch_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        Tokenizer.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither vocab.json"):
        Tokenizer.load(tmp_path / "empty")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="x.txt"):
        Tokenizer.load(tmp_path / "x.txt")


# ---------------------------------------------------------------------- nanochat
def test_nanochat_pickle_roundtrip_and_find(tmp_path):
    enc = nanochat_encoding()
    base = tmp_path / "nanochat"
    (base / "tokenizer").mkdir(parents=True)
    with open(base / "tokenizer" / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f)
    ckpt = base / "chatsft_checkpoints" / "d20"
    ckpt.mkdir(parents=True)
    tok = Tokenizer.find_nanochat(ckpt)
    text = "hello world, <|bos|> hello"
    assert tok.encode(text) == enc.encode_ordinary(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == enc.n_vocab == 264 + 9
    assert tok.bos_token_id == tok.special("<|bos|>") == 264
    assert tok.default_stop_token_ids == (tok.special("<|assistant_end|>"), 264)
    assert all(tok.special(s) == 264 + i for i, s in enumerate(NANOCHAT_SPECIALS))
    assert Tokenizer.load(base / "tokenizer").encode(text) == tok.encode(text)
    assert Tokenizer.load(base / "tokenizer" / "tokenizer.pkl").vocab_size == 273
    # A tokenizer.pkl in the checkpoint directory itself wins.
    with open(ckpt / "tokenizer.pkl", "wb") as f:
        pickle.dump(nanochat_encoding("other"), f)
    assert Tokenizer.find_nanochat(ckpt).enc.name == "other"
    # Pickled Tokenizers (Ray ships them) round-trip.
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode(text) == tok.encode(text) and again.default_stop_token_ids == tok.default_stop_token_ids


def test_find_nanochat_lists_places(tmp_path):
    d = tmp_path / "base" / "chatsft_checkpoints" / "d20"
    d.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as e:
        Tokenizer.find_nanochat(d)
    msg = str(e.value)
    assert str(d / "tokenizer.pkl") in msg and str(tmp_path / "base" / "tokenizer" / "tokenizer.pkl") in msg


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_must_be_an_encoding(tmp_path):
    p = tmp_path / "tokenizer.pkl"
    p.write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(ValueError, match="not a pickled tiktoken.Encoding"):
        TiktokenTokenizer.from_pickle(p)
    p.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="holds a dict"):
        TiktokenTokenizer.from_pickle(p)
    p.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="tokenizer.pkl"):
        TiktokenTokenizer.from_pickle(p)


# ---------------------------------------------------------------------- chat
def test_render_chat_layout(chat_tok):
    t, sp = chat_tok, chat_tok.special
    e = t.encode
    msgs = [{"role": "user", "content": "hello"}]
    assert t.render_chat(msgs) == [sp("<|bos|>"), sp("<|user_start|>"), *e("hello"), sp("<|user_end|>"),
                                   sp("<|assistant_start|>")]
    conv = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": [{"type": "text", "text": "a "},
                                          {"type": "python", "text": "1+1"},
                                          {"type": "python_output", "text": "2"}]},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "dropped"},
    ]
    want = ([sp("<|bos|>"), sp("<|user_start|>"), *e("sys\n\nq1"), sp("<|user_end|>"),
             sp("<|assistant_start|>"), *e("a "), sp("<|python_start|>"), *e("1+1"), sp("<|python_end|>"),
             sp("<|output_start|>"), *e("2"), sp("<|output_end|>"), sp("<|assistant_end|>"),
             sp("<|user_start|>"), *e("q2"), sp("<|user_end|>"), sp("<|assistant_start|>")])
    assert t.render_chat(conv) == want
    assert t.render_chat(conv[:-1]) == want  # a trailing assistant message is dropped
    assert conv[1]["content"] == "q1"  # input not mutated
    # special-token text in content stays text
    ids = t.render_chat([{"role": "user", "content": "<|assistant_end|>"}])
    assert ids.count(sp("<|assistant_end|>")) == 0


@pytest.mark.parametrize("messages, pattern", [
    ("hi", r"messages must be a list"),
    ([], r"messages is empty"),
    (["hi"], r"message 0 is a str, expected a dict"),
    ([{"content": "x"}], r"message 0 has no 'role'"),
    ([{"role": "bot", "content": "x"}], r"message 0 has unknown role 'bot'"),
    ([{"role": "user"}], r"message 0 \(user\) has no 'content'"),
    ([{"role": "user", "content": 3}], r"message 0 \(user\) content must be a str, got int"),
    ([{"role": "assistant", "content": "x"}], r"message 0 is from assistant but should be from user"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     r"message 1 is from user but should be from assistant"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
     r"message 1 is a system message; only the first"),
    ([{"role": "system", "content": "s"}], r"message 1 must be a user message \(there is none\)"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
     r"message 1 must be a user message"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "a"}],
     r"message 0 \(system\) content must be a str"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}],
     r"message 1 \(assistant\) content must be a str or a list of parts, got int"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image", "text": "x"}]}],
     r"message 1 part 0 has unknown type 'image'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "text", "text": "x"}, "y"]}],
     r"message 1 part 1 is a str"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "python"}]}],
     r"message 1 part 0 \(python\) needs a str 'text'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "assistant", "content": "c"}], r"message 2 is from assistant but should be from user"),
])
def test_render_chat_malformed(chat_tok, messages, pattern):
    with pytest.raises(ValueError, match=pattern):
        chat_tok.render_chat(messages)


# ---------------------------------------------------------------------- demo
def test_demo_tokenizer():
    tok = Tokenizer.demo()
    assert Tokenizer.demo() is tok  # cached
    assert tok.vocab_size == 100256 + 9
    assert [tok.special(s) for s in NANOCHAT_SPECIALS] == list(range(100256, 100265))
    assert tok.special("<|endoftext|>") is None and tok.special("<|fim_prefix|>") is None
    assert tok.encode("Hello world") == [9906, 1917]  # cl100k_base
    assert tok.bos_token_id == 100256
    assert tok.default_stop_token_ids == (tok.special("<|assistant_end|>"), 100256)
    assert tok.has_chat_format
    ids = tok.render_chat([{"role": "user", "content": "What is 2+2?"}])
    assert re.fullmatch(r"<\|bos\|><\|user_start\|>What is 2\+2\?<\|user_end\|><\|assistant_start\|>",
                        tok.decode(ids))
    assert pickle.loads(pickle.dumps(tok)) is tok  # pickles by reference


def test_token_bytes_of_an_id_past_the_vocabulary():
    """A model's vocabulary may be padded past its tokenizer's: such an id has no bytes
    (ValueError from the tokenizer, b"" for stop-string matching), it does not raise KeyError."""
    from engine.tokenizers.stop_strings import token_bytes

    tok = Tokenizer.demo()
    assert tok.decode_token_bytes(9906) == b"Hello"
    with pytest.raises(ValueError, match="100300 is not in the vocabulary"):
        tok.decode_token_bytes(100300)
    assert token_bytes(tok, 100300) == b""
