"""The real trained model end to end: SmolLM2-135M-Instruct's GGUF file (`model.path: smollm2`)
against transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, float32).

What this proves: the GGUF path as a whole (dequantized weights, llama's un-permuted Q/K, the
config from metadata, the tokenizer and ChatML template from tokenizer.ggml.*, the stop token
from the file) gives the same greedy answers as transformers on real GSM8K chat prompts, token
for token until the end-of-turn token, with logprobs within 1e-3.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from engine import SamplingParams, load_engine
from engine.scoring import teacher_forced_logits
from engine.kernels.native import native_kernels
from engine.loading.builtin import SMOLLM2_INSTALL, smollm2_path

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py

try:
    GGUF = smollm2_path()
except FileNotFoundError:  # pragma: no cover - `make install` installs it
    pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_INSTALL})", allow_module_level=True)

QUESTIONS = Path(__file__).resolve().parents[1] / "jobs" / "data" / "gsm8k_demo.jsonl"
N_PROMPTS, MAX_TOKENS = 8, 256


@pytest.fixture(scope="module")
def engine():
    return load_engine("smollm2", device="cpu", dtype="float32", max_seq_len=1024)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model):
    return smollm2_hf_model


@pytest.fixture(scope="module")
def prompts(engine):
    questions = [json.loads(line)["question"] for line in QUESTIONS.open()][:N_PROMPTS]
    return [engine.tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions]


def test_model_and_tokenizer_come_from_the_file(engine):
    """Shape from the GGUF metadata; stop tokens llama.cpp's end-of-generation set
    (src/llama-vocab.cpp, llama_vocab::impl::load): <|im_end|> from tokenizer.ggml.eos_token_id,
    <|endoftext|> by its text, <reponame> as the FIM repo token; the ChatML template from
    tokenizer.chat_template."""
    info, tok = engine.model.info, engine.tokenizer
    assert (info.arch, info.n_layer, info.n_kv_head, info.head_dim, info.vocab_size, info.context_len) == \
        ("llama", 30, 3, 64, 49152, 8192)
    stops = {tok.special(t) for t in ("<|im_end|>", "<|endoftext|>", "<reponame>")}
    assert engine.default_stop_ids == stops == {2, 0, 4}
    assert tok.eos_token_id == 2 and tok.default_stop_token_ids == (2, 0, 4)
    ids = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_gsm8k_answers_equal_transformers(engine, hf_model, prompts):
    """8 GSM8K chat prompts, greedy until <|im_end|>: at every position of every answer,
    transformers' argmax over the same prefix (one full forward of prompt + answer on the same
    file) is the engine's token, so transformers' greedy decoding gives the same answer token
    for token, and it ends where the engine's does (on <|im_end|>, kept, or at max_tokens).
    Each token's logprob equals transformers' log-softmax within 1e-3. For the prompt with the
    shortest answer, transformers' own generate() is run too and gives the same tokens."""
    res = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    eos = 2
    worst = 0.0
    for p, row in zip(prompts, res):
        s = row[0]
        with torch.no_grad():
            logits = hf_model(torch.tensor([p + s.tokens])).logits[0, len(p) - 1:].float()  # (n + 1, V)
        hf_greedy = logits.argmax(-1).tolist()
        assert s.tokens == hf_greedy[:len(s.tokens)], engine.tokenizer.decode(s.tokens)
        if s.finish_reason == "stop":
            assert s.tokens[-1] == eos and s.stop_reason == eos and eos not in s.tokens[:-1]
        else:
            assert s.finish_reason == "length" and len(s.tokens) == MAX_TOKENS and eos not in s.tokens
        lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s.tokens)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(s.logprobs) - lp).abs().max().item())
    assert worst <= 1e-3, worst
    assert sum(r[0].finish_reason == "stop" for r in res) >= N_PROMPTS // 2  # real answers end on their own
    i = min(range(len(res)), key=lambda j: len(res[j][0].tokens))  # generate() costs ~55 ms a token
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)
    assert out[0, len(prompts[i]):].tolist() == res[i][0].tokens


@pytest.fixture(scope="module")
def gold(engine):
    """(prompt tokens, gold answer tokens) of the 8 questions: GSM8K's worked answers with
    their calculator annotations removed, for teacher forcing."""
    rows = [json.loads(line) for line in QUESTIONS.open()][:N_PROMPTS]
    tok = engine.tokenizer
    return [(tok.render_chat([{"role": "user", "content": r["question"]}]),
             tok.encode(re.sub(r"<<[^>]*>>", "", r["answer"]))) for r in rows]


def test_bfloat16_agrees_with_float32_at_least_as_well_as_transformers_bfloat16(engine, hf_model, gold):
    """Teacher-forced over the gold answers of 8 GSM8K questions (697 positions): the
    next-token argmax and the gold token's logprob of batchgen in bfloat16 (bfloat16
    weights and KV cache, float32 activations; its step's own kernels, `teacher_forced_logits`)
    against transformers in float32, compared with transformers' own bfloat16 (the whole
    model in bfloat16) against float32: batchgen's agreement is no worse and its logprob
    error no larger. batchgen in float32 agrees with transformers in float32 everywhere."""
    if native_kernels() is None:
        pytest.skip("bfloat16 weights with float32 activations need the compiled kernels")
    ours16 = load_engine("smollm2", device="cpu", dtype="bfloat16", max_seq_len=1024).model
    hf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    stats = {name: [0, 0, 0.0] for name in ("ours32", "ours16", "hf16")}  # argmax agreements, positions, sum |dlp|
    for prompt, answer in gold:
        seq, n = prompt + answer, len(answer)
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq])).logits[0, len(prompt) - 1:-1].float()
            logits = {"ours32": teacher_forced_logits(engine.model, seq)[len(prompt) - 1:-1],
                      "ours16": teacher_forced_logits(ours16, seq)[len(prompt) - 1:-1],
                      "hf16": hf16(torch.tensor([seq])).logits[0, len(prompt) - 1:-1].float()}
        target = torch.tensor(answer)[:, None]
        want = torch.log_softmax(ref, -1).gather(1, target)[:, 0]
        for name, lg in logits.items():
            s = stats[name]
            s[0] += int((lg.argmax(-1) == ref.argmax(-1)).sum())
            s[1] += n
            s[2] += float((torch.log_softmax(lg, -1).gather(1, target)[:, 0] - want).abs().sum())
    agree = {k: a / n for k, (a, n, _) in stats.items()}
    err = {k: e / n for k, (_, n, e) in stats.items()}
    print(f"argmax agreement with transformers float32: {agree}; mean |logprob difference|: {err}")
    assert agree["ours32"] == 1.0 and err["ours32"] < 1e-5
    assert agree["ours16"] >= agree["hf16"] and err["ours16"] <= err["hf16"]
