"""The compiled GEMM (engine/kernels/csrc/gemm.cpp): every projection and the head of a CPU step.

What this proves: each output element is the sequence of rounded operations over K in order
that the source's header defines (float32: one FMA chain; bfloat16: an AMX tile's even and
odd partial sums per 16 pairs), so a row's bits depend on that row alone: not on how many
rows share the call, where the row sits, the thread count, the rows' stride, or the
instruction set the library was built for (every ISA this CPU runs is compared against every
other; bfloat16 through vdpbf16ps against its FMA emulation where the CPU has AVX-512 BF16),
and the bfloat16 bits are the ones AMX hardware gave (tests/data/amx_tdpbf16ps.pt).

The AMX path (engine/kernels/csrc/gemm_amx.cpp) is checked in layers, since most CPUs cannot run
it: the choice of ISA and the verification's verdicts on fake reports anywhere; that the
amx build compiles and packs its tiles right wherever the compiler takes the AMX flags;
the whole kernel and the verification with the tile instructions emulated in software on
AVX-512 BF16 CPUs; and the instructions themselves only on AMX CPUs (skipped elsewhere).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.kernels.amx_probe as A
from conftest import builds_to_compare, emulated_amx_build, every_build
from engine.kernels.native import native_isa, native_kernels, supported_isas

K = native_kernels()
pytestmark = [pytest.mark.invariance,
              pytest.mark.skipif(K is None, reason="the compiled kernels are unavailable here (no compiler or not "
                                                   "x86-64 with AVX2)")]
ISAS = supported_isas()
SHAPES = [(1, 8, 1), (5, 64, 7), (37, 576, 960), (130, 96, 200), (300, 1536, 50), (9, 2, 49),
          (11, 33, 17), (3, 1, 5)]  # odd K: a bfloat16 weight packed with a zero column (pairs)


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
    """float32: the chain starts at k = 0 and adds in order: 1 + 1e8 - 1e8 is 0 in float32
    that way (1e8 + 1 rounds to 1e8), 1 in other orders. The bias is added after the chain.
    bfloat16: within a block of 32 k the even and the odd elements are summed apart, then
    added, and the blocks are added in order."""
    x = torch.tensor([[1.0, 1e8, -1e8]])
    w = torch.ones(2, 3)
    assert run(K, x, w).tolist() == [[0.0, 0.0]]
    assert run(K, x, w, torch.tensor([0.5, 1.0])).tolist() == [[0.5, 1.0]]
    wb = torch.ones(1, 34, dtype=torch.bfloat16)
    xb = torch.zeros(1, 34, dtype=torch.bfloat16)
    xb[0, :3] = torch.tensor([1e8, 1.0, -1e8])
    # even (1e8 - 1e8 = 0) and odd (1) apart: 1; one chain in k order would give 0
    assert run(K, xb[:, :4], wb[:, :4]).tolist() == [[1.0]]
    xb[0, :3] = torch.tensor([1e8, 1.0, 0.0])
    xb[0, 32] = -1e8
    # block 1: 1e8 + 1 = 1e8 (rounded); block 2: 1e8 - 1e8 = 0; without blocks, 1
    assert run(K, xb, wb).tolist() == [[0.0]]


AMX_MEASURED = Path(__file__).parent / "data" / "amx_tdpbf16ps.pt"


def amx_measured_cases():
    """The cases of tests/data/amx_tdpbf16ps.pt: (kind, x (rows, K) bfloat16, w (cols, K)
    bfloat16, bias (cols,) or None, the AMX tile's output (rows, cols) float32 or bfloat16)."""
    d = torch.load(AMX_MEASURED)
    xo = wo = bo = yo = 0
    for kind, k, rows, cols, has_b, out_bf16 in d["meta"].tolist():
        x = d["x"][xo:xo + rows * k].view(rows, k)
        w = d["w"][wo:wo + cols * k].view(cols, k)
        b = d["b"][bo:bo + cols] if has_b else None
        y = d["y"][yo:yo + rows * cols].view(rows, cols)
        xo, wo, bo, yo = xo + rows * k, wo + cols * k, bo + cols * has_b, yo + rows * cols
        yield d["kinds"][kind], x, w, b, y.to(torch.bfloat16) if out_bf16 else y


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "amx"])
def test_every_build_gives_the_bits_an_amx_tile_gave(isa):
    """The bfloat16 sequence is TDPBF16PS's as the hardware computes it: every build this CPU
    runs reproduces, bit for bit (NaN equal to NaN), what an Intel Xeon's AMX tiles (Emerald
    Rapids) gave on the AMX probe's 500 cases: random operands, special values (denormals,
    infinities, NaN), wide exponents, exact cancellations and products that flush to zero,
    K from 2 to 576, with and without bias, to float32 and bfloat16. So a bfloat16 sample
    has the same bits on a CPU without AMX as on one with it."""
    kern = native_kernels(isa)
    n = 0
    for kind, x, w, b, want in amx_measured_cases():
        got = run(kern, x, w, b, want.dtype, threads=1)
        assert A._bits_equal(got, want), (isa, kind, tuple(x.shape), tuple(w.shape))
        n += 1
    assert n == 500


@pytest.mark.skipif(builds_to_compare() is not None, reason=str(builds_to_compare()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_gives_the_same_bits(dtype):
    """The avx2, avx512 and avx512_bf16 builds (whichever this CPU runs; on a CPU without
    AVX-512, the AVX-512 code in software: conftest.software_avx512) agree bit for bit, on
    shapes that exercise every tile size and the partial last panel, denormals and
    infinities included (bfloat16: vdpbf16ps flushes denormals; the emulation must too)."""
    g = torch.Generator().manual_seed(7)
    kernels = {f"{k.isa} {k.path.name}": k for k in every_build()}
    for M, K_, N in SHAPES + [(64, 128, 97), (17, 2048, 33)]:
        x = torch.randn(M, K_, generator=g)
        w = torch.randn(N, K_, generator=g)
        special = torch.tensor([1e-39, -1e-40, float("inf"), 3e-38])  # denormals, inf, tiny
        x[0, :4] = special[:K_]
        w[-1, :2] = torch.tensor([1e-39, 1e-3])[:K_]
        x, w = x.to(dtype), w.to(dtype)
        b = torch.randn(N, generator=g)
        outs = {isa: run(k, x, w, b) for isa, k in kernels.items()}
        first = next(iter(outs.values()))
        for isa, y in outs.items():
            assert torch.equal(y.nan_to_num(7.0), first.nan_to_num(7.0)), (isa, M, K_, N)


def test_native_isa_is_the_widest_allowed():
    """The widest ISA, except `amx` where the AMX verification did not pass (avx512_bf16)."""
    import engine.kernels.native as N

    want = ISAS[-1]
    if want == "amx" and N.amx_verdict()[0] is None:
        want = "avx512_bf16"
    assert native_isa() == want and K.isa == want
    assert K.native_bf16 == (K.isa in ("avx512_bf16", "amx"))


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


# ---------------------------------------------------------------- AMX (engine/kernels/csrc/gemm_amx.cpp)
import ctypes  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import engine.kernels.build as B  # noqa: E402
import engine.kernels.native as N  # noqa: E402
from conftest import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU_AMX = {"amx_tile", "amx_bf16"} <= B.cpu_flags()
HAS_AMX = "amx" in ISAS  # and torch's dispatch is not limited below AVX-512 (tests/test_isa.py)
NO_AMX = ("this CPU has no AMX (amx_tile, amx_bf16)" if not CPU_AMX else
          "AMX is limited away here (ATEN_CPU_CAPABILITY or no AVX-512 BF16)")
BF16_NATIVE = "avx512_bf16" in ISAS


def _compiler_has_amx() -> bool:
    cxx = os.environ.get("CXX") or "c++"
    if platform.machine().lower() not in ("x86_64", "amd64") or shutil.which(cxx) is None:
        return False
    r = subprocess.run([cxx, "-mamx-tile", "-mamx-bf16", "-dM", "-E", "-x", "c++", "-"], input="",
                       capture_output=True, text=True)
    return r.returncode == 0 and "__AMX_BF16__" in r.stdout


AMX_COMPILES = _compiler_has_amx()


def amx_pack_reference(w: torch.Tensor, swap: bool) -> torch.Tensor:
    """gemm_amx.cpp's B tiles of w (N, K) bfloat16, as int16: panels of 32 columns (two blocks
    of 16), K in blocks of 16 pairs, -0 past K, +0 past N."""
    n, k = w.shape
    kb, blocks = (k // 2 + 15) // 16, (n + 31) // 32 * 2
    bits = torch.zeros(blocks * 16, kb * 32, dtype=torch.int16)
    bits[:, k:] = -32768  # 0x8000: -0
    bits[:n, :k] = w.view(torch.int16)
    pairs = bits.view(blocks * 16, kb * 16, 2)
    if swap:
        pairs = pairs.flip(-1)
    # (block, column, kb, pair, 2) -> (block, kb, pair, column, 2)
    return pairs.reshape(blocks, 16, kb, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)


def test_amx_is_an_isa_only_where_cpuid_says_so(monkeypatch):
    """`amx` needs amx_tile and amx_bf16 besides avx512_bf16's flags; on a CPU without them
    it is not listed, and the native ISA is the widest other one, as before."""
    assert N.ISAS["amx"][1][:-2] == N.ISAS["avx512_bf16"][1] and N.ISAS["amx"][1][-2:] == ("amx_tile", "amx_bf16")
    assert N.ISAS["amx"][0][:-2] == N.ISAS["avx512_bf16"][0] and "-mamx-bf16" in N.ISAS["amx"][0]
    if not CPU_AMX:
        assert "amx" not in ISAS
        if BF16_NATIVE and not os.environ.get("BATCHGEN_ISA"):
            assert native_isa() == "avx512_bf16"
        if K is not None:
            assert K.amx_order is None
    bf16_flags = set(N.ISAS["avx512_bf16"][1])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(B.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(B, "cpu_flags", lambda: frozenset(bf16_flags))
    assert B.supported_isas() == ["avx2", "avx512", "avx512_bf16"]
    monkeypatch.setattr(B, "cpu_flags", lambda: frozenset(bf16_flags | {"amx_tile"}))
    assert B.supported_isas()[-1] == "avx512_bf16"
    monkeypatch.setattr(B, "cpu_flags", lambda: frozenset(bf16_flags | {"amx_tile", "amx_bf16"}))
    assert B.supported_isas() == ["avx2", "avx512", "avx512_bf16", "amx"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert B.supported_isas() == ["avx2"]


def test_native_isa_takes_amx_only_when_verified(monkeypatch, caplog):
    """Where the CPU has AMX, native_isa() is `amx` only with a verified pair order; else
    avx512_bf16, the reason logged. BATCHGEN_ISA=amx refuses an unverified one."""
    monkeypatch.setattr(N, "supported_isas", lambda: ["avx2", "avx512", "avx512_bf16", "amx"])
    monkeypatch.delenv("BATCHGEN_ISA", raising=False)
    monkeypatch.delenv("BATCHGEN_NATIVE", raising=False)
    for verdict, want in [((None, "the AMX probe crashed (signal 4)"), "avx512_bf16"),
                          (("swapped", "AMX gives avx512_bf16's bits"), "amx")]:
        monkeypatch.setattr(N, "amx_verdict", lambda v=verdict: v)
        monkeypatch.setattr(N, "_isa_choice", False)
        with caplog.at_level("INFO", logger="engine.kernels.native"):
            assert N.native_isa() == want
        if want == "avx512_bf16":
            assert "using avx512_bf16, not amx: the AMX probe crashed (signal 4)" in caplog.text
    monkeypatch.setenv("BATCHGEN_ISA", "amx")
    monkeypatch.setattr(N, "_isa_choice", False)
    assert N.native_isa() == "amx"
    monkeypatch.setattr(N, "amx_verdict", lambda: (None, "Linux refused the AMX tile state"))
    monkeypatch.setattr(N, "_isa_choice", False)
    with pytest.raises(ValueError, match="BATCHGEN_ISA=amx: AMX is not verified on this machine .Linux refused"):
        N.native_isa()


def _report(swapped=0, unswapped=3, amx_ms=1.0, ref_ms=3.0, **kw):
    return {"permission": 0, "emulated": False, "cases": 505,
            "orders": {"swapped": {"mismatches": swapped, "first": None if not swapped else "tiny M=1 ..."},
                       "unswapped": {"mismatches": unswapped, "first": None if not unswapped else "cancel M=3 ..."}},
            "ms": {"swapped": amx_ms, "unswapped": amx_ms, "avx512_bf16": ref_ms}, **kw}


def test_amx_decision_on_the_probes_report():
    """decide_amx: AMX only with an order that matched every case and is faster; never after
    a crash, a timeout, a refused tile state, a mismatch or an incomplete report."""
    assert A.decide_amx(_report()) == ("swapped", A.decide_amx(_report())[1])
    assert "swapped pairs on all 505 cases" in A.decide_amx(_report())[1]
    assert A.decide_amx(_report(swapped=2, unswapped=0))[0] == "unswapped"
    refusals = {
        "signal 4": A.decide_amx(None, returncode=-4, output="Illegal instruction"),
        "exit status 1": A.decide_amx(None, returncode=1, output="Traceback ...\nRuntimeError: boom"),
        "did not finish in 300 s": A.decide_amx(None, timed_out=True, timeout=300),
        "reported nothing": A.decide_amx(None),
        "Operation not supported": A.decide_amx({"permission": 95, "error": "Operation not supported"}),
        "either pair order": A.decide_amx(_report(swapped=1, unswapped=4)),
        "incomplete": A.decide_amx({"permission": 0, "cases": 0, "orders": {}}),
        "not faster": A.decide_amx(_report(amx_ms=3.5, ref_ms=3.0)),
        "no timings": A.decide_amx({**_report(), "ms": {}}),
        "never used": A.decide_amx(_report(emulated=True)),
    }
    for words, (order, why) in refusals.items():
        assert order is None and words in why, (words, why)
    assert "tiny M=1" in refusals["either pair order"][1] and "cancel M=3" in refusals["either pair order"][1]


def test_amx_verdict_is_decided_once_per_machine(monkeypatch, tmp_path, caplog):
    """The probe runs once; its verdict (a refusal included) is kept on disk, keyed by the CPU
    and both libraries, and read back by the next process."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHGEN_AMX_PROBING", raising=False)
    monkeypatch.setattr(A, "supported_isas", lambda: ["avx2", "avx512", "avx512_bf16", "amx"])
    monkeypatch.setattr(A, "build_library", lambda isa, **kw: tmp_path / f"lib-{isa}.so")
    calls = []
    for verdict in [(None, "the AMX probe crashed (signal 11)"), ("unswapped", "AMX gives avx512_bf16's bits")]:
        for f in tmp_path.glob("amx-verdict-*.json"):
            f.unlink()
        calls.clear()
        monkeypatch.setattr(A, "run_amx_probe", lambda amx, ref, v=verdict: calls.append((amx, ref)) or v)
        monkeypatch.setattr(A, "_AMX_VERDICT", None)
        with caplog.at_level("INFO", logger="engine.kernels.amx_probe"):
            first = A.amx_verdict()
        assert first[0] == verdict[0] and first[1].startswith(verdict[1])
        assert verdict[1] in caplog.text
        assert calls == [(tmp_path / "lib-amx.so", tmp_path / "lib-avx512_bf16.so")]
        (saved,) = tmp_path.glob("amx-verdict-*.json")
        monkeypatch.setattr(A, "_AMX_VERDICT", None)  # a new process
        assert A.amx_verdict() == first and len(calls) == 1
    monkeypatch.setattr(A, "_AMX_VERDICT", None)
    monkeypatch.setenv("BATCHGEN_AMX_PROBING", "1")  # the probe's own process never probes
    assert A.amx_verdict() == (None, "inside the AMX probe")
    monkeypatch.setattr(A, "_AMX_VERDICT", None)
    monkeypatch.setattr(A, "supported_isas", lambda: ["avx2"])
    assert A.amx_verdict()[1].startswith("this CPU has no AMX")


@pytest.fixture(scope="module")
def amx_library():
    """The `amx` build, compiled whether or not this CPU runs it (loading it executes nothing)."""
    if not AMX_COMPILES:
        pytest.skip("the compiler does not take -mamx-tile -mamx-bf16, or this is not x86-64")
    path = B.build_library("amx", require_cpu=False)
    return path, ctypes.CDLL(str(path))


def test_amx_library_compiles_and_exports_its_kernel(amx_library):
    """The amx build compiles on any x86-64 machine whose compiler takes the AMX flags, and
    exports gemm_amx.cpp's functions (the other builds compile the file to nothing). Its
    pack function is plain C++ and runs anywhere: B tiles with either pair order, -0 past K
    (so a padded product adds -0, which leaves every sum, -0 included, as it is), +0 past N.
    Where the CPU has no AMX, Linux refuses the tile state, and the kernel returns that
    refusal before executing any tile instruction. Loading it runs none of its code: it has
    no static initializers (one compiled for AVX-512 killed every process that loaded an
    AVX-512 build on an AVX2-only CPU, this test's included)."""
    path, lib = amx_library
    symbols = subprocess.run(["nm", str(path)], capture_output=True, text=True, check=True).stdout
    # our sources' own (a toolchain that links libstdc++ statically adds its locale objects'
    # initializers, compiled without AVX-512: harmless, seen on the lent Xeon on 2026-11-27)
    ours = {f"_GLOBAL__sub_I_{src.name}" for src in B.CSRC.glob("*.cpp")}
    assert not [ln for ln in symbols.splitlines() if ln.split()[-1] in ours], symbols
    for name in ("batchgen_amx_request", "batchgen_gemm_amx", "batchgen_gemm_amx_pack",
                 "batchgen_gemm_amx_packed_bytes", "batchgen_amx_emulated", "batchgen_gemm"):
        assert hasattr(lib, name), name
    if K is not None:
        assert not hasattr(ctypes.CDLL(str(K.path)), "batchgen_gemm_amx") or K.isa == "amx"
    if not BF16_NATIVE:
        return  # the library's other code is AVX-512 BF16: not to be called here
    kern = N.NativeKernels(lib, "amx", path)
    assert kern.has_amx and not kern.amx_emulated and kern.amx_order is None
    g = torch.Generator().manual_seed(3)
    for n, k in [(1, 2), (15, 30), (47, 66), (33, 576)]:
        assert kern._amx_packed_bytes(n, k) == (n + 31) // 32 * 32 * ((k // 2 + 15) // 16 * 32) * 2
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        for swap in (True, False):
            out = torch.empty(kern._amx_packed_bytes(n, k), dtype=torch.uint8)
            kern._amx_pack(w.data_ptr(), k, n, k, int(swap), out.data_ptr())
            assert torch.equal(out.view(torch.int16), amx_pack_reference(w, swap)), (n, k, swap)
    if not CPU_AMX:
        assert lib.batchgen_amx_request() != 0
        with pytest.raises(RuntimeError, match="Linux refused the AMX tile state"):
            kern_amx = N.NativeKernels(lib, "amx", path, "swapped")
            kern_amx.gemm(torch.randn(3, 64), kern_amx.pack(torch.randn(5, 64).to(torch.bfloat16)), torch.float32, 1)
        order, why = A.run_amx_probe(path, K.path if K.isa == "avx512_bf16" else B.build_library("avx512_bf16"))
        assert order is None and "Linux refused the AMX tile state" in why


@pytest.fixture(scope="module")
def emulated_amx():
    """gemm_amx.cpp built with BATCHGEN_AMX_EMULATE: its kernel with the tile instructions
    computed in software as the hardware computes them (an AVX-512 BF16 build)."""
    if not BF16_NATIVE:
        pytest.skip(f"the emulated AMX build is an avx512_bf16 one; this CPU runs {ISAS}")
    path = B.build_library("avx512_bf16", extra_flags=("-DBATCHGEN_AMX_EMULATE",))
    return path, ctypes.CDLL(str(path))


def test_emulated_amx_kernel_gives_the_chains_bits():
    """Everything of the AMX path but the instructions: tiles computed as the hardware does
    (the SDM's partial sums) give the avx512_bf16 build's bits with either pair packing at
    every tail of rows (16, 32, 256-row blocks), columns (16, 32), K (32) and K's chunks (the
    C tiles kept in memory between chunks of at most 12 blocks of 32, shared evenly: 520 is 9 + 8
    blocks, 1000 is 11 + 11 + 10; the next chunk's prefetch past the weight's end), on 1-3 threads,
    from strided, float32 or bfloat16 rows, to float32 or bfloat16, with or without bias.
    On a CPU without AVX-512 BF16 the same kernel runs in the software AVX-512 build
    (conftest.software_avx512), against this CPU's native build."""
    path, ref = emulated_amx_build()
    lib = ctypes.CDLL(str(path))
    amx = {o: N.NativeKernels(lib, "amx", path, o) for o in A.AMX_ORDERS}
    assert amx["swapped"].amx_emulated
    g = torch.Generator().manual_seed(11)
    for i, (M, K_, N_) in enumerate([(1, 2, 1), (16, 32, 16), (17, 34, 33), (33, 64, 32), (40, 576, 47),
                                     (257, 96, 70), (5, 1000, 3), (70, 520, 33), (9, 577, 20)]):
        for kind in A._AMX_KINDS:
            x, w = A._amx_operands(kind, M, K_, N_, g)
            b = torch.randn(N_, generator=g)
            wide = torch.zeros(M, K_ + 6)
            wide[:, 2:2 + K_] = x
            for xin, bias, out, threads in [(x, b, torch.float32, 1 + i % 3),
                                            (wide[:, 2:2 + K_], None, torch.float32, 2),
                                            (x.to(torch.bfloat16), b, torch.bfloat16, 2)]:
                want = ref.gemm(xin, ref.pack(w, bias), out, threads)
                for order, kern in amx.items():
                    p = kern.pack(w, bias)
                    assert p.amx_order == order
                    assert A._bits_equal(kern.gemm(xin, p, out, threads), want), (M, K_, N_, kind, out, order)
    # K = 0: the bias (or +0) in every row, as the other builds give (it divided by zero)
    x, w, b = torch.zeros(17, 0), torch.zeros(33, 0, dtype=torch.bfloat16), torch.randn(33, generator=g)
    for bias in (b, None):
        want = ref.gemm(x, ref.pack(w, bias), torch.float32, 2)
        assert torch.equal(want, (b if bias is not None else torch.zeros(33)).expand(17, 33))
        for kern in amx.values():
            assert A._bits_equal(kern.gemm(x, kern.pack(w, bias), torch.float32, 2), want)


@pytest.mark.parametrize("mode,verdict", [("sdm", "give avx512_bf16's bits with swapped pairs"),
                                          ("guide", "in either pair order"),
                                          ("odd", "in either pair order")])
def test_the_probe_accepts_only_what_the_hardware_does(emulated_amx, mode, verdict):
    """The verification itself, in its subprocess, on emulated tiles after three readings of
    TDPBF16PS: the SDM's partial sums (even and odd sums over a tile's 16 pairs, then added;
    what an Emerald Rapids Xeon computes) match, and an emulated build is still never used;
    the intrinsics guide's chain (element 0 first) and its mirror (element 1 first) match in
    neither pair order."""
    order, why = A.run_amx_probe(emulated_amx[0], native_kernels("avx512_bf16").path,
                                 env={"BATCHGEN_AMX_EMULATE_MODE": mode})
    assert order is None and verdict in why, why


EMULATED_AMX_ENGINE = """
import ctypes
import engine.kernels.build as B
import engine.kernels.native as N
path = B.build_library("avx512_bf16", extra_flags=("-DBATCHGEN_AMX_EMULATE",))
N._isa_choice = "amx"  # as if verified: the engine's projections go through gemm_amx.cpp, tiles emulated
N._libraries["amx"] = N.NativeKernels(ctypes.CDLL(str(path)), "amx", path, "swapped")
"""


def test_engine_on_emulated_amx_tiles_is_the_same_bits(emulated_amx):
    """The engine's bfloat16 path through the AMX kernel (packing at load, gemm_amx.cpp in
    every projection and the head) samples the same tokens and logprob bits as avx512_bf16,
    with the tiles emulated (the SDM's reading, swapped pairs)."""
    out = {}
    for name, code, isa in [("amx", EMULATED_AMX_ENGINE + ENGINE_RUN, "avx512_bf16"),
                            ("avx512_bf16", ENGINE_RUN, "avx512_bf16")]:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=child_env(BATCHGEN_ISA=isa))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["amx"]["isa"], out["amx"]["amx_order"]) == ("amx", "swapped")
    assert out["amx"]["hash"] == out["avx512_bf16"]["hash"]


def _rounding_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """x (15, 70) float32 whose row m holds a value that is hard to round to bfloat16 at k =
    m (ties to even both ways, the largest float rounding to inf, denormals rounding to a
    normal and to a denormal, -0, NaN with payloads, infinities; random elsewhere, K 70: two
    whole blocks of 32 and a tail), and a one-hot w (70, 70): y[m, n] is x's bfloat16 at (m,
    n) (times 1, plus products of 0), or NaN where the row holds an infinity or NaN."""
    bits = [0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0xFF7FFFFF, 0x007FFFFF, 0x00400000, 0x80000001,
            0x80000000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0x0080FFFF, 0x3F7FFFFF]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(bits), 70, generator=g)
    for m, b in enumerate(bits):
        x[m, m] = torch.tensor([b], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return x, torch.eye(70).to(torch.bfloat16)


def test_float32_activations_are_rounded_as_torch_rounds():
    """A bfloat16 weight's float32 activations are rounded to bfloat16 inside the call (whole
    blocks of 32 in vector registers, the tail masked) exactly as `.to(torch.bfloat16)`
    rounds them: the call on float32 rows gives the bits of the call on torch's rounding of
    them, in every build this CPU runs, on the emulated AMX tiles (both pair orders) and on
    real ones where verified."""
    x, w = _rounding_cases()
    kernels = [native_kernels(isa) for isa in ISAS if isa != "amx"]
    if BF16_NATIVE:
        path = B.build_library("avx512_bf16", extra_flags=("-DBATCHGEN_AMX_EMULATE",))
        lib = ctypes.CDLL(str(path))
        kernels += [N.NativeKernels(lib, "amx", path, order) for order in A.AMX_ORDERS]
    if HAS_AMX and N.amx_verdict()[0] is not None:
        kernels.append(native_kernels("amx"))
    finite = x.to(torch.bfloat16).isfinite().all(dim=1)  # 0x7f7fffff is finite, its bfloat16 is not
    for kern in kernels:
        p = kern.pack(w)
        for threads in (1, 2):
            got = kern.gemm(x, p, torch.float32, threads)
            assert A._bits_equal(got, kern.gemm(x.to(torch.bfloat16), p, torch.float32, threads)), kern.isa
            # a finite row: each output is its element's bfloat16, flushed to zero where that is a denormal
            want = x.to(torch.bfloat16).float()
            want[want.abs() < torch.finfo(torch.float32).tiny] = 0.0
            assert torch.equal(got[finite].abs(), want[finite].abs()), (kern.isa, kern.amx_order)


# ---- on AMX hardware
amx_hardware = pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)


@amx_hardware
def test_amx_verification_runs_to_a_verdict():
    """The probe runs to the end on AMX hardware: a crash, a refused tile state or an
    incomplete report is a bug here; a mismatch or a slower AMX is the hardware's answer
    (then the process uses avx512_bf16)."""
    order, why = N.amx_verdict()
    print(f"AMX verdict: {order}: {why}")
    assert order is not None or "either pair order" in why or "not faster" in why, why


def _verified_amx():
    order, why = N.amx_verdict()
    if order is None:
        pytest.skip(f"AMX is not verified on this machine: {why}")
    amx = native_kernels("amx")
    assert amx.amx_order == order, "verified, but this process was refused the tile state (see the INFO log)"
    return amx


@amx_hardware
@pytest.mark.parametrize("M,K_,N_", SHAPES + [(16, 32, 16), (17, 66, 47), (257, 2048, 33), (40, 576, 1)])
def test_amx_gives_every_builds_bits(M, K_, N_):
    """The amx build's bfloat16 GEMMs (on tiles) equal every other build's bit for bit, on 1-3
    threads, float32 or bfloat16 in and out, with special values."""
    amx = _verified_amx()
    g = torch.Generator().manual_seed(M + K_ + N_)
    x = torch.randn(M, K_, generator=g)
    w = torch.randn(N_, K_, generator=g)
    x[0, :4] = torch.tensor([1e-39, -1e-40, float("inf"), 3e-38])[:K_]
    w = w.to(torch.bfloat16)
    b = torch.randn(N_, generator=g)
    for threads in (1, 2, 3):
        for xin, out in [(x, torch.float32), (x.to(torch.bfloat16), torch.bfloat16)]:
            got = run(amx, xin, w, b, out, threads)
            assert amx.pack(w).amx_order == amx.amx_order
            for isa in ISAS:
                if isa != "amx":
                    want = run(native_kernels(isa), xin, w, b, out, threads)
                    assert A._bits_equal(got, want), (isa, threads, out)


ENGINE_RUN = """
import hashlib, json, struct
import torch
from engine import SamplingParams, load_engine
from engine.kernels.native import native_isa, native_kernels
torch.set_num_threads(2)
eng = load_engine("tiny-random", device="cpu", dtype="bfloat16", max_seq_len=256)
res = eng.generate([[5, 6, 7, 8, 9], [3] * 40, list(range(40, 90))],
                   SamplingParams(num_samples=3, max_tokens=16, top_k=20, seed=5, stop_token_ids=[]),
                   prompt_ids=["a", "b", "c"])
h = hashlib.sha256()
for row in res:
    for s in row:
        h.update(json.dumps(s.tokens).encode() + struct.pack(f"{len(s.logprobs)}f", *s.logprobs))
print(json.dumps({"isa": native_isa(), "amx_order": native_kernels().amx_order, "hash": h.hexdigest()}))
"""


@amx_hardware
def test_engine_in_bfloat16_is_the_same_bits_on_amx():
    """An engine run in bfloat16 (tiny-random, 3 prompts x 3 samples x 16 tokens) samples the
    same tokens and logprob bits with BATCHGEN_ISA=amx (tiles) as with avx512_bf16."""
    _verified_amx()
    out = {}
    for isa in ("amx", "avx512_bf16"):
        r = subprocess.run([sys.executable, "-c", ENGINE_RUN], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=child_env(BATCHGEN_ISA=isa))
        assert r.returncode == 0, r.stderr[-3000:]
        out[isa] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["amx"]["isa"] == "amx" and out["amx"]["amx_order"] is not None
    assert out["avx512_bf16"]["isa"] == "avx512_bf16"
    assert out["amx"]["hash"] == out["avx512_bf16"]["hash"]
