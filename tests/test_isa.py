"""Both instruction sets on one machine: on a CPU wider than AVX2 (AVX-512, AVX-512 BF16), the
invariance and parity tests run once natively (the rest of the suite) and once more here, in
a subprocess with torch, oneDNN and batchgen's kernels limited to AVX2, so a change tested on
either kind of machine is tested for both. The subprocess also generates SmolLM2 samples
whose tokens and logprob bits must equal the native run's: the engine's arithmetic does not
depend on the instruction set (engine/kernels/csrc/gemm.cpp's header says why).

On an AVX2-only CPU there is nothing wider to limit: the tests skip, saying so.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env
from engine.kernels.native import native_isa, supported_isas

ROOT = Path(__file__).resolve().parents[1]
LIMITED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "BATCHGEN_ISA": "avx2"}
WIDER = native_isa() is not None and native_isa() != "avx2"
pytestmark = pytest.mark.skipif(not WIDER, reason=f"this CPU runs {supported_isas() or 'none of the compiled kernels'}"
                                                  ": nothing wider to limit to AVX2")

# SmolLM2 on GSM8K chat prompts: every sample's tokens and logprob bits, hashed
SAMPLES = """
import hashlib, json, struct, sys
import torch
from engine import SamplingParams, load_engine
from engine.kernels.native import native_isa
torch.set_num_threads(2)
qs = [json.loads(l)["question"] for l in open("jobs/data/gsm8k_demo.jsonl")][:6]
out = {"isa": native_isa(), "capability": torch.backends.cpu.get_cpu_capability()}
for dtype in ("float32", "bfloat16"):
    eng = load_engine("smollm2", device="cpu", dtype=dtype, max_seq_len=512, max_num_seqs=8)
    prompts = [eng.tokenizer.render_chat([{"role": "user", "content": q}]) for q in qs]
    res = eng.generate(prompts, SamplingParams(num_samples=3, max_tokens=24, temperature=1.0, top_k=50, seed=3),
                       prompt_ids=[str(i) for i in range(len(qs))])
    h = hashlib.sha256()
    for row in res:
        for s in row:
            h.update(json.dumps(s.tokens).encode() + struct.pack(f"{len(s.logprobs)}f", *s.logprobs))
    out[dtype] = h.hexdigest()
print(json.dumps(out))
"""


def run_limited(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = child_env(ROOT / "tests", **LIMITED)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_invariance_and_parity_tests_pass_limited_to_avx2():
    """`pytest -m invariance` (batch invariance of every kernel and model, the GEMM, parity
    with transformers and nanochat) with torch, oneDNN and the compiled kernels on AVX2.
    tests/test_smollm2.py (SmolLM2 against transformers, about a minute) is left to the native
    run: the next test shows SmolLM2's samples are the same bits limited to AVX2, so its parity
    limited is its parity native."""
    r = run_limited([sys.executable, "-m", "pytest", "-q", "-m", "invariance", "-p", "no:cacheprovider",
                     "-o", "addopts=", "--ignore=tests/test_smollm2.py", "tests"], timeout=1500)
    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
    assert r.returncode == 0, f"the invariance tests limited to AVX2 failed:\n{tail}"
    assert " passed" in tail and " failed" not in tail


def test_smollm2_samples_are_the_same_bits_limited_to_avx2():
    """SmolLM2, 6 GSM8K chat prompts x 3 samples x 24 tokens (top_k 50), in float32 and in
    bfloat16 (vdpbf16ps natively, two fused multiply-adds on AVX2): the same tokens and
    logprob bits natively and limited to AVX2."""
    r = run_limited([sys.executable, "-c", SAMPLES], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    limited = json.loads(r.stdout.strip().splitlines()[-1])
    assert (limited["isa"], limited["capability"]) == ("avx2", "AVX2")
    native = subprocess.run([sys.executable, "-c", SAMPLES], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=child_env())
    assert native.returncode == 0, native.stderr[-3000:]
    here = json.loads(native.stdout.strip().splitlines()[-1])
    assert here["isa"] == native_isa()
    assert (limited["float32"], limited["bfloat16"]) == (here["float32"], here["bfloat16"])
