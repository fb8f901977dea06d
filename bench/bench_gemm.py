"""A decode step's GEMMs, alone: batchgen's compiled GEMM against torch's F.linear (oneDNN).

SmolLM2-135M's projections at `--rows` rows (128: bench_smollm2's 32 prompts x 4 samples,
or the RL shape's 8 x 16): per layer q|k|v (576 -> 960), o (576 -> 576), gate|up (576 ->
3072), down (1536 -> 576), and the head (576 -> 49,152), random weights, float32
activations and outputs, as the engine calls them. For each shape and weight dtype it prints
the best time of `--rounds` rounds (each the best of about 0.1 s of calls, the methods
alternated) in ms and GFLOP/s, then a step's sum (30 layers and the head). batchgen's
bfloat16 runs on AMX tiles where the probe verified them (gemm_amx.cpp), else on vdpbf16ps
or its emulation (gemm.cpp); torch's bfloat16 is F.linear on bfloat16 activations (oneDNN's
AMX or AVX-512 BF16 kernels, not batch-invariant).

--layers N: N weights of each shape (the head's: at most 3), called in turn, so that each call
reads its weight from memory as a step does (30 layers of SmolLM2 are 425 MB in float32, 212
in bfloat16); 1 (the default): one weight, called again and again, in cache.

--base DIR: another checkout of batchgen (a `git worktree` of the commit before, say); its
library, built there for the same ISA, is timed in the same rounds and its outputs compared
bit for bit ("same bits"): the machines are noisy, and rates from separate processes minutes
apart differ by more than most kernel changes.

    python bench/bench_gemm.py [--threads 2] [--rows 128] [--layers 1] [--rounds 3] [--base DIR]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_attention import this_and_base  # noqa: E402  (bench/ is the script's directory)

# (name, N, K, calls per step): SmolLM2-135M (hidden 576, 9 query and 3 KV heads of 64,
# intermediate 1536, vocabulary 49,152, 30 layers)
SHAPES = (("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("head", 49152, 576, 1))


def best_time(calls: list, budget: float = 0.1) -> float:
    """The shortest mean time of a pass over `calls` (one call per weight, in turn), in
    seconds per call, over about `budget` seconds of passes (one pass to warm up)."""
    def one_pass() -> float:
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - t0) / len(calls)

    first = one_pass()
    reps = max(3, min(200, int(budget / max(first * len(calls), 1e-6))))
    return min(one_pass() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1, help="weights of each shape, called in turn (read from memory)")
    ap.add_argument("--base", type=Path, default=None, help="another checkout, timed in the same rounds")
    args = ap.parse_args()
    kernels, base = this_and_base(args.threads, args.base)
    path = "AMX tiles" if kernels.amx_order else kernels.isa
    print(f"batchgen bfloat16 GEMMs on {path}; {args.rows} rows, {args.threads} threads, {args.layers} weights "
          "of each shape" +
          (f"; base ({args.base}): {base.path.name}" if base else ""))
    g = torch.Generator().manual_seed(0)
    M, threads = args.rows, args.threads
    step: dict[str, float] = {}
    for name, N, K, per_step in SHAPES:
        x = torch.randn(M, K, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            copies = args.layers if per_step > 1 else min(args.layers, 3)  # the head: 113 MB a copy in float32
            ws = [(torch.randn(N, K, generator=g) * K ** -0.5).to(dtype) for _ in range(copies)]
            packed = [kernels.pack(w) for w in ws]
            methods = {"batchgen": [lambda p=p: kernels.gemm(x, p, torch.float32, threads) for p in packed]}
            bits = ""
            if base is not None:
                base_packed = [base.pack(w) for w in ws]
                methods["base"] = [lambda p=p: base.gemm(x, p, torch.float32, threads) for p in base_packed]
                same = torch.equal(methods["batchgen"][0]().view(torch.int32), methods["base"][0]().view(torch.int32))
                bits = "  same bits" if same else "  OTHER BITS"
            xt = x.to(dtype)
            methods["torch"] = [lambda w=w: F.linear(xt, w) for w in ws]
            best = {k: float("inf") for k in methods}
            for _ in range(args.rounds):
                for k, fns in methods.items():
                    best[k] = min(best[k], best_time(fns))
            flops = 2.0 * M * N * K
            label = f"{name:8s} {N:6d} x {K:5d} {str(dtype).removeprefix('torch.'):9s}"
            print(label + "  ".join(f"  {k} {t * 1e3:8.3f} ms {flops / t / 1e9:6.0f} GFLOP/s" for k, t in best.items())
                  + bits, flush=True)
            for k, t in best.items():
                key = f"{k} {str(dtype).removeprefix('torch.')}"
                step[key] = step.get(key, 0.0) + per_step * t
    print("per step (30 layers and the head): " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in step.items()))
    if base is not None:
        for dt in ("float32", "bfloat16"):
            print(f"{dt}: this / base = {step[f'batchgen {dt}'] / step[f'base {dt}']:.3f}")


if __name__ == "__main__":
    main()
