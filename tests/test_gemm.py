"""The compiled GEMM (engine/kernels/csrc/gemm.cpp): every projection and the head of a CPU step.

What this proves: each output element is the fused multiply-add chain over K in order that
the source's header defines, so a row's bits depend on that row alone: not on how many rows
share the call, where the row sits, the thread count, the rows' stride, or the instruction
set the library was built for (every ISA this CPU runs is compared against every other;
bfloat16 through vdpbf16ps against its two-FMA emulation where the CPU has AVX-512 BF16).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.native import native_isa, native_kernels, supported_isas

K = native_kernels()
pytestmark = [pytest.mark.invariance,
              pytest.mark.skipif(K is None, reason="the compiled kernels are unavailable here (no compiler or not "
                                                   "x86-64 with AVX2)")]
ISAS = supported_isas()
SHAPES = [(1, 8, 1), (5, 64, 7), (37, 576, 960), (130, 96, 200), (300, 1536, 50), (9, 2, 49)]


def run(kern, x, w, bias=None, out=torch.float32, threads=2):
    return kern.gemm(x, kern.pack(w, bias), out, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K_,N", SHAPES)
def test_close_to_float64_and_rows_independent_of_the_call(dtype, M, K_, N):
    """Within float32 rounding of a float64 product; each row (and each row range) equal bit
    for bit to the same rows computed alone, on one thread, from a strided view, and the
    bfloat16 output equal to torch's rounding of the float32 result."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K_, generator=g).to(dtype)
    w = torch.randn(N, K_, generator=g).to(dtype)
    b = torch.randn(N, generator=g)
    full = run(K, x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (full.double() - ref).abs().max() <= 1e-6 * K_ * max(1.0, float(ref.abs().max()))
    for lo, hi in [(0, 1), (M - 1, M), (M // 3, M // 3 + 5), (1, M)]:
        hi = min(hi, M)
        if lo < hi:
            assert torch.equal(run(K, x[lo:hi], w, b), full[lo:hi])
    assert torch.equal(run(K, x, w, b, threads=1), full)
    wide = torch.zeros(M, K_ + 6, dtype=dtype)
    wide[:, 3:3 + K_] = x
    assert torch.equal(run(K, wide[:, 3:3 + K_], w, b), full)  # rows K_ + 6 apart
    if dtype == torch.bfloat16:
        assert torch.equal(run(K, x, w, b, out=torch.bfloat16), full.to(torch.bfloat16))


def test_sum_runs_in_order_from_the_first_k():
    """The chain starts at k = 0 and adds in order: 1 + 1e8 - 1e8 is 0 in float32 that way
    (1e8 + 1 rounds to 1e8), 1 in other orders. The bias is added after the chain."""
    x = torch.tensor([[1.0, 1e8, -1e8]])
    w = torch.ones(2, 3)
    assert run(K, x, w).tolist() == [[0.0, 0.0]]
    assert run(K, x, w, torch.tensor([0.5, 1.0])).tolist() == [[0.5, 1.0]]
    xb = torch.tensor([[1e8, 1.0, -1e8, 0.0]], dtype=torch.bfloat16)  # pairs: odd product first
    wb = torch.ones(1, 4, dtype=torch.bfloat16)
    # (0 + 1) + 1e8 = 1e8 (rounded); (1e8 + 0) - 1e8 = 0
    assert run(K, xb, wb).tolist() == [[0.0]]


@pytest.mark.skipif(len(ISAS) < 2, reason=f"this CPU runs only {ISAS}: the other builds are compared on "
                                          "AVX-512 machines")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_gives_the_same_bits(dtype):
    """The avx2, avx512 and avx512_bf16 builds (whichever this CPU runs) agree bit for bit,
    on shapes that exercise every tile size and the partial last panel, denormals and
    infinities included (bfloat16: vdpbf16ps flushes denormals; the emulation must too)."""
    g = torch.Generator().manual_seed(7)
    kernels = {isa: native_kernels(isa) for isa in ISAS}
    for M, K_, N in SHAPES + [(64, 128, 97), (17, 2048, 33)]:
        x = torch.randn(M, K_, generator=g)
        w = torch.randn(N, K_, generator=g)
        special = torch.tensor([1e-39, -1e-40, float("inf"), 3e-38])  # denormals, inf, tiny
        x[0, :4] = special[:K_]
        w[-1, :2] = torch.tensor([1e-39, 1e-3])[:K_]
        x, w = x.to(dtype), w.to(dtype)
        b = torch.randn(N, generator=g)
        outs = {isa: run(k, x, w, b) for isa, k in kernels.items()}
        first = outs[ISAS[0]]
        for isa, y in outs.items():
            assert torch.equal(y.nan_to_num(7.0), first.nan_to_num(7.0)), (isa, M, K_, N)


def test_native_isa_is_the_widest_allowed():
    assert native_isa() == ISAS[-1] and K.isa == ISAS[-1]
    assert K.native_bf16 == (K.isa == "avx512_bf16")


def test_dtype_auto_probe_is_decided_once_per_machine(monkeypatch, tmp_path):
    """`dtype: auto` on CPU: bfloat16 only where the GEMM has vdpbf16ps and measures faster;
    the verdict is written beside the compiled library and read back, so a noisy moment
    cannot change a machine's choice from one run to the next."""
    import engine.kernels.native as N

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(N, "_BF16_PROBE", None)
    faster, why = N.bfloat16_is_faster()
    if not K.native_bf16:
        assert not faster and "AVX-512 BF16" in why and not list(tmp_path.glob("dtype-auto-*"))
        return
    (verdict,) = tmp_path.glob("dtype-auto-*.json")
    assert "bfloat16" in why and "float32" in why
    verdict.write_text(json.dumps({"bfloat16": not faster, "why": "edited"}))
    monkeypatch.setattr(N, "_BF16_PROBE", None)
    assert N.bfloat16_is_faster() == (not faster, "edited")
