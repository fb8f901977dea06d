"""Streaming rollouts on SmolLM2-135M-Instruct (GGUF, float32), 2 workers: how soon a
GenerationPool.submit call hands back its first prompts, by unit size, against the call's
own total and against `generate` (one table at the end) on the same prompts.

The RL shape with a long tail: 32 chat prompts x 4 samples, most with max_tokens 24 and
ending on the model's own stop token as in a rollout, the first 2 running to 160 tokens (no
stop token). For each unit size (prompts per unit): the time to the first group (all
samples of one prompt), to half of the groups, and to the last, and the total against
generate's (which cuts the call into 1/(workers x 16) of it per unit). Machines are noisy:
compare the ratios of one run.

    python bench/bench_rollouts.py [--units 1,2,4,8]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

N_PROMPTS, N_LONG, SHORT, LONG = 32, 2, 24, 160


def prompts():
    import pyarrow as pa

    qs = [f"Write a sentence about the number {i}." for i in range(N_PROMPTS)]
    return pa.table({"messages": [[{"role": "user", "content": q}] for q in qs],
                     "prompt_id": [f"q{i}" for i in range(N_PROMPTS)],
                     "params": [{"max_tokens": LONG, "stop_token_ids": []} if i < N_LONG else
                                {"max_tokens": SHORT, "stop_token_ids": None} for i in range(N_PROMPTS)]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", default="1,4,16", help="prompts per unit to try, comma-separated")
    args = ap.parse_args()
    from machine import describe

    from jobs import GenerationPool

    print(describe())
    config = {"model": {"path": "smollm2", "dtype": "float32", "max_seq_len": 512, "max_num_seqs": 64},
              "input": {"format": "chat", "sampling_column": "params"},
              "sampling": {"num_samples": 4, "max_tokens": SHORT, "temperature": 1.0, "seed": 0},
              "cluster": {"num_workers": 2}}
    with GenerationPool(config) as pool:
        pool.generate(prompts()[:4])  # warm-up: imports, first steps
        t0 = time.perf_counter()
        ref = pool.generate(prompts(), {"seed": 0})  # an explicit seed: every call below draws the same noise
        base = time.perf_counter() - t0
        print(f"generate: {base:.2f} s for {ref.num_rows} samples, {sum(ref.column('num_tokens').to_pylist())} tokens")
        for n in [int(x) for x in args.units.split(",")]:
            t0 = time.perf_counter()
            h = pool.submit(prompts(), {"seed": 0}, unit_rows=n)
            times = [time.perf_counter() - t0 for _ in h.results()]
            total = times[-1]
            assert h.result().to_pylist() == ref.to_pylist()
            print(f"submit, {n} prompt(s) per unit: first group {times[0]:.2f} s, half {times[len(times) // 2]:.2f} s, "
                  f"last {total:.2f} s; first/total {times[0] / total:.2f}, total/generate {total / base:.2f}")


if __name__ == "__main__":
    main()
