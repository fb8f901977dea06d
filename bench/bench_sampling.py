"""The sampler alone: engine/sampling.py's cost per decode step for each kind of row, in one run.

Workload: random logits (B, V) scaled like an LM's (N(0, 3^2)), temperature 0.7, V = 49152
(SmolLM2's vocabulary). Kinds: top_k=50 with top_p 0.95 (the demo), plain (top_k off,
top_p 1: OpenAI's defaults), top_p 0.9 without top_k (a full sort). Prints the best of 3
for tokens only and with processed logprobs. Random logits are flatter than a trained
model's, so top_p keeps far more candidates here than in real use: the numbers bound the
real cost from above. Machines are noisy: compare the rows of one run.
Last, a whole engine step (sample_step, plain rows at temperature 0.7) with every row asking
top_logprobs 0, 5 and 20 (raw and processed logprobs): the cost of the top entries.

    python bench/bench_sampling.py [--batch 256] [--vocab 49152] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.sampling import request_key, row_kinds, sample_step, sample_with_logprobs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from machine import describe

    print(describe())
    B, V = args.batch, args.vocab
    lg = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3
    keys = torch.tensor([request_key(0, str(i), 0) for i in range(B)], dtype=torch.long)
    for name, top_k, top_p in [("top_k=50 top_p=0.95", 50, 0.95), ("plain", 0, 1.0), ("top_p=0.9", 0, 0.9)]:
        a = (lg, torch.full((B,), 0.7), torch.full((B,), top_k, dtype=torch.long), torch.full((B,), top_p),
             torch.zeros(B), keys, torch.full((B,), 5, dtype=torch.long))
        times = {False: [], True: []}
        for _ in range(3):
            for processed in (False, True):
                t = time.perf_counter()
                sample_with_logprobs(*a, processed=processed)
                times[processed].append(time.perf_counter() - t)
        print(f"B={B} V={V} {name:20s} tokens {min(times[False]) * 1e3:8.1f} ms   "
              f"+ processed logprobs {min(times[True]) * 1e3:8.1f} ms")
    a = (torch.full((B,), 0.7), torch.zeros(B, dtype=torch.long), torch.ones(B), torch.zeros(B), keys,
         torch.full((B,), 5, dtype=torch.long))
    kinds = row_kinds(*a[:4])
    for mode in (False, True):
        for k in (0, 5, 20):
            best = []
            for _ in range(5):
                x = lg.clone()  # sample_step overwrites its logits
                t = time.perf_counter()
                sample_step(x, *a, kinds, [mode] * B, top=[k] * B if k else None)
                best.append(time.perf_counter() - t)
            print(f"B={B} V={V} sample_step {'processed' if mode else 'raw':9s} top_logprobs={k:2d} "
                  f"{min(best) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
