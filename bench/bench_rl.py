"""RL-rollout shape: long shared prompts, many samples each. transformers vs batchgen with
shared-prefix attention off and on, and prefix caching across prompts off and on, in one run.

Workload (issue #10): SmolLM2-135M-Instruct (`smollm2`, the GGUF file dequantized to fp32),
2 CPU threads; 8 GSM8K test questions, each behind the same 8-shot prefix of the first 8
GSM8K train problems with their worked answers (about 900 tokens), rendered with the model's
chat template; num_samples=16, max_tokens=256, temperature 1 (no top-k / top-p).
- transformers: the same GGUF file (`from_pretrained(dir, gguf_file=..., dtype=float32)`),
  `generate(num_return_sequences=16)` per prompt (16 rows of one prompt, no padding);
- batchgen with prefix_sharing=False, prefix_caching=False: every sample attends over its own
  copy of its prompt's KV (the engine before issue #10, with its memory by need);
- batchgen with prefix_sharing=True, prefix_caching=False: each prompt's KV stored once and
  read once per step for all 16 samples;
- batchgen with both on (the defaults): the 8 prompts' common 8-shot prefix is prefilled once
  and copied to the others (engine/prefix_cache.py).
All count generated tokens up to the end-of-turn token. For each engine run it prints the
rate, the most KV memory reserved at once and the reserved KV bytes per running sample
(averaged over decode steps), and at the end the ratios. Machines are noisy: compare ratios
from one run.

The engine runs in `--dtype` (float32 by default, as transformers does).

    python bench/bench_rl.py [--prompts 8] [--num-samples 16] [--max-tokens 256] [--dtype float32] [--skip-hf]
                             [--data ../shared/data]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

from machine import describe  # noqa: E402  (bench/ is the script's directory)


def few_shot_prefix(train: Path, k: int = 8) -> str:
    """The first k GSM8K train problems with their worked answers (calculator annotations
    removed, '#### n' written out), one after another."""
    shots = []
    with train.open() as f:
        for line in f:
            ex = json.loads(line)
            answer = re.sub(r"<<[^>]*>>", "", ex["answer"]).replace("#### ", "The answer is ")
            shots.append(f"Question: {ex['question']}\nAnswer: {answer}\n\n")
            if len(shots) == k:
                break
    return "".join(shots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--data", type=Path, default=SHARED, help="directory with gsm8k/train.jsonl and test.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())

    from engine import SamplingParams, load_engine
    from engine.loading.builtin import smollm2_path

    train, test = args.data / "gsm8k" / "train.jsonl", args.data / "gsm8k" / "test.jsonl"
    if not train.exists() or not test.exists():
        sys.exit(f"needs ../shared/data beside the checkout, or --data ({train}, {test})")
    prefix = few_shot_prefix(train)
    questions = [json.loads(line)["question"] for line in test.open()][: args.prompts]
    rates, kv = {}, {}
    prompts: list[list[int]] = []
    stop: list[int] = []
    for sharing, caching in ((False, False), (True, False), (True, True)):
        eng = load_engine("smollm2", device="cpu", dtype=args.dtype, prefix_sharing=sharing, prefix_caching=caching)
        if not prompts:
            tok = eng.tokenizer
            prompts = [tok.render_chat([{"role": "user", "content": f"{prefix}Question: {q}\nAnswer:"}])
                       for q in questions]
            stop = sorted(eng.default_stop_ids)
            print(f"model: {eng.model.info.description}; engine dtype {str(eng.dtype)[6:]} ({args.dtype}), "
                  f"{args.threads} threads")
            print(f"workload: {len(prompts)} GSM8K test questions behind an 8-shot prefix (prompts of "
                  f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), num_samples={args.num_samples}, "
                  f"max_tokens={args.max_tokens}, temperature 1, stop ids {stop}")
        params = SamplingParams(num_samples=args.num_samples, max_tokens=args.max_tokens, temperature=1.0, top_k=0,
                                seed=0)
        eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up (weights packed)
        eng.reset_kv_stats()
        computed = eng.num_prefill_tokens
        t0 = time.perf_counter()
        res = eng.generate(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(s.tokens) for row in res for s in row)
        key = (sharing, caching)
        rates[key] = n / dt
        kv[key] = (eng.peak_kv_bytes, eng.kv_bytes_per_running_sample())
        print(f"batchgen prefix_sharing={sharing} prefix_caching={caching}: {n} tokens in {dt:.1f} s = "
              f"{n / dt:.1f} tokens/s; prompt tokens prefilled {eng.num_prefill_tokens - computed}, copied "
              f"{eng.num_cached_prompt_tokens}; KV: peak {kv[key][0] / 2**20:.0f} MiB reserved, "
              f"{kv[key][1] / 2**20:.1f} MiB per running sample (budget {eng.kv_capacity_bytes / 2**30:.1f} GiB)")
        del eng, res
    print(f"ratio (prefix_sharing on / off tokens/s): {rates[True, False] / rates[False, False]:.2f}x; "
          f"(prefix_caching on / off, sharing on): {rates[True, True] / rates[True, False]:.2f}x")
    if args.skip_hf:
        return

    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    pad = stop[0]
    n_hf, dt_hf = 0, 0.0
    with torch.no_grad():
        hf.generate(input_ids=torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=True, pad_token_id=pad)
        for p in prompts:  # one prompt's 16 rows per call: no padding
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                              num_return_sequences=args.num_samples, pad_token_id=pad, eos_token_id=stop)
            dt_hf += time.perf_counter() - t0
            for row in out[:, len(p):].tolist():
                ends = [row.index(s) for s in stop if s in row]
                n_hf += min(ends) if ends else len(row)
    rate_hf = n_hf / dt_hf
    print(f"transformers generate(num_return_sequences={args.num_samples}): {n_hf} tokens in {dt_hf:.1f} s = "
          f"{rate_hf:.1f} tokens/s")
    for (sharing, caching), rate in rates.items():
        print(f"ratio (batchgen prefix_sharing={sharing} prefix_caching={caching} / transformers tokens/s): "
              f"{rate / rate_hf:.2f}x")


if __name__ == "__main__":
    main()
