"""Where a decode step's time goes: GEMMs against everything else.

The bench_engine.py workload (a GPT-2-small-shaped model, random weights, fp32, 32 GSM8K
prompts x 4 samples, top_k 50), or with --model smollm2 bench_smollm2.py's (SmolLM2-135M,
the same questions as chat prompts; --model PATH: another checkpoint with a chat template,
such as bench/standin.py's), or with --model smollm2 --workload rl bench_rl.py's (8
GSM8K questions behind the 8-shot prefix, about 1.2k tokens each, x 16 samples, the full
vocabulary) is admitted and stepped until every sample runs (the prefill's seconds are
printed), decoded for the rest of `--warmup` steps, then `--steps` decode steps are profiled
with torch.profiler. Prints the step time, its operators grouped as GEMM (oneDNN / BLAS
matmuls), attention (the compiled kernel, or torch's flash kernel), sampling and the rest,
and the top operators outside GEMMs, and the compiled GEMMs' time by weight shape (N x K: each
call inside a range of its own while profiled). Samples ignore stop tokens, so all 128 keep
running.

    python bench/profile_step.py [--threads 2] [--steps 10] [--batch-invariant 1] [--prefix-sharing 1] [--model gpt2|smollm2|PATH]
                                 [--workload gsm8k|rl] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

from machine import describe  # noqa: E402  (bench/ is the script's directory)

GEMM = ("batchgen::gemm", "batchgen::gemm_amx", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "batchgen::decode_attention",
             "batchgen::prefill_attention")
SHAPE_RANGE = "bench::gemm "  # profile ranges around each compiled GEMM call, by weight shape
SAMPLING = ("aten::topk", "aten::sort", "aten::argmax", "aten::log_softmax", "aten::_log_softmax", "aten::logsumexp",
            "batchgen::topk", "batchgen::logsumexp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch-invariant", type=int, default=1)
    ap.add_argument("--prefix-sharing", type=int, default=1)
    ap.add_argument("--rows", type=int, default=20, help="operators to list")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--data", type=Path, default=SHARED)
    ap.add_argument("--model", default="gpt2",
                    help="gpt2: GPT-2 small shape, random weights, plain prompts; smollm2: the real model, chat "
                         "prompts; or a checkpoint with a chat template (bench/standin.py's SmolLM2, say)")
    ap.add_argument("--workload", choices=("gsm8k", "rl"), default="gsm8k",
                    help="gsm8k: 32 questions x 4 samples, top_k 50; rl: bench_rl.py's prompts x 16, full vocabulary "
                         "(--model smollm2)")
    args = ap.parse_args()
    if args.workload == "rl" and args.model == "gpt2":
        ap.error("--workload rl runs chat prompts: add --model smollm2 (or a checkpoint with a chat template)")
    torch.set_num_threads(args.threads)
    print(describe())

    from transformers import GPT2Config, GPT2LMHeadModel

    from engine import SamplingParams, load_engine
    from engine.tokenizers.tiktoken_tokenizer import TiktokenTokenizer

    questions = [json.loads(line)["question"] for line in (args.data / "gsm8k" / "test.jsonl").open()][:32]
    opts = dict(device="cpu", dtype=args.dtype, batch_invariant=bool(args.batch_invariant),
                prefix_sharing=bool(args.prefix_sharing))
    if args.model != "gpt2":
        eng = load_engine(args.model, **opts)
        prompts = [eng.tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions]
    else:
        ranks = args.data / "tokenizers" / "gpt2.tiktoken"
        tok = TiktokenTokenizer.from_tiktoken_file(ranks)
        prompts = [tok.encode(q) for q in questions]
        torch.manual_seed(0)
        tmp = tempfile.mkdtemp(prefix="profile-gpt2-")
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        eng = load_engine(tmp, tokenizer=ranks, max_seq_len=400, **opts)
    num_samples, top_k = 4, 50
    if args.workload == "rl":
        from bench_dtypes import workload  # bench/ is the script's directory

        messages, kw = workload("rl", args.data)
        prompts = [eng.tokenizer.render_chat([{"role": "user", "content": m}]) for m in messages]
        num_samples, top_k = kw["num_samples"], kw["top_k"]
    params = SamplingParams(num_samples=num_samples, max_tokens=args.warmup + 2 * args.steps + 10, temperature=1.0,
                            top_k=top_k, stop_token_ids=[])
    for i, p in enumerate(prompts):
        eng.add_request(p, params, str(i))
    total, steps = num_samples * len(prompts), 0
    t0 = time.perf_counter()
    while len(eng.running) < total and steps < args.warmup:
        eng.step()
        steps += 1
    print(f"prefill: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{time.perf_counter() - t0:.2f} s until {len(eng.running)} of {total} samples ran ({steps} steps)")
    for _ in range(args.warmup - steps):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    from torch.profiler import ProfilerActivity, profile, record_function

    from engine.kernels.library import NativeKernels

    plain_gemm = NativeKernels.gemm

    def gemm_by_shape(self, x, w, *a, **kw):  # the compiled GEMM's calls, by weight shape
        with record_function(f"{SHAPE_RANGE}{w.n} x {w.k}"):
            return plain_gemm(self, x, w, *a, **kw)

    NativeKernels.gemm = gemm_by_shape
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                eng.step()
    finally:
        NativeKernels.gemm = plain_gemm
    groups: dict[str, float] = defaultdict(float)
    others = []
    shapes = []
    total = 0.0
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total
        if ev.key.startswith(SHAPE_RANGE):  # the range itself (its kernel is counted as a GEMM)
            shapes.append((ev.cpu_time_total, ev.key[len(SHAPE_RANGE):], ev.count))
            continue  # its own time is the profiler's and the wrapper's, not the step's
        total += us
        if ev.key in GEMM:
            groups["GEMM"] += us
        elif ev.key in ATTENTION:
            groups["attention (kernel)"] += us
        elif ev.key in SAMPLING:
            groups["sampling (top-k, softmax)"] += us
        else:
            groups["other"] += us
            others.append((us, ev.key, ev.count))
    n = args.steps
    print(f"decode step, {len(eng.running)} rows, {args.threads} threads, batch_invariant={bool(args.batch_invariant)}, "
          f"prefix_sharing={bool(args.prefix_sharing)}: {step_ms:.1f} ms per step unprofiled")
    for name, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {us / n / 1e3:8.1f} ms per step  {us / total:6.1%}")
    print(f"  {'outside GEMMs':28s} {(total - groups['GEMM']) / n / 1e3:8.1f} ms per step  "
          f"{(total - groups['GEMM']) / total:6.1%}")
    print("top operators in 'other':")
    for us, key, count in sorted(others, reverse=True)[:args.rows]:
        print(f"  {key:45s} {us / n / 1e3:7.2f} ms per step  {count / n:6.0f} calls per step")
    if shapes:
        print("compiled GEMMs by weight shape (N x K; with the range's own cost, some us a call):")
        for us, key, count in sorted(shapes, reverse=True):
            print(f"  gemm {key:40s} {us / n / 1e3:7.2f} ms per step  {count / n:6.0f} calls per step")


if __name__ == "__main__":
    main()
