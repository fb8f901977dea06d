"""SmolLM2-135M-Instruct exported to ONNX (`batchgen export`), in onnxruntime, beside the engine.

One run: the export (seconds, the process's peak memory after it), then greedy generation of
`--max-tokens` tokens (no stop tokens) on the first GSM8K test questions rendered with the
chat template, at batch 1 and at batch 16, by
- the engine (float32, `Engine.generate`, temperature 0);
- the exported graph in onnxruntime (CPU provider, the same thread count), in the plain loop a
  user writes (docs/export.md): one prefill of the left-padded batch, then one decode step per
  token, each step's present.* fed back as past_key_values.* (numpy arrays, no IO binding).
Both rates count generated tokens over the whole call (prefill included); onnxruntime's decode
steps alone are printed too. Then the ratio onnxruntime / engine, and whether the tokens agree.

    python bench/bench_export.py [--threads 2] [--max-tokens 64] [--batch 1 16]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTIONS = ROOT / "jobs" / "data" / "gsm8k_demo.jsonl"  # the first 64 GSM8K test questions (MIT)

from machine import describe  # noqa: E402


def ort_generate(sess, prompts: list[list[int]], max_tokens: int, n_layer: int, n_kv: int, head_dim: int):
    """Greedy loop over the exported interface: (tokens (B, max_tokens), total s, decode s)."""
    B, P = len(prompts), max(map(len, prompts))
    ids, mask = np.zeros((B, P), np.int64), np.zeros((B, P), np.int64)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    pos = np.maximum(mask.cumsum(1) - 1, 0)
    feed = {f"past_key_values.{i}.{kv}": np.zeros((B, n_kv, 0, head_dim), np.float32)
            for i in range(n_layer) for kv in ("key", "value")}
    names = [o.name for o in sess.get_outputs()]
    out_tokens = []
    t0 = time.perf_counter()
    t_decode = None
    for step in range(max_tokens):
        if step == 1:
            t_decode = time.perf_counter()
        outs = dict(zip(names, sess.run(names, {**feed, "input_ids": ids, "attention_mask": mask,
                                                "position_ids": pos})))
        nxt = outs["logits"][:, -1].argmax(-1)
        out_tokens.append(nxt)
        feed = {"past_key_values." + k[8:]: v for k, v in outs.items() if k.startswith("present.")}
        ids, pos = nxt[:, None].astype(np.int64), pos[:, -1:] + 1
        mask = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
    end = time.perf_counter()
    return np.stack(out_tokens, 1), end - t0, end - (t_decode or end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())

    import onnxruntime as ort

    from engine import SamplingParams, load_engine
    from engine.export import export

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        record = export("smollm2", Path(tmp) / "smollm2", log=lambda *_: None)
        export_s = time.perf_counter() - t0
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"export: {export_s:.1f} s (load + trace + write), peak RSS {peak_gb:.2f} GB, "
              f"model.onnx {(Path(tmp) / 'smollm2' / 'model.onnx').stat().st_size / 2**20:.0f} MiB")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(str(Path(tmp) / "smollm2" / "model.onnx"), opts,
                                    providers=["CPUExecutionProvider"])
        eng = load_engine("smollm2", device="cpu", dtype="float32")
        info = eng.model.info
        questions = [json.loads(line)["question"] for line in QUESTIONS.open()]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=[])
        ort_generate(sess, [eng.tokenizer.encode("warm up")], 2, info.n_layer, info.n_kv_head, info.head_dim)
        eng.generate([eng.tokenizer.encode("warm up")], SamplingParams(max_tokens=2, temperature=0.0))
        rows = []
        for B in args.batch:
            prompts = [eng.tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions[:B]]
            t = time.perf_counter()
            want = [r[0].tokens for r in eng.generate(prompts, params, prompt_ids=list(range(B)))]
            eng_s = time.perf_counter() - t
            got, ort_s, dec_s = ort_generate(sess, prompts, args.max_tokens, info.n_layer, info.n_kv_head,
                                             info.head_dim)
            same = sum(g == w for g, w in zip(got.tolist(), want))
            n = B * args.max_tokens
            rows.append((B, n / eng_s, n / ort_s, B * (args.max_tokens - 1) / dec_s, same))
        print(f"\n{'batch':>5} {'engine tok/s':>13} {'onnxruntime tok/s':>18} {'ort decode tok/s':>17} "
              f"{'ort/engine':>11} {'same tokens':>12}")
        for B, e, o, d, same in rows:
            print(f"{B:>5} {e:>13.1f} {o:>18.1f} {d:>17.1f} {o / e:>10.2f}x {same:>7}/{B}")
        print(f"\n{args.max_tokens} greedy tokens per prompt, {args.threads} threads, float32; "
              f"export verified: {record['verification'] is not None}")


if __name__ == "__main__":
    main()
