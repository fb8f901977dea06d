"""The compiled attention kernels alone (engine/kernels/csrc/decode_attention.cpp and
prefill_attention.cpp), SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64), float32
and bfloat16 KV.

Decode shapes: `rl`, bench_rl.py's step: 8 prompts of 1,200 tokens x 16 samples, each sample
128 tokens into its own run (the prompt's keys shared by its 16 samples); `smollm2`,
bench_smollm2.py's: 32 prompts of 100 tokens x 4 samples, 64 generated tokens each. Prefill
shapes: `prefill`, 4 prompts of 1,200 tokens, causal, nothing cached; `prefill_cached`, 8
prompts of 1,200 tokens whose first 1,050 are cached (bench_rl.py's prompts behind their
shared 8-shot prefix). Random keys, values and queries. Prints, per shape and dtype, the
best of --reps passes, each pass one call per layer over --layers layers' arenas (1: the
layer stays in cache between calls; 30, SmolLM2's depth: each call reads its arena from
memory, as in the engine's step), in ms per layer.

--base DIR: another checkout of batchgen (a `git worktree` of the commit before, say). Its
kernel library is built there and loaded beside this one, and the two are timed in
alternation within this process (--rounds times, the median of each one's bests), with the
ratio this / base: the machines are noisy, and rates from separate processes minutes apart
differ by more than a kernel change moves them.

    python bench/bench_attention.py [--threads 1] [--reps 15] [--layers 1] [--shapes rl,smollm2,...]
                                    [--base DIR [--rounds 7]]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels.library import NativeKernels  # noqa: E402
from engine.kernels.native import native_kernels  # noqa: E402
from machine import describe  # noqa: E402  (bench/ is the script's directory)

SHAPES = {"rl": (8, 16, 1200, 128), "smollm2": (32, 4, 100, 64)}  # prompts, samples, prompt tokens, own tokens
PREFILL = {"prefill": (4, 1200, 0), "prefill_cached": (8, 1200, 1050)}  # prompts, tokens, of them cached
HQ, HKV, D = 9, 3, 64


def base_kernels(base: Path, like: NativeKernels) -> NativeKernels:
    """The kernel library of the checkout at `base`, for the same ISA (built there, in a
    subprocess, from that checkout's sources), loaded into this process."""
    code = (f"import sys; sys.path.insert(0, {str(base)!r}); from engine.kernels.build import build_library; "
            f"print(build_library({like.isa!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"--base {base}: its library did not build:\n{done.stderr[-2000:]}")
    path = Path(done.stdout.strip().splitlines()[-1])
    return NativeKernels(ctypes.CDLL(str(path)), like.isa, path, like.amx_order)


def this_and_base(threads: int, base: Path | None) -> tuple[NativeKernels, NativeKernels | None]:
    """torch's thread count set and the machine line printed: this checkout's kernel library
    and, with `base`, that checkout's for the same ISA (None without); exits where the
    compiled kernels are unavailable."""
    torch.set_num_threads(threads)
    print(describe())
    kernels = native_kernels()
    if kernels is None:
        sys.exit("the compiled kernels are unavailable here")
    return kernels, (base_kernels(base.resolve(), kernels) if base else None)


def calls(name: str, dtype: torch.dtype, layers: int, threads: int, g: torch.Generator) -> list:
    """One call per layer: (method, its arguments), each layer with arenas of its own."""
    if name in PREFILL:
        prompts, tokens, cached = PREFILL[name]
        q = torch.randn(prompts, tokens - cached, HQ, D, generator=g)
        starts = torch.tensor([i * (tokens + 5) for i in range(prompts)])
        lengths = torch.full((prompts,), tokens)
        P = prompts * (tokens + 5)
        return [("prefill_attention", (q, torch.randn(P, HKV, D, generator=g).to(dtype),
                                       torch.randn(P, HKV, D, generator=g).to(dtype), starts, lengths, None, threads),
                 {"cached": torch.full((prompts,), cached)} if cached else {}) for _ in range(layers)]
    groups, rows, plen, own = SHAPES[name]
    B = groups * rows
    P = groups * plen + B * own
    seg, order, ptr = [], [], [0]
    pos = groups * plen
    for gi in range(groups):
        for _ in range(rows):
            seg.append([gi * plen, plen, pos, own])
            pos += own
            order.append(len(seg) - 1)
        ptr.append(len(order))
    q = torch.randn(B, HQ, D, generator=g)
    runs = (torch.tensor(seg), torch.tensor(ptr), torch.tensor(order))
    return [("decode_attention", (q, torch.randn(P, HKV, D, generator=g).to(dtype),
                                  torch.randn(P, HKV, D, generator=g).to(dtype), *runs, threads), {})
            for _ in range(layers)]


def run(kernels: NativeKernels, call: tuple) -> torch.Tensor:
    method, args, kwargs = call
    return getattr(kernels, method)(*args, **kwargs)


def best_pass(kernels: NativeKernels, layer_calls: list, reps: int) -> float:
    """The fastest of `reps` passes over every layer, in seconds per layer."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for call in layer_calls:
            run(kernels, call)
        best = min(best, (time.perf_counter() - t) / len(layer_calls))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--shapes", default=",".join([*SHAPES, *PREFILL]))
    ap.add_argument("--base", type=Path, default=None, help="another checkout, timed in alternation with this one")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    kernels, base = this_and_base(args.threads, args.base)
    if base is not None:
        print(f"this: {kernels.path.name}; base ({args.base}): {base.path.name}")
    g = torch.Generator().manual_seed(0)
    for name in args.shapes.split(","):
        for dt in (torch.float32, torch.bfloat16):
            layer_calls = calls(name, dt, args.layers, args.threads, g)
            label = f"{name:14s} {str(dt).removeprefix('torch.'):9s}"
            mine = run(kernels, layer_calls[0])
            if base is None:
                print(f"{label} {best_pass(kernels, layer_calls, args.reps) * 1e3:7.3f} ms per layer")
                continue
            same = torch.equal(mine.view(torch.int32), run(base, layer_calls[0]).view(torch.int32))
            this_t, base_t = [], []
            for _ in range(args.rounds):
                this_t.append(best_pass(kernels, layer_calls, args.reps))
                base_t.append(best_pass(base, layer_calls, args.reps))
            a, b = statistics.median(this_t), statistics.median(base_t)
            print(f"{label} this {a * 1e3:7.3f}  base {b * 1e3:7.3f} ms per layer  this / base {a / b:.3f}  "
                  f"{'same bits' if same else 'OTHER BITS'}")


if __name__ == "__main__":
    main()
