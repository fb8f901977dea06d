"""What an RL loop's weight reload costs on SmolLM2-135M-Instruct (Q4_1 GGUF, float32): a
GenerationPool's `load_weights` (the workers stay, their engines copy the new weights in
place) against starting the pool afresh, and Engine.load_weights against load_engine in one
process. The checkpoint reloaded is the same file (what a reload costs does not depend on
the values); the rows after the swap are checked equal to those before it.
Machines are noisy: compare the ratios of one run.

    python bench/bench_load_weights.py [--workers 1] [--repeat 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["What is 12 + 30?", "Name a prime number."]


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_level(repeat: int) -> None:
    import torch

    from engine import SamplingParams, load_engine
    from engine.loading.builtin import resolve_builtin

    torch.set_num_threads(1)
    path = str(resolve_builtin("smollm2"))
    load = _median_time(lambda: load_engine(path, device="cpu", dtype="float32", max_seq_len=256, num_threads=1),
                        repeat)
    eng = load_engine(path, device="cpu", dtype="float32", max_seq_len=256, num_threads=1)
    params = SamplingParams(num_samples=2, max_tokens=16, temperature=0.0)
    prompts = [eng.tokenizer.render_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    before = [[s.tokens for s in row] for row in eng.generate(prompts, params)]
    swap = _median_time(lambda: eng.load_weights(path), repeat)
    after = [[s.tokens for s in row] for row in eng.generate(prompts, params)]
    assert after == before
    print(f"engine: load_engine {load:.2f} s, Engine.load_weights {swap:.2f} s ({load / swap:.1f}x), median of {repeat}")


def pool_level(workers: int, repeat: int) -> None:
    import ray

    from jobs import GenerationPool

    config = {"model": {"path": "smollm2", "max_seq_len": 256, "max_num_seqs": 16},
              "sampling": {"num_samples": 2, "max_tokens": 16, "temperature": 0.0},
              "cluster": {"num_workers": workers}}
    ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        starts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            pool = GenerationPool(config)
            starts.append(time.perf_counter() - t0)
            pool.close()
        with GenerationPool(config) as pool:
            before = pool.generate(PROMPTS, {"seed": 0})
            pids = sorted(s["pid"] for s in pool.engine_states())
            swap = _median_time(lambda: pool.load_weights("smollm2"), repeat)
            assert pool.generate(PROMPTS, {"seed": 0}).equals(before)
            assert sorted(s["pid"] for s in pool.engine_states()) == pids
        start = statistics.median(starts)
        print(f"pool ({workers} worker(s)): start {start:.2f} s, load_weights {swap:.2f} s ({start / swap:.1f}x), "
              f"median of {repeat}")
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from machine import describe

    print(describe())
    engine_level(args.repeat)
    pool_level(args.workers, args.repeat)


if __name__ == "__main__":
    main()
