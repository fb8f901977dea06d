"""The real trained model end to end: SmolLM2-135M-Instruct's GGUF file (`model.path: smollm2`)
against transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, float32).

What this proves: the GGUF path as a whole (dequantized weights, llama's un-permuted Q/K, the
config from metadata, the tokenizer and ChatML template from tokenizer.ggml.*, the stop token
from the file) gives the same greedy answers as transformers on real GSM8K chat prompts, token
for token until the end-of-turn token, with logprobs within 1e-3.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import SamplingParams, load_engine
from engine.builtin import SMOLLM2_INSTALL, smollm2_path

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
    """Shape from the GGUF metadata, stop token <|im_end|> from tokenizer.ggml.eos_token_id,
    the ChatML template from tokenizer.chat_template."""
    info, tok = engine.model.info, engine.tokenizer
    assert (info.arch, info.n_layer, info.n_kv_head, info.head_dim, info.vocab_size, info.context_len) == \
        ("llama", 30, 3, 64, 49152, 8192)
    assert engine.default_stop_ids == {tok.special("<|im_end|>")} == {2}
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
