"""Compacting the KV arena between steps: `compact(engine)`, what `Engine._compact` runs.

When enough KV blocks are free in total but not in ranges long enough for the next admission
(runs freed between live ones), the scheduler says so (`Scheduler.fragmented`) and the engine
compacts before it admits. The live runs slide down in order (engine/run_allocator.py
`RunAllocator.compact`), only their written positions copied, exactly, in every layer
(`KVCache.slide_down`); the samples' runs and their stored prompts' starts follow, and the decode
batch is rebuilt. Attention reads a run the same wherever it starts, so no sample's tokens or
logprobs change. Its cost: bench/bench_compaction.py.
"""
from __future__ import annotations

import bisect
import time
from typing import Any


def compact(engine: Any) -> None:
    """Slide every live run of the KV arena down to its low end, so its free blocks become
    one range (engine/run_allocator.py, `RunAllocator.compact`). Between steps only: no
    admission is half made, and every running sample's keys are written up to the token
    before its last (whose keys the next decode writes), or up to its last in a continuation
    still waiting for its first token (`Sequence.num_cached`). The live runs are the running
    samples' own runs and the stored prompts (of
    running samples, and of waiting requests with samples still to admit); of each, only the
    positions written so far are copied, exactly, in every layer. Each sequence's run start
    and its prompt's (`Sequence.own_start`, `prefix_start`, `Request.kv_block`) move with
    them, so every sample reading a stored prompt follows it, and the decode batch (with its
    layout's cached segments) is rebuilt at the next decode.
    Raises RuntimeError if the allocated blocks are not exactly those runs (a leak).
    """
    t0 = time.perf_counter()
    sched = engine.scheduler
    alloc = sched.allocator
    bs = sched.block_size
    seqs = list(engine.running.values())
    prompts = {id(r): r for r in [s.request for s in seqs] + list(sched.waiting) if r.kv_block is not None}
    held = sum(s.own_blocks for s in seqs) + sum(sched.prompt_blocks(r) for r in prompts.values())
    if held != alloc.num_blocks - alloc.num_free:
        raise RuntimeError(f"engine: {alloc.num_blocks - alloc.num_free} KV blocks allocated but the running "
                           f"samples and stored prompts hold {held}")
    stretches = alloc.compact()
    firsts = [start for start, _, _ in stretches]

    def moved(block: int) -> int:
        start, _, new = stretches[bisect.bisect_right(firsts, block) - 1]
        return block - start + new

    moves: list[tuple[int, int, int]] = []  # (from, to, positions written), arena positions
    for req in prompts.values():
        block = moved(req.kv_block)
        moves.append((req.kv_block * bs, block * bs, len(req.prompt_tokens)))
        req.kv_block = block
    for seq in seqs:
        block = moved(seq.own_block)
        moves.append((seq.own_start, block * bs, seq.num_cached - seq.own_pos0))  # its run: positions own_pos0 on
        seq.own_block, seq.own_start = block, block * bs
        if seq.prefix_start >= 0:
            seq.prefix_start = seq.request.kv_block * bs
    moves = sorted(m for m in moves if m[0] != m[1] and m[2] > 0)
    engine.kv.slide_down(moves)
    engine._batch = None
    engine.num_compactions += 1
    engine.compacted_positions += sum(n for _, _, n in moves)
    engine.compaction_seconds += time.perf_counter() - t0
