"""What compacting the KV arena costs (Engine._compact: engine/run_allocator.py's `compact`,
then engine/kv_cache.py's `slide_down` copying the live runs' written positions down).

Workload: an arena of --gib GiB (K and V, every layer) at a model's KV shape, filled as the
scheduler fills it under RL rollouts: requests of a prompt run (100-1,500 tokens, from the
top) and 4 samples' runs of max_tokens 16k (1,000 blocks each, from the bottom), until full;
then a third of the samples' runs and of the prompt runs freed at random, so the free blocks
are cut into ranges. Each live run has written part of its positions: a prompt all of them, a
sample 1-2,000 (most RL samples end after about 1k tokens; `--full`: every reserved position,
the most a compaction can ever copy). The allocator's plan and the copies are timed (best of
--repeat; the same layout made afresh for each), and the bytes moved, K and V, all layers.

    python bench/bench_compaction.py [--gib 2] [--shape smollm2|llama8b|both] [--full] [--device cpu]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine.kv_cache import KVCache  # noqa: E402
from engine.run_allocator import RunAllocator  # noqa: E402
from machine import describe  # noqa: E402

BLOCK = 16
SHAPES = {  # name -> (layers, KV heads, head_dim): SmolLM2-135M, Llama-3.1-8B
    "smollm2": (30, 3, 64),
    "llama8b": (32, 8, 128),
}


def layout(num_blocks: int, rng: random.Random, full: bool) -> tuple[RunAllocator, list[tuple[int, int, int]]]:
    """A fragmented allocator and its live runs as (first block, blocks, positions written)."""
    a = RunAllocator(num_blocks)
    runs: list[tuple[int, int, int]] = []
    while True:
        p = rng.randint(100, 1500)
        pb = -(-p // BLOCK)
        start = a.allocate(pb, from_end=True)
        if start is None:
            break
        runs.append((start, pb, pb * BLOCK if full else p))
        for _ in range(4):
            s = a.allocate(1000)
            if s is None:
                break
            runs.append((s, 1000, 1000 * BLOCK if full else rng.randint(1, 2000)))
    for i in sorted(rng.sample(range(len(runs)), len(runs) // 3), reverse=True):
        s, n, _ = runs.pop(i)
        a.free(s, n)
    return a, runs


def one(kv: KVCache, rng: random.Random, full: bool) -> tuple[float, float, int, int, int]:
    """Time one compaction: (plan seconds, copy seconds, live runs, positions moved, free ranges)."""
    a, runs = layout(kv.num_positions // BLOCK, rng, full)
    ranges = len(a.free_ranges())
    t0 = time.perf_counter()
    stretches = a.compact()
    firsts = [s for s, _, _ in stretches]
    import bisect
    moves = []
    for s, n, w in runs:
        st, _, d = stretches[bisect.bisect_right(firsts, s) - 1]
        if s != s - st + d:
            moves.append((s * BLOCK, (s - st + d) * BLOCK, w))
    moves.sort()
    t1 = time.perf_counter()
    kv.slide_down(moves)
    if kv.k.device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(runs), sum(w for _, _, w in moves), ranges


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0, help="arena size, K and V, all layers")
    ap.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    ap.add_argument("--full", action="store_true", help="every reserved position written (the worst case)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())
    for name in SHAPES if args.shape == "both" else [args.shape]:
        L, H, D = SHAPES[name]
        per_pos = KVCache.bytes_per_position(L, H, D, torch.bfloat16)
        positions = int(args.gib * 2**30) // per_pos // BLOCK * BLOCK
        kv = KVCache(L, H, D, 1, 16, torch.bfloat16, args.device, num_positions=positions)
        kv.k.fill_(1.0)  # commit the pages, as a running arena's are
        kv.v.fill_(1.0)
        best = None
        for _ in range(args.repeat):
            got = one(kv, random.Random(0), args.full)  # the same layout each time
            best = got if best is None or got[1] < best[1] else best
        plan, copy, live, moved, ranges = best
        gb = moved * per_pos / 1e9
        print(f"{name} (bf16, {per_pos:,} B/position): arena {kv.nbytes / 2**30:.2f} GiB = {positions // BLOCK:,} blocks, "
              f"{live} live runs, {ranges} free ranges before; moved {moved:,} positions = {gb:.3f} GB "
              f"(K+V) in {copy * 1e3:.1f} ms ({gb / copy if copy else 0:.1f} GB/s), plan {plan * 1e3:.2f} ms"
              f"{' [--full]' if args.full else ''}")


if __name__ == "__main__":
    main()
