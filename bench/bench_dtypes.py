"""The engine in float32, bfloat16 and `dtype: auto` on one machine: what bfloat16 weights buy
on this CPU and whether `auto` picks the faster.

Workloads (the engine only, no baseline):
- `smollm2`: bench_smollm2.py's: SmolLM2-135M-Instruct, 32 GSM8K chat prompts x 4 samples x
  128 tokens, temperature 1, top_k 50;
- `rl`: bench_rl.py's: 8 GSM8K questions behind an 8-shot prefix (prompts of ~1.2k tokens),
  16 samples x 256 tokens, temperature 1, the whole vocabulary (needs ../shared/data).
Each dtype runs twice, in the order float32, bfloat16, auto, bfloat16, float32 (a drift of
the machine's speed over the minutes shows as a difference between a dtype's two runs, and
cancels in their mean); a dtype's runs must give the same tokens. Prints each rate, the
ratio bfloat16 / float32, and auto against the faster of the two, with the reason auto gave
(engine/kernels/native.py, `bfloat16_is_faster`).

    python bench/bench_dtypes.py [--workload smollm2|rl|both] [--threads 2] [--data ../shared/data]
                                 [--model smollm2] [--dtypes float32,bfloat16,auto] [--no-prefix-caching]
                                 [--device cpu|cuda]

--model: another checkpoint of the same tokenizer (a directory or file `load_engine` reads), for
example SmolLM2's architecture with random weights where the GGUF cannot be installed;
--dtypes: each of these once, in this order, instead of the five runs (for a machine lent for
minutes, or one dtype per process on disjoint cores).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

from bench_rl import few_shot_prefix  # noqa: E402  (bench/ is the script's directory)
from machine import describe  # noqa: E402


def workload(name: str, data: Path) -> tuple[list[str], dict]:
    """(user messages, SamplingParams keyword arguments) of a workload."""
    if name == "smollm2":
        questions = [json.loads(line)["question"] for line in (ROOT / "jobs" / "data" / "gsm8k_demo.jsonl").open()]
        return questions[:32], dict(num_samples=4, max_tokens=128, temperature=1.0, top_k=50, seed=0)
    train, test = data / "gsm8k" / "train.jsonl", data / "gsm8k" / "test.jsonl"
    if not train.exists() or not test.exists():
        sys.exit(f"the rl workload needs ../shared/data beside the checkout, or --data ({train}, {test})")
    prefix = few_shot_prefix(train)
    questions = [json.loads(line)["question"] for line in test.open()][:8]
    return ([f"{prefix}Question: {q}\nAnswer:" for q in questions],
            dict(num_samples=16, max_tokens=256, temperature=1.0, top_k=0, seed=0))


def run(dtype: str, messages: list[str], params: dict, model: str = "smollm2",
        prefix_caching: bool = True, device: str = "cpu") -> tuple[float, list, str]:
    """(tokens/s, every sample's tokens, the engine's resolved dtype) of one engine run."""
    from engine import SamplingParams, load_engine

    eng = load_engine(model, device=device, dtype=dtype, prefix_caching=prefix_caching)
    prompts = [eng.tokenizer.render_chat([{"role": "user", "content": m}]) for m in messages]
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up (weights packed)
    computed0 = eng.num_prefill_tokens
    t0 = time.perf_counter()
    res = eng.generate(prompts, SamplingParams(**params))
    dt = time.perf_counter() - t0
    n = sum(len(s.tokens) for row in res for s in row)
    resolved = str(eng.dtype).replace("torch.", "")
    print(f"  {dtype:8s} ({resolved}): {n} tokens in {dt:.1f} s = {n / dt:.1f} tokens/s (prefill "
          f"{eng.num_prefill_tokens - computed0} prompt tokens, {eng.num_cached_prompt_tokens} cached)", flush=True)
    tokens = [[s.tokens for s in row] for row in res]
    del eng, res
    gc.collect()
    return n / dt, tokens, resolved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("smollm2", "rl", "both"), default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", type=Path, default=SHARED)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default=None, help="comma-separated; each once")
    ap.add_argument("--no-prefix-caching", action="store_true", help="every prompt prefilled whole (for comparison)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU path (its rates are not the CPU's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())
    print(f"model: {args.model}; device: {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    from engine.kernels.native import bfloat16_is_faster

    faster, why = bfloat16_is_faster()
    print(f"dtype auto -> {'bfloat16' if faster else 'float32'}: {why}")
    for name in (("smollm2", "rl") if args.workload == "both" else (args.workload,)):
        messages, params = workload(name, args.data)
        print(f"workload {name}: {len(messages)} prompts, {params}", flush=True)
        rates: dict[str, list[float]] = {}
        tokens: dict[str, list] = {}
        resolved = {}
        order = (args.dtypes.split(",") if args.dtypes else
                 ("float32", "bfloat16", "auto", "bfloat16", "float32"))
        for dtype in order:
            rate, toks, resolved[dtype] = run(dtype, messages, params, args.model, not args.no_prefix_caching,
                                              args.device)
            rates.setdefault(dtype, []).append(rate)
            if dtype in tokens:
                assert toks == tokens[dtype], f"{dtype}: the two runs gave different tokens"
            tokens[dtype] = toks
        if "auto" in tokens and resolved["auto"] in tokens:
            assert tokens["auto"] == tokens[resolved["auto"]], "auto did not run as the dtype it resolved to"
        if not {"float32", "bfloat16", "auto"} <= set(rates):
            continue
        mean = {k: sum(v) / len(v) for k, v in rates.items()}
        best = max(mean["float32"], mean["bfloat16"])
        print(f"{name}: float32 {mean['float32']:.1f}, bfloat16 {mean['bfloat16']:.1f}, auto ({resolved['auto']}) "
              f"{mean['auto']:.1f} tokens/s; bfloat16 / float32 = {mean['bfloat16'] / mean['float32']:.2f}x; "
              f"auto / the faster = {mean['auto'] / best:.2f}", flush=True)


if __name__ == "__main__":
    main()
