"""Why the engine's CPU step is built the way it is (model.batch_invariant): measurements.

For each kernel the engine could use, how much a row's result moves when the rest of the
call changes, and what the batch-invariant choice costs. Prints:
1. projections: F.linear (MKL), oneDNN's prepacked linear and the engine's compiled GEMM
   (engine/kernels/csrc/gemm.cpp, float32 and bfloat16 weights) at GPT-2-small and head shapes:
   time per call at 128 and 8 rows, and the largest change of a row's output between a
   call over 1..1000 rows and one over 3000 rows (the compiled GEMM's is 0 by construction);
2. pointwise: how many of 256,000 inputs get a different value on the scalar-tail path
   than on the SIMD path, for torch's kernels and the engine's exp/tanh compositions;
3. attention: the largest change of a row's SDPA output between a call over 1, 2 or 3 rows
   and one over 4 rows of identical shape;
4. the CPU flash kernel (what the engine's decode attention calls): for which numbers of
   query rows per (batch, head) item the result depends on the thread running the item;
5. and which row counts of one call change a row's result (a last block of 1-3 rows);
6. the alignment rule engine/kernels/attention.py follows (thread dependence exactly where a
   thread's scratch buffer is not 16-byte aligned), checked over query rows and key counts;
7. what the unpadded single-row (matrix-vector) path saves over padding to 4 rows.

    python bench/bench_invariance.py [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.native import native_isa, native_kernels  # noqa: E402
from machine import describe  # noqa: E402  (bench/ is the script's directory)


def _time_ms(fn, reps: int = 20) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def projections(g: torch.Generator) -> None:
    print("1. projections (in -> out): ms per call at 128 / 8 rows; max row change vs a 3000-row call "
          f"(compiled kernels: {native_isa()})")
    for i, o in ((768, 2304), (768, 768), (768, 3072), (3072, 768), (128, 512), (768, 50257)):
        w, b = torch.randn(o, i, generator=g) * 0.02, torch.randn(o, generator=g) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 128)

        def mkl(z):
            return F.linear(z, w, b)

        def onednn(z):
            return torch.ops.mkldnn._linear_pointwise(z, packed, b, "none", [], "")

        fns = [("F.linear", mkl), ("oneDNN", onednn)]
        kernels = native_kernels()
        if kernels is not None:
            own = {dt: kernels.pack(w.to(dt), b) for dt in (torch.float32, torch.bfloat16)}
            threads = torch.get_num_threads()
            fns += [(f"gemm {str(dt)[6:]}", lambda z, p=p: kernels.gemm(z, p, torch.float32, threads))
                    for dt, p in own.items()]
        x = torch.randn(3000, i, generator=g)
        cols = []
        for name, f in fns:
            full = f(x)
            drift = max((f(x[:n]) - full[:n]).abs().max().item() for n in (1, 7, 128, 1000))
            cols.append(f"{name} {_time_ms(lambda: f(x[:128])):7.2f} / {_time_ms(lambda: f(x[:8])):6.2f} ms, "
                        f"drift {drift:.1e}")
        print(f"   {i:5d} -> {o:6d}: " + " | ".join(cols))


def pointwise(g: torch.Generator) -> None:
    from engine.models.base import invariant_gelu_tanh, invariant_sigmoid

    print("2. pointwise: inputs whose scalar-tail value differs from the SIMD value (of 256,000)")
    x = torch.randn(256_000, generator=g) * 3
    fns = {"torch.sigmoid": torch.sigmoid, "F.silu": F.silu, "F.gelu(tanh)": lambda t: F.gelu(t, approximate="tanh"),
           "torch.exp": torch.exp, "torch.tanh": torch.tanh, "F.gelu(erf)": F.gelu,
           "invariant_sigmoid": invariant_sigmoid, "invariant_gelu_tanh": invariant_gelu_tanh}
    for name, fn in fns.items():
        simd = fn(x)
        tail = torch.cat([fn(x[j:j + 15].clone()) for j in range(0, len(x), 15)])  # 15 < one SIMD block
        print(f"   {name:20s} {int((simd != tail).sum()):6d}")


def attention(g: torch.Generator, threads: int) -> None:
    print("3. attention (SDPA, one query per row): max row change, 1/2/3 rows vs 4 of the same shape")
    for h, kv, length, d in ((4, 2, 8, 32), (12, 12, 300, 64)):
        q = torch.randn(4, h, 1, d, generator=g)
        k, v = torch.randn(4, kv, length, d, generator=g), torch.randn(4, kv, length, d, generator=g)
        full = F.scaled_dot_product_attention(q, k, v, enable_gqa=h != kv)
        drift = [(F.scaled_dot_product_attention(q[:n], k[:n], v[:n], enable_gqa=h != kv) - full[:n]).abs().max().item()
                 for n in (1, 2, 3)]
        print(f"   heads {h}/{kv}, {length} keys: " + ", ".join(f"{x:.1e}" for x in drift))
    # The engine's decode attention (engine/kernels/attention.py) relies on the next two measurements.
    fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    print(f"4. CPU flash kernel, items (batch x head) with m query rows: does an item's result depend on the "
          f"thread that runs it ({threads} threads vs 1)?")
    for d in (8, 64):
        dependent = []
        for m in range(1, 13):
            for length in (33, 100, 600):
                q = torch.randn(16, 6, m, d, generator=g)
                k, v = torch.randn(16, 6, length, d, generator=g), torch.randn(16, 6, length, d, generator=g)
                torch.set_num_threads(1)
                one = fa(q, k, v, 0.0, False)[0]
                torch.set_num_threads(threads)
                if not torch.equal(one, fa(q, k, v, 0.0, False)[0]):
                    dependent.append(m)
                    break
        print(f"   head_dim {d}: thread-dependent for m in {dependent}")
    print("5. CPU flash kernel, one item with r query rows: rows whose result differs from the same rows "
          "in a call of 256 rows")
    for d in (8, 64):
        for length in (5, 100, 1100):
            q = torch.randn(1, 3, 256, d, generator=g)
            k, v = torch.randn(1, 3, length, d, generator=g), torch.randn(1, 3, length, d, generator=g)
            full = fa(q, k, v, 0.0, False)[0]
            moved = [r for r in range(1, 70) if not torch.equal(fa(q[:, :, :r], k, v, 0.0, False)[0], full[:, :, :r])]
            print(f"   head_dim {d}, {length} keys: r in {moved} "
                  f"({'none a multiple of 4' if all(r % 4 for r in moved) else 'SOME multiple of 4'})")


def alignment(g: torch.Generator, threads: int) -> None:
    """6-7: the rule engine/kernels/attention.py derives from the kernel's per-thread scratch buffer
    (q * (k + 2 + head_dim) floats, k = min(keys, 512)): an item's result depends on its
    thread exactly when that size is not a multiple of 4 floats (16 bytes) and k > 3."""
    fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    print(f"6. CPU flash kernel: thread dependence ({threads} threads vs 1) against the alignment rule, "
          f"m query rows, 1-80 and 508-520 keys")
    for d in (64, 80):
        agree = disagree = 0
        for m in (1, 2, 3, 4):
            for length in list(range(1, 81)) + list(range(508, 521)):
                q = torch.randn(8, 4, m, d, generator=g)
                k, v = torch.randn(8, 4, length, d, generator=g), torch.randn(8, 4, length, d, generator=g)
                torch.set_num_threads(1)
                one = fa(q, k, v, 0.0, False)[0]
                torch.set_num_threads(threads)
                dependent = not torch.equal(one, fa(q, k, v, 0.0, False)[0])
                rule = length > 3 and m * (min(length, 512) + 2 + d) % 4 != 0
                # the rule may only over-predict (an unaligned buffer need not change a result)
                if dependent and not rule:
                    disagree += 1
                else:
                    agree += 1
        print(f"   head_dim {d}: {agree} cases consistent with the rule, {disagree} thread-dependent where "
              f"the rule says aligned")
    print("7. CPU flash kernel, 128 rows x 12 heads: ms per call with 1 query row (matrix-vector path) and "
          "with 4 (the padding an unaligned length would otherwise need)")
    for length in (22, 62, 126, 254):
        k = torch.randn(128, length, 12, 64, generator=g).permute(0, 2, 1, 3)
        v = torch.randn(128, length, 12, 64, generator=g).permute(0, 2, 1, 3)
        q1, q4 = torch.randn(128, 12, 1, 64, generator=g), torch.randn(128, 12, 4, 64, generator=g)
        t1, t4 = _time_ms(lambda: fa(q1, k, v, 0.0, False)), _time_ms(lambda: fa(q4, k, v, 0.0, False))
        print(f"   {length} keys: {t1:.2f} ms with 1 row, {t4:.2f} ms with 4 ({t4 / t1:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        sys.exit("torch was built without oneDNN")
    print(describe())
    g = torch.Generator().manual_seed(0)
    projections(g)
    pointwise(g)
    attention(g, args.threads)
    alignment(g, args.threads)


if __name__ == "__main__":
    main()
