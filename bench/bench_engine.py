"""Engine throughput against Hugging Face transformers on the same weights, in one run.

Workload (issue #2): a GPT-2-small-shaped model (124M parameters, random weights written by
transformers' save_pretrained), the first 32 GSM8K test questions as plain-text prompts,
num_samples=4, max_tokens=128, top_k=50, temperature 1, fp32 on the CPU. The baseline is
transformers' `generate(num_return_sequences=4)` on the same checkpoint and token ids.
Both count generated tokens (up to and including <|endoftext|>). The engine runs with
batch_invariant=True (the default: every sample bit-identical whatever its batch) and False
(the batched attention path GPUs use). The script also measures this machine's fp32 GEMM
peak (torch.matmul, 2048^3, the same threads) and prints each engine rate as a fraction of
the compute floor, peak / (2 x parameters) tokens/s: the rate if every parameter's
multiply-add ran at the GEMM peak and nothing else took time, and a tighter bound measured
from the default run (bench/bounds.py: its GEMMs at their measured rate plus its KV-cache
reads at the measured bandwidth, all else free), against the 5x target. Machines are noisy:
compare ratios from one run, not absolute numbers.

    python bench/bench_engine.py [--prompts 32] [--max-tokens 128] [--skip-hf] [--data ../shared/data]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

from bounds import gemm_peak, run_bound  # noqa: E402  (bench/ is the script's directory)
from machine import describe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 small has 12")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--data", type=Path, default=SHARED, help="directory with gsm8k/ and tokenizers/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())

    from transformers import GPT2Config, GPT2LMHeadModel

    from engine import SamplingParams, load_engine
    from engine.tokenizers.tiktoken_tokenizer import TiktokenTokenizer

    ranks = args.data / "tokenizers" / "gpt2.tiktoken"
    questions = args.data / "gsm8k" / "test.jsonl"
    if not ranks.exists() or not questions.exists():
        sys.exit(f"needs ../shared/data beside the checkout, or --data ({ranks}, {questions})")
    tok = TiktokenTokenizer.from_tiktoken_file(ranks)
    prompts = [tok.encode(json.loads(line)["question"]) for line in questions.open()][: args.prompts]

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=args.layers)).eval()
    tmp = tempfile.mkdtemp(prefix="bench-gpt2-")
    hf.save_pretrained(tmp)
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"model: GPT-2 shape, {args.layers} layers, {n_params / 1e6:.0f}M parameters, random weights, fp32, "
          f"{args.threads} threads")
    print(f"workload: {len(prompts)} GSM8K prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
          f"num_samples={args.num_samples}, max_tokens={args.max_tokens}, top_k={args.top_k}")
    peak = gemm_peak(args.threads)
    floor = peak / (2 * n_params)
    print(f"fp32 GEMM peak (the engine's GEMM, 2048^3, {args.threads} threads): {peak / 1e9:.1f} GFLOP/s; "
          f"compute floor peak / (2 x parameters) = {floor:.1f} tokens/s")

    eos = tok.special("<|endoftext|>")
    longest = max(map(len, prompts)) + args.max_tokens
    params = SamplingParams(num_samples=args.num_samples, max_tokens=args.max_tokens, temperature=1.0,
                            top_k=args.top_k, seed=0)
    rates, samples = {}, {}
    for invariant in (True, False):  # model.batch_invariant: the default, and the faster mode
        eng = load_engine(tmp, device="cpu", dtype="float32", tokenizer=ranks, max_seq_len=longest,
                          batch_invariant=invariant)
        eng.generate([prompts[0]], SamplingParams(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        res = eng.generate(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(s.tokens) for row in res for s in row)
        rates[invariant] = n / dt
        samples[invariant] = [s.tokens for row in res for s in row]
        print(f"batchgen engine (batch_invariant={invariant}): {n} tokens in {dt:.1f} s = {n / dt:.1f} tokens/s "
              f"= {n / dt / floor:.0%} of the compute floor")
        if invariant:  # the default mode: what could this run have done at best?
            bound = run_bound(eng.model, len(prompts) * args.num_samples, peak,
                              list(map(len, prompts)), [[len(s.tokens) for s in row] for row in res])
            print(f"  bound for this run: {bound.describe()}")
        del eng
    same = sum(a == b for a, b in zip(samples[True], samples[False]))
    print(f"  samples with identical tokens in both modes: {same} of {len(samples[True])}")
    if args.skip_hf:
        return

    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), eos)
    att = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generate() expects for decoder-only models
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    with torch.no_grad():
        hf.generate(input_ids=ids[:1], attention_mask=att[:1], max_new_tokens=4, do_sample=True, pad_token_id=eos)
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=att, do_sample=True, top_k=args.top_k, temperature=1.0,
                          max_new_tokens=args.max_tokens, num_return_sequences=args.num_samples, pad_token_id=eos)
        dt_hf = time.perf_counter() - t0
    gen = out[:, L:]
    n_hf = 0
    for row in gen.tolist():
        n_hf += row.index(eos) + 1 if eos in row else len(row)  # the stop token counts, as the engine keeps it
    print(f"transformers generate: {n_hf} tokens in {dt_hf:.1f} s = {n_hf / dt_hf:.1f} tokens/s")
    for invariant, rate in rates.items():
        print(f"ratio (batchgen batch_invariant={invariant} / transformers tokens/s): {rate / (n_hf / dt_hf):.2f}x")
    print(f"ratio the bound allows (bound / transformers tokens/s): {bound.tokens_per_s / (n_hf / dt_hf):.2f}x "
          f"(target 5x)")

if __name__ == "__main__":
    main()
