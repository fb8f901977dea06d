"""Seeded samples pinned across machines and versions: the tokens and logprob bits of fixed runs
are hashed and compared with the hashes this file holds.

What this proves: a seeded run's samples are a function of the model, the prompts and the
parameters alone. Batch invariance (tests/test_engine_models.py, tests/test_kv_memory.py)
holds the batch fixed against itself on one machine, and tests/test_isa.py compares AVX2 with
AVX-512 on one machine; this holds every machine and every version to the same bits. Each CPU
build computes the same sequence of rounded operations (engine/kernels/csrc/gemm.cpp's header,
docs/cpus.md), so the pins were the same on every CPU measured: the AVX2 build on an AMD EPYC
(2026-11-27) made them, and the suite runs this file on every machine it meets (on an AVX-512
one, again limited to AVX2: it is marked `invariance`). An RL user re-running a seeded job a
month later on another cloud's CPU gets the rows they trained on.

A change that moves a bit (a kernel's order of operations, the sampler's noise, the tokenizer)
fails here. If the change is meant, pin the new hashes and say in docs/cpus.md that runs of
earlier versions no longer reproduce bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from engine import SamplingParams, load_engine
from engine.kernels.native import native_kernels
from engine.loading.builtin import SMOLLM2_INSTALL, smollm2_path

pytestmark = [pytest.mark.invariance,
              pytest.mark.skipif(native_kernels() is None, reason="the compiled kernels are unavailable here: "
                                                                  "torch's operations are not pinned")]
QUESTIONS = Path(__file__).resolve().parents[1] / "jobs" / "data" / "gsm8k_demo.jsonl"

# sha256 of every sample's tokens (JSON) and logprobs (float32 bits), in order
PINNED = {
    ("tiny-random", "float32"): "a7de0f0c67d21d04a144c7e1dca60294b07a168e341e92cc7eb0a52f0c94dbba",
    ("tiny-random", "bfloat16"): "3a0b72526629f25dc4f79270e19b779aa7db96e13a8bf5db1266a95c7e5d5c83",
    # tests/test_isa.py's SmolLM2 run (its native and limited hashes must equal these)
    ("smollm2", "float32"): "eccf01b9516d34656deb6dc617d49ee1a576a4d9889a0691db2068cf249a9a1f",
    ("smollm2", "bfloat16"): "d39dd493d631ee74ac8ab5a56499674e5fc94d0ce83f1e22c17576cf98c6d15e",
}


def samples_hash(results) -> str:
    """sha256 over each sample, in order: its tokens as JSON, then its logprobs' float32 bits."""
    h = hashlib.sha256()
    for row in results:
        for s in row:
            h.update(json.dumps(s.tokens).encode() + struct.pack(f"{len(s.logprobs)}f", *s.logprobs))
    return h.hexdigest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_random_samples_are_pinned(dtype):
    """tiny-random (a 4-layer nanochat model of deterministic random weights): 3 prompts x 3
    samples x 24 tokens, top_k 50, on 1 and 2 threads."""
    eng = load_engine("tiny-random", device="cpu", dtype=dtype, max_seq_len=256)
    params = SamplingParams(num_samples=3, max_tokens=24, temperature=1.0, top_k=50, seed=7, stop_token_ids=[])
    prompts = [[5, 6, 7, 8, 9], [3] * 40, list(range(40, 90))]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = samples_hash(eng.generate(prompts, params, prompt_ids=["a", "b", "c"]))
            assert got == PINNED[("tiny-random", dtype)], (n, got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_samples_are_pinned(dtype):
    """SmolLM2-135M-Instruct (the GGUF file), tests/test_isa.py's run: 6 GSM8K chat prompts x 3
    samples x 24 tokens, top_k 50, at most 8 sequences at a time."""
    try:
        smollm2_path()
    except FileNotFoundError:  # pragma: no cover - `make install` installs it
        pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_INSTALL})")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = load_engine("smollm2", device="cpu", dtype=dtype, max_seq_len=512, max_num_seqs=8)
        questions = [json.loads(line)["question"] for line in QUESTIONS.open()][:6]
        prompts = [eng.tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions]
        res = eng.generate(prompts, SamplingParams(num_samples=3, max_tokens=24, temperature=1.0, top_k=50, seed=3),
                           prompt_ids=[str(i) for i in range(len(questions))])
    finally:
        torch.set_num_threads(threads)
    assert samples_hash(res) == PINNED[("smollm2", dtype)]
