"""The engine's compiled CPU kernels (engine/kernels/csrc/), one shared library: the matrix multiply
of every projection and the head (gemm.cpp; gemm_amx.cpp in the `amx` build), prefill and
decode attention over the KV arena (prefill_attention.cpp, decode_attention.cpp), the fused
per-row operations of a Llama-family layer (layer_ops.cpp: RMSNorm with its residual add,
rotary embedding, SwiGLU gating), and the sampler's passes over the vocabulary
(sampling_ops.cpp: top-k, logsumexp). This module decides which build a process uses and
loads it once; build.py compiles it, library.py binds its functions, amx_probe.py decides
whether the `amx` build's tiles may be used.

Why compiled: a library GEMM's or attention kernel's rows move with the row count and the
instruction set (gemm.cpp's header), so the engine owns the reduction order of its products;
torch's CPU flash kernel costs tens of microseconds per call where a decode step needs one
call per layer; torch runs a norm or a gating as 3-10 kernels, each a pass over memory.
Every function's result for a row is independent of the batch and the thread count by
construction (see the sources' headers), and the same on every instruction set.

`native_isa()` picks the widest build the CPU has and torch's own dispatch allows
(build.py's `ISAS`), `amx` only once verified; `BATCHGEN_ISA` names one (it must be
supported, and `amx` verified). A build's results are bit-identical to every other build's:
the choice changes speed, never a sample. Where the library cannot be built or loaded (no
compiler, not x86-64 with AVX2, `BATCHGEN_NATIVE=0`), `native_kernels()` returns None and the
engine uses torch's operations (engine/kernels/attention.py, engine/models/layers.py,
engine/models/base.py): the same results to about 1e-6, slower, and batch-invariant only as
far as torch's kernels happen to be on that machine (docs/architecture.md, the engine).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import torch

from engine.kernels.amx_probe import PROBE_SHAPE, amx_verdict
from engine.kernels.build import ISAS, Unavailable, build_library, cached_verdict, cpu_model, supported_isas
from engine.kernels.library import NativeKernels, PackedWeight

__all__ = ["native_kernels", "native_isa", "bfloat16_is_faster", "NativeKernels", "PackedWeight", "ISAS",
           "supported_isas"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_libraries: dict[str, "NativeKernels | None"] = {}  # by ISA; None: tried and unavailable
_isa_choice: "str | None | bool" = False  # False: not decided yet


def native_kernels(isa: str | None = None) -> NativeKernels | None:
    """The compiled library for `isa` (default `native_isa()`), built and loaded once per
    process and ISA; None where it is unavailable (the reason is logged once at INFO). Tests
    load a narrower ISA beside the native one to compare their bits. The `amx` build's
    bfloat16 GEMMs use AMX tiles only with the pair order `amx_verdict()` verified (and once
    Linux grants the tile state); else they run on vdpbf16ps, as in the avx512_bf16 build."""
    if isa is None:
        isa = native_isa()
        if isa is None:
            return None
    if isa not in _libraries:
        with _lock:
            if isa not in _libraries:
                try:
                    path = build_library(isa)
                    lib = ctypes.CDLL(str(path))
                    order = amx_verdict()[0] if isa == "amx" else None
                    rc = lib.batchgen_amx_request() if order is not None else 0
                    if rc != 0:  # e.g. ENOSPC: a sigaltstack too small for the tile state
                        log.info("batchgen: Linux refused the AMX tile state in this process (%s); bfloat16 GEMMs "
                                 "on vdpbf16ps", os.strerror(rc))
                        order = None
                    _libraries[isa] = NativeKernels(lib, isa, path, order)
                except (Unavailable, OSError, AttributeError) as e:  # OSError, AttributeError: a bad library
                    log.info("batchgen: compiled kernels (%s) unavailable (%s); using torch's kernels", isa, e)
                    _libraries[isa] = None
    return _libraries[isa]


def native_isa() -> str | None:
    """The ISA the engine's kernels use in this process: `$BATCHGEN_ISA` when set, else the
    widest of `supported_isas()`, except `amx` unless `amx_verdict()` verified it (then
    `avx512_bf16`, the reason logged at INFO); None when there is none (or
    `BATCHGEN_NATIVE=0`). Raises ValueError for a `BATCHGEN_ISA` this machine cannot run,
    and for `BATCHGEN_ISA=amx` where AMX is unverified. Decided once per process."""
    global _isa_choice
    if _isa_choice is False:
        want = os.environ.get("BATCHGEN_ISA")
        have = supported_isas()
        if os.environ.get("BATCHGEN_NATIVE", "1") == "0":
            _isa_choice = None
        elif want:
            if want not in ISAS:
                raise ValueError(f"BATCHGEN_ISA={want!r}: not one of {', '.join(ISAS)}")
            if want not in have:
                raise ValueError(f"BATCHGEN_ISA={want!r}: this machine supports {have or 'none of them'}")
            if want == "amx":
                order, why = amx_verdict()
                if order is None:
                    raise ValueError(f"BATCHGEN_ISA=amx: AMX is not verified on this machine ({why})")
            _isa_choice = want
        else:
            _isa_choice = have[-1] if have else None
            if _isa_choice == "amx":
                order, why = amx_verdict()
                if order is None:
                    log.info("batchgen: using avx512_bf16, not amx: %s", why)
                    _isa_choice = "avx512_bf16"
    return _isa_choice


_BF16_PROBE: "tuple[bool, str] | None" = None


def bfloat16_is_faster() -> tuple[bool, str]:
    """(whether bfloat16 GEMMs beat float32 ones here by a clear margin, why) for `dtype:
    auto` on CPU. Only a build with vdpbf16ps (`avx512_bf16`) can win: elsewhere bfloat16 is
    emulated at float32's rate. There a probe times a 128 x 2048 x 1024 product both ways on
    one thread, in the thread's CPU time (so another process on the same cores does not
    skew it; best of 5, float32 activations as a step has them), and picks bfloat16 when it
    takes under 0.8x float32's time (vdpbf16ps does twice the products of an FMA). The
    verdict is kept on disk beside the compiled library, keyed by the CPU model, the ISA
    and the library, so a machine decides once: the same config does not change dtype from
    one run to the next."""
    global _BF16_PROBE
    if _BF16_PROBE is None:
        _BF16_PROBE = _probe_bf16()
    return _BF16_PROBE


def _probe_bf16() -> tuple[bool, str]:
    kernels = native_kernels()
    if kernels is None:
        return False, "the compiled kernels are unavailable, so bfloat16 would run on torch's emulated kernels"
    if not kernels.native_bf16:
        return False, f"this CPU has no AVX-512 BF16 ({kernels.isa}): bfloat16 products would be emulated"
    model = cpu_model()

    def probe() -> dict:
        M, K, N = PROBE_SHAPE
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        packed = {dt: kernels.pack(w.to(dt)) for dt in (torch.float32, torch.bfloat16)}
        times = {dt: float("inf") for dt in packed}
        for i in range(6):  # interleaved, the first round to warm up
            for dt, p in packed.items():
                t0 = time.thread_time()
                kernels.gemm(x, p, torch.float32, 1)
                if i:
                    times[dt] = min(times[dt], time.thread_time() - t0)
        return {"bfloat16": times[torch.bfloat16] < 0.8 * times[torch.float32],
                "why": (f"{kernels.isa}: a {M}x{K}x{N} product took {times[torch.bfloat16] * 1e3:.2f} ms in bfloat16 "
                        f"and {times[torch.float32] * 1e3:.2f} ms in float32 on one thread of {model or 'this CPU'}")}

    saved = cached_verdict("dtype-auto", f"{model}|{kernels.isa}|{kernels.path.name}", probe)
    try:
        faster, why = bool(saved["bfloat16"]), str(saved["why"])
    except (KeyError, TypeError):
        faster, why = False, "the kept dtype-auto verdict is unreadable (delete dtype-auto-*.json to decide again)"
    return faster, why
