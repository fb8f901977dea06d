"""Batch invariance on a real model, measured: SmolLM2-135M-Instruct on 12 GSM8K chat prompts x
4 samples x 48 tokens (temperature 1, top_k 50), run with max_num_seqs 64, 3 and 1 and prefix
sharing on and off, and prefix caching off for two of them (the prompts share ChatML's
system turn, which the others copy from a stored prompt: engine/prefix_cache.py), in float32
and bfloat16: every sample's tokens and logprob bits must be the same in every run of a dtype
(issue 18's acceptance). With --limited the same runs go
again in a subprocess with torch, oneDNN and the compiled kernels limited to AVX2, and must
give the native run's bits.

    python bench/invariance_smollm2.py [--limited] [--threads 2] [--model smollm2] [--dtypes float32,bfloat16]

--model: another checkpoint with a chat template (bench/standin.py's SmolLM2 with random
weights, where the GGUF cannot be installed); --dtypes: which of the two to run. Each native
run's line is printed as it ends.

Prints the machine line, one line per run (its hash and seconds), and a verdict per dtype.
Exit status 1 when any run differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

LIMITED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "BATCHGEN_ISA": "avx2"}
# (max_num_seqs, prefix_sharing, prefix_caching)
RUNS = [(seqs, sharing, True) for seqs in (64, 3, 1) for sharing in (True, False)] + [(64, True, False),
                                                                                    (1, False, False)]


def run_all(threads: int, model: str = "smollm2", dtypes: tuple = ("float32", "bfloat16"),
            log=None, runs: tuple = tuple(range(len(RUNS)))) -> dict:
    """{dtype: [(max_num_seqs, prefix_sharing, prefix_caching, sha256, seconds, cached prompt
    tokens), ...]} in this process."""
    import torch

    from engine import SamplingParams, load_engine

    torch.set_num_threads(threads)
    questions = [json.loads(line)["question"] for line in (ROOT / "jobs" / "data" / "gsm8k_demo.jsonl").open()][:12]
    params = SamplingParams(num_samples=4, max_tokens=48, temperature=1.0, top_k=50, seed=7)
    out: dict = {}
    for dtype in dtypes:
        out[dtype] = []
        for seqs, sharing, caching in (RUNS[i] for i in runs):
            eng = load_engine(model, device="cpu", dtype=dtype, max_seq_len=1024, max_num_seqs=seqs,
                              prefix_sharing=sharing, prefix_caching=caching)
            prompts = [eng.tokenizer.render_chat([{"role": "user", "content": q}], date="2026-01-01")
                       for q in questions]
            t0 = time.perf_counter()
            res = eng.generate(prompts, params, prompt_ids=[str(i) for i in range(len(prompts))])
            dt = time.perf_counter() - t0
            h = hashlib.sha256()
            for row in res:
                for s in row:
                    h.update(json.dumps(s.tokens).encode() + struct.pack(f"{len(s.logprobs)}f", *s.logprobs))
            out[dtype].append((seqs, sharing, caching, h.hexdigest(), dt, eng.num_cached_prompt_tokens))
            if log is not None:
                log(f"  {dtype} max_num_seqs {seqs} prefix_sharing {sharing} prefix_caching {caching}: "
                    f"{h.hexdigest()[:16]} {dt:.1f} s ({eng.num_cached_prompt_tokens} prompt tokens cached)")
            del eng
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limited", action="store_true", help="also run limited to AVX2 in a subprocess")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--runs", default=",".join(map(str, range(len(RUNS)))),
                    help="comma-separated indices into RUNS, to spread one check over processes (compare their hashes)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the subprocess's output
    args = ap.parse_args()
    runs = tuple(int(i) for i in args.runs.split(","))
    if args.json:
        print(json.dumps(run_all(args.threads, args.model, tuple(args.dtypes.split(",")), runs=runs)))
        return 0
    import torch
    from machine import describe

    torch.set_num_threads(args.threads)
    print(describe())
    print(f"model: {args.model}")
    results = {"native": run_all(args.threads, args.model, tuple(args.dtypes.split(",")),
                                 log=lambda line: print(line, flush=True), runs=runs)}
    if args.limited:
        env = {**os.environ, **LIMITED,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        r = subprocess.run([sys.executable, __file__, "--json", "--threads", str(args.threads), "--model", args.model,
                            "--dtypes", args.dtypes, "--runs", args.runs], env=env,
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            print(r.stderr[-3000:])
            return 1
        results["avx2"] = json.loads(r.stdout.strip().splitlines()[-1])
    ok = True
    for dtype in args.dtypes.split(","):
        hashes = set()
        for where, res in results.items():
            for seqs, sharing, caching, h, dt, cached in res[dtype]:
                print(f"{dtype:9s} {where:6s} max_num_seqs {seqs:3d} prefix_sharing {str(sharing):5s} "
                      f"prefix_caching {str(caching):5s} {h[:16]}  {dt:6.1f} s  cached {cached}")
                hashes.add(h)
        same = len(hashes) == 1
        ok &= same
        n = sum(len(res[dtype]) for res in results.values())
        print(f"{dtype}: {'all ' + str(n) + ' runs bit-identical' if same else f'{len(hashes)} different results'} "
              f"(48 samples x 48 tokens each)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
