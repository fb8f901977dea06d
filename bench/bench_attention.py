"""The compiled decode attention kernel alone (engine/kernels/csrc/decode_attention.cpp), one
layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64), float32 and bfloat16 KV.

Shapes: `rl`, bench_rl.py's step: 8 prompts of 1,200 tokens x 16 samples, each sample 128
tokens into its own run (the prompt's keys shared by its 16 samples); `smollm2`,
bench_smollm2.py's: 32 prompts of 100 tokens x 4 samples, 64 generated tokens each. Random
keys, values and queries. Prints the best of --reps calls per shape and dtype. Compare
versions by running this for each in alternation (the machines are noisy): a change of the
kernel's source builds a new library, so `git stash` switches between them.

    python bench/bench_attention.py [--threads 1] [--reps 15]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels.native import native_kernels  # noqa: E402
from machine import describe  # noqa: E402  (bench/ is the script's directory)

SHAPES = {"rl": (8, 16, 1200, 128), "smollm2": (32, 4, 100, 64)}  # prompts, samples, prompt tokens, own tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())
    kernels = native_kernels()
    if kernels is None:
        sys.exit("the compiled kernels are unavailable here")
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D = 9, 3, 64
    for name, (groups, rows, plen, own) in SHAPES.items():
        for dt in (torch.float32, torch.bfloat16):
            B = groups * rows
            P = groups * plen + B * own
            kc = torch.randn(P, Hkv, D, generator=g).to(dt)
            vc = torch.randn(P, Hkv, D, generator=g).to(dt)
            seg, order, ptr = [], [], [0]
            pos = groups * plen
            for gi in range(groups):
                for _ in range(rows):
                    seg.append([gi * plen, plen, pos, own])
                    pos += own
                    order.append(len(seg) - 1)
                ptr.append(len(order))
            q = torch.randn(B, Hq, D, generator=g)
            call = (q, kc, vc, torch.tensor(seg), torch.tensor(ptr), torch.tensor(order), args.threads)
            kernels.decode_attention(*call)
            best = float("inf")
            for _ in range(args.reps):
                t = time.perf_counter()
                kernels.decode_attention(*call)
                best = min(best, time.perf_counter() - t)
            print(f"{name:8s} {str(dt).removeprefix('torch.'):9s} {best * 1e3:7.3f} ms per layer")


if __name__ == "__main__":
    main()
