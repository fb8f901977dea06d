"""Whether this machine's AMX tiles give the other builds' bits: the `amx` build's verdict.

The two documents Intel publishes disagree on how TDPBF16PS orders its adds (the intrinsics
guide: each pair's products added in turn, as vdpbf16ps does; the SDM: even and odd partial
sums over the tile's pairs, then added). Measured on an Emerald Rapids Xeon, the hardware
does what the SDM says, and gemm.cpp's bfloat16 sequence is defined to be exactly that, so
every build gives an AMX tile's bits (tests/data/amx_tdpbf16ps.pt holds the measured cases).
A bfloat16 GEMM's bits must be the same on every build, and another CPU model might differ,
so nothing about the hardware is assumed: `amx_verdict()` runs a
probe in a subprocess (a crash, even inside the tiles, stays there) that compares both pair
packings with the avx512_bf16 build bit for bit and times them, and the `amx` build's tiles
are used only with a packing that matched every case and ran faster.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.kernels.build import Unavailable, build_library, cached_verdict, cpu_model, supported_isas
from engine.kernels.library import AMX_ORDERS, NativeKernels

log = logging.getLogger(__name__)

PROBE_SHAPE = (128, 2048, 1024)  # rows x K x N: a decode step's projection, what both probes time

_AMX_VERDICT: "tuple[str | None, str] | None" = None
_AMX_PROBE_TIMEOUT = 300.0  # seconds for the probe's subprocess (importing torch included)
_AMX_SHAPES = [(m, k, n) for m in (1, 3, 16, 17, 40) for k in (2, 30, 64, 66, 576) for n in (1, 15, 16, 47)]
_AMX_KINDS = ("random", "special", "exponents", "cancel", "tiny")


def amx_verdict() -> tuple[str | None, str]:
    """(the pair order of `AMX_ORDERS` with which the `amx` build's bfloat16 GEMMs give the
    avx512_bf16 build's bits, or None; why), decided once per machine.

    The AMX instructions are never executed in this process before a verdict: the first
    process that asks runs `_amx_probe` in a subprocess (`python -c`, BATCHGEN_ISA=amx),
    which requests the tile state from Linux, multiplies random and special operands
    (denormals, infinities, NaN, huge and tiny exponents, exact cancellations, products
    that flush to -0) at 100 shapes (M 1-40, K 2-576 around the tile's 32, N 1-47 around
    its 16) and two larger ones on one and two threads, with and without bias, float32 and
    bfloat16 in and out, in both pair orders, compares every output bit for bit with the
    avx512_bf16 build (NaN equal to NaN), and times a 128 x 2048 x 1024 product each way.
    `decide_amx` turns its report into the verdict: AMX only with an order that matched on
    every case and ran faster than vdpbf16ps; never after a crash, a timeout, a refused
    tile state or a mismatch. The verdict is logged at INFO and kept on disk beside the
    compiled libraries, keyed by the CPU model and both libraries (delete the
    amx-verdict-*.json file to probe again)."""
    global _AMX_VERDICT
    if _AMX_VERDICT is None:
        _AMX_VERDICT = _amx_verdict()
        log.info("batchgen: AMX %s: %s", "verified" if _AMX_VERDICT[0] else "not used", _AMX_VERDICT[1])
    return _AMX_VERDICT


def _amx_verdict() -> tuple[str | None, str]:
    if "amx" not in supported_isas():
        return None, "this CPU has no AMX (amx_tile, amx_bf16), or torch's dispatch is limited below AVX-512"
    if os.environ.get("BATCHGEN_AMX_PROBING"):
        return None, "inside the AMX probe"
    try:
        amx, ref = build_library("amx"), build_library("avx512_bf16")
    except Unavailable as e:
        return None, f"the libraries could not be built ({e})"
    model = cpu_model()

    def probe() -> dict:
        order, why = run_amx_probe(amx, ref)
        return {"order": order, "why": f"{why} ({model or 'this CPU'})"}

    saved = cached_verdict("amx-verdict", f"{model}|amx|{amx.name}|{ref.name}", probe)
    try:
        return (saved["order"] if saved["order"] in AMX_ORDERS else None), str(saved["why"])
    except (KeyError, TypeError):
        return None, "the kept AMX verdict is unreadable (delete amx-verdict-*.json to probe again)"


def run_amx_probe(amx: Path, ref: Path, timeout: float | None = None,
                  env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """`_amx_probe(amx, ref)` in a subprocess, and `decide_amx`'s verdict on what it reports
    (a crash, even a SIGILL or SIGSEGV inside the tiles, stays in the subprocess)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **(env or {}), "BATCHGEN_ISA": "amx", "BATCHGEN_AMX_PROBING": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    code = "import sys; from engine.kernels.amx_probe import _amx_probe_main; _amx_probe_main(sys.argv[1], sys.argv[2])"
    timeout = _AMX_PROBE_TIMEOUT if timeout is None else timeout
    try:
        r = subprocess.run([sys.executable, "-c", code, str(amx), str(ref)], env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return decide_amx(None, timed_out=True, timeout=timeout)
    except OSError as e:
        return decide_amx(None, returncode=-1, output=f"could not start: {e}")
    report = None
    lines = r.stdout.strip().splitlines()
    if lines:
        try:
            report = json.loads(lines[-1])
        except ValueError:
            report = None
    return decide_amx(report, returncode=r.returncode, output=(r.stderr or r.stdout)[-600:])


def decide_amx(report: dict | None, returncode: int = 0, timed_out: bool = False, timeout: float = 0.0,
               output: str = "") -> tuple[str | None, str]:
    """The verdict (order or None, why) on the AMX probe's report (`_amx_probe`'s dict, None
    when it printed none) and how its subprocess ended."""
    if timed_out:
        return None, f"the AMX probe did not finish in {timeout:.0f} s"
    if returncode != 0:
        how = f"signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        tail = " ".join(output.strip().splitlines()[-3:])
        return None, f"the AMX probe crashed ({how}){': ' + tail if tail else ''}"
    if not isinstance(report, dict):
        return None, "the AMX probe reported nothing"
    if report.get("permission", -1) != 0:
        return None, (f"Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): "
                      f"{report.get('error') or report.get('permission')})")
    orders, cases = report.get("orders") or {}, int(report.get("cases") or 0)
    if cases <= 0 or any(o not in orders for o in AMX_ORDERS):
        return None, "the AMX probe's report is incomplete"
    match = [o for o in AMX_ORDERS if orders[o].get("mismatches") == 0]
    if not match:
        diffs = "; ".join(f"{o} pairs: {orders[o].get('mismatches')} of {cases} cases differ "
                          f"(first: {orders[o].get('first')})" for o in AMX_ORDERS)
        return None, f"AMX does not give avx512_bf16's bits in either pair order: {diffs}"
    order = match[0]
    if report.get("emulated"):
        return None, (f"emulated tiles (a BATCHGEN_AMX_EMULATE test build) give avx512_bf16's bits with {order} pairs "
                      f"on all {cases} cases; a test build is never used")
    ms = report.get("ms") or {}
    amx_ms, ref_ms = ms.get(order), ms.get("avx512_bf16")
    if not isinstance(amx_ms, (int, float)) or not isinstance(ref_ms, (int, float)):
        return None, "the AMX probe's report has no timings"
    timing = (f"a 128x2048x1024 product took {amx_ms:.2f} ms on AMX tiles and {ref_ms:.2f} ms with vdpbf16ps on "
              f"one thread")
    if amx_ms >= ref_ms:
        return None, f"AMX gives avx512_bf16's bits ({order} pairs, {cases} cases) but is not faster: {timing}"
    return order, f"AMX gives avx512_bf16's bits with {order} pairs on all {cases} cases; {timing}"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b bit for bit, except that any NaN equals any NaN."""
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    same = a.view(view) == b.view(view)
    return bool((same | (a.isnan() & b.isnan())).all())


def _amx_operands(kind: str, M: int, K: int, N: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 and w (N, K) bfloat16 of one kind of probe case."""
    def pow2(shape, lo, hi):
        e = torch.randint(lo, hi, shape, generator=g).to(torch.float32)
        s = torch.randint(0, 2, shape, generator=g).to(torch.float32) * 2 - 1
        return s * torch.exp2(e)

    if kind == "random":
        x = torch.randn(M, K, generator=g) * 2.0 ** float(torch.randint(-4, 5, (1,), generator=g))
        w = torch.randn(N, K, generator=g)
    elif kind == "special":
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        vals = torch.tensor([1e-39, -1e-39, 1e-40, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3e38, -3e38,
                             1e-30, -1e-30, 1e30, 2.0 ** -126, -(2.0 ** -126), 2.0 ** 127])
        for t in (x, w):
            hit = torch.rand(t.shape, generator=g) < 0.1
            t[hit] = vals[torch.randint(0, len(vals), (int(hit.sum()),), generator=g)]
    elif kind == "exponents":  # sums that overflow, underflow, flush and absorb
        x, w = pow2((M, K), -140, 128) * (1 + torch.rand(M, K, generator=g)), pow2((N, K), -140, 128)
    elif kind == "cancel":  # exact powers of two: each order of the adds rounds differently
        x, w = pow2((M, K), -20, 21), pow2((N, K), -2, 3)
        x[:, 1::4] = x[:, 0::4][:, :x[:, 1::4].shape[1]]
        w[:, 1::4] = -w[:, 0::4][:, :w[:, 1::4].shape[1]]  # pairs 0, 2, 4, ...: the two products cancel
    else:  # "tiny": every product is under 2^-126 and flushes to a signed zero: outputs +0 or -0
        x, w = pow2((M, K), -80, -64), pow2((N, K), -80, -64)
    return x, w.to(torch.bfloat16)


def _amx_probe(amx_path: str, ref_path: str) -> dict:
    """The AMX probe (run in a subprocess by `run_amx_probe`): the report `decide_amx` reads."""
    amx_lib = ctypes.CDLL(amx_path)
    rc = amx_lib.batchgen_amx_request()
    if rc != 0:
        return {"permission": rc, "error": os.strerror(rc)}
    ref = NativeKernels(ctypes.CDLL(ref_path), "avx512_bf16", Path(ref_path))
    builds = {o: NativeKernels(amx_lib, "amx", Path(amx_path), o) for o in AMX_ORDERS}
    report: dict = {"permission": 0, "emulated": builds["swapped"].amx_emulated,
                    "orders": {o: {"mismatches": 0, "first": None} for o in AMX_ORDERS}}
    g = torch.Generator().manual_seed(20261201)
    cases = 0
    # (M, K, N, kind, alt, threads); alt 0: float32 in and out, with bias; 1: bfloat16, none
    shapes = [(*s, kind, (i + j) % 2, 1) for i, s in enumerate(_AMX_SHAPES) for j, kind in enumerate(_AMX_KINDS)]
    shapes += [(300, 1024, 100, kind, alt, t) for kind, alt in (("random", 0), ("cancel", 1)) for t in (1, 2)]
    shapes += [(64, 2048, 33, "exponents", 0, 2)]
    for M, K, N, kind, alt, threads in shapes:
        x, w = _amx_operands(kind, M, K, N, g)
        b = torch.randn(N, generator=g) if alt == 0 else None
        xin = x if alt == 0 else x.to(torch.bfloat16)  # float32 activations rounded by the kernel, or bfloat16
        out = torch.float32 if alt == 0 or kind in ("tiny", "cancel") else torch.bfloat16
        want = ref.gemm(xin, ref.pack(w, b), out, threads)
        cases += 1
        for o, kern in builds.items():
            got = kern.gemm(xin, kern.pack(w, b), out, threads)
            if not _bits_equal(got, want):
                rep = report["orders"][o]
                rep["mismatches"] += 1
                if rep["first"] is None:
                    view = torch.int32 if out == torch.float32 else torch.int16
                    bad = ((got.view(view) != want.view(view)) & ~(got.isnan() & want.isnan())).nonzero()[0].tolist()
                    rep["first"] = (f"{kind} M={M} K={K} N={N} at {bad}: "
                                    f"{got[bad[0], bad[1]].item()!r} against {want[bad[0], bad[1]].item()!r}")
    report["cases"] = cases
    M, K, N = PROBE_SHAPE
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).to(torch.bfloat16)
    timed = {"avx512_bf16": (ref, ref.pack(w))} | {o: (k, k.pack(w)) for o, k in builds.items()
                                                   if report["orders"][o]["mismatches"] == 0}
    if len(timed) == 1:  # no order to time
        return report
    times = {name: float("inf") for name in timed}
    for i in range(4):  # interleaved, the first round to warm up
        for name, (kern, p) in timed.items():
            t0 = time.thread_time()
            kern.gemm(x, p, torch.float32, 1)
            if i:
                times[name] = min(times[name], time.thread_time() - t0)
    report["ms"] = {name: t * 1e3 for name, t in times.items()}
    return report


def _amx_probe_main(amx_path: str, ref_path: str) -> None:
    torch.set_num_threads(2)
    print(json.dumps(_amx_probe(amx_path, ref_path)), flush=True)
