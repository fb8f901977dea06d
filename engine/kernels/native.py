"""The engine's compiled CPU kernels (engine/kernels/csrc/), one shared library: the matrix multiply
of every projection and the head (gemm.cpp; gemm_amx.cpp in the `amx` build), prefill and
decode attention over the KV arena (prefill_attention.cpp, decode_attention.cpp), the fused
per-row operations of a Llama-family layer (layer_ops.cpp: RMSNorm with its residual add,
rotary embedding, SwiGLU gating), and the sampler's passes over the vocabulary
(sampling_ops.cpp: top-k, logsumexp).

Why compiled: a library GEMM's or attention kernel's rows move with the row count and the
instruction set (gemm.cpp's header), so the engine owns the reduction order of its products;
torch's CPU flash kernel costs tens of microseconds per call where a decode step needs one
call per layer; torch runs a norm or a gating as 3-10 kernels, each a pass over memory.
Every function's result for a row is independent of the batch and the thread count by
construction (see the sources' headers), and the same on every instruction set below.

Instruction sets (`ISAS`): the library is built for one of
- `avx2`: x86-64 with AVX2 and FMA (Haswell, Zen 1-3);
- `avx512`: and AVX-512 F/BW/DQ/VL (Skylake-SP, Ice Lake): 16-lane GEMM tiles;
- `avx512_bf16`: and AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4-5): bfloat16
  products with vdpbf16ps, which the other builds compute bit for bit with two fused
  multiply-adds;
- `amx`: and AMX-TILE, AMX-BF16 (Sapphire Rapids and later): bfloat16-weight GEMMs on AMX
  tiles (gemm_amx.cpp; float32 ones as in avx512_bf16). Not trusted on paper: the first
  process on a machine runs `amx_verdict()`'s probe in a subprocess, which compares both
  pair packings bit for bit with the avx512_bf16 build on random and special operands;
  AMX is used only with a packing that matches on every case and runs faster, else the
  process uses avx512_bf16 (a crash, a timeout or a refused tile state included). The
  verdict is logged at INFO and kept on disk.
`native_isa()` picks the widest the CPU has (CPUID flags, from /proc/cpuinfo) that torch's
own dispatch also allows, so `ATEN_CPU_CAPABILITY=avx2` limits both (and `amx` only once
verified); `BATCHGEN_ISA` names one (it must be supported, and `amx` verified). A build's
results are bit-identical to every other build's: the choice changes speed, never a sample.

The library is compiled on first use with the system's C++ compiler (`$CXX`, else `c++`;
a few seconds, no torch headers) into a cache directory keyed by the sources' hash, the
ISA's flags and the compiler (`$BATCHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/batchgen`, else
`~/.cache/batchgen`), and loaded with ctypes. Where it cannot be built or loaded (no
compiler, not x86-64 with AVX2, `BATCHGEN_NATIVE=0`), `native_kernels()` returns None and the
engine uses torch's operations (engine/kernels/attention.py, engine/models/layers.py,
engine/models/base.py): the same results to about 1e-6, slower, and batch-invariant only as
far as torch's kernels happen to be on that machine (README, "Batch invariance").
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"  # every .cpp in it is compiled into one library; the .h are shared
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
# Narrowest first: each ISA's compiler flags and the /proc/cpuinfo flags it needs.
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "avx512": (("-mavx2", "-mfma", "-mf16c", *_AVX512), ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                                                         "avx512vl")),
    "avx512_bf16": (("-mavx2", "-mfma", "-mf16c", *_AVX512, "-mavx512bf16"),
                    ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")),
    # the avx512_bf16 build plus gemm_amx.cpp's kernel for bfloat16 weights, used only once
    # verified (`amx_verdict`)
    "amx": (("-mavx2", "-mfma", "-mf16c", *_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "amx_tile",
             "amx_bf16")),
}
# gemm_amx.cpp's pair orders (its `swap`): "swapped" packs each pair (odd, even), which is the
# chain if TDPBF16PS adds element 0's product first (the intrinsics guide's pseudo-code);
# "unswapped" packs (even, odd), the chain if it adds element 1's first.
AMX_ORDERS = ("swapped", "unswapped")

_lock = threading.Lock()
_libraries: dict[str, "NativeKernels | None"] = {}  # by ISA; None: tried and unavailable

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _call(name: str, fn, *args):
    """fn(*args), inside a record_function(name) range while torch.profiler records (a range
    costs about 8 us, more than some of these calls)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


_GEMM_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight (N, K) in gemm.cpp's panel layout, made by `NativeKernels.pack`: `data` the
    packed bytes (uint8), `dtype` the weight's (float32 or bfloat16), `bias` (N,) float32 or
    None (a bfloat16 bias is widened once here: the kernel adds it in float32)."""

    data: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype
    bias: torch.Tensor | None
    amx_order: str | None = None  # packed in gemm_amx.cpp's B tiles with this pair order

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class NativeKernels:
    """The loaded library's functions, with tensor arguments. Each checks nothing the caller
    can check more cheaply: shapes, contiguity, dtypes and bounds are the caller's (the
    docstrings say what). All run on `threads` threads (OpenMP, the runtime torch uses) and
    are batch-invariant: a row's result depends only on that row (see the sources).
    `isa`: the instruction set the library was built for (`ISAS`); `path`: its file;
    `amx_order`: in the `amx` build, the verified pair order (`AMX_ORDERS`) with which
    bfloat16 weights are packed for and multiplied on AMX tiles (gemm_amx.cpp), None to keep
    them on vdpbf16ps (gemm.cpp) as the avx512_bf16 build does."""

    def __init__(self, lib: ctypes.CDLL, isa: str, path: Path, amx_order: str | None = None):
        self.isa, self.path = isa, path
        if amx_order is not None and amx_order not in AMX_ORDERS:
            raise ValueError(f"amx_order must be one of {AMX_ORDERS} or None, got {amx_order!r}")
        self.has_amx = hasattr(lib, "batchgen_gemm_amx")  # gemm_amx.cpp is compiled in
        if amx_order is not None and not self.has_amx:
            raise ValueError(f"{path.name} has no AMX kernel")
        self.amx_order = amx_order
        if self.has_amx:
            self._amx_request = lib.batchgen_amx_request
            self._amx_request.argtypes = []
            self._amx_request.restype = _int
            self._amx_packed_bytes = lib.batchgen_gemm_amx_packed_bytes
            self._amx_packed_bytes.argtypes = [_i64, _i64]
            self._amx_packed_bytes.restype = _i64
            self._amx_pack = lib.batchgen_gemm_amx_pack
            self._amx_pack.argtypes = [_p, _i64, _i64, _i64, _int, _p]
            self._amx_pack.restype = None
            self._gemm_amx = lib.batchgen_gemm_amx
            self._gemm_amx.argtypes = [_p, _int, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _int, _int, _int]
            self._gemm_amx.restype = _int
            self.amx_emulated = bool(lib.batchgen_amx_emulated())
        self._gemm = lib.batchgen_gemm
        self._gemm.argtypes = [_p, _int, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _int, _int, _int]
        self._gemm.restype = None
        self._pack = lib.batchgen_gemm_pack
        self._pack.argtypes = [_p, _i64, _i64, _i64, _int, _p]
        self._pack.restype = None
        self._packed_bytes = lib.batchgen_gemm_packed_bytes
        self._packed_bytes.argtypes = [_i64, _i64, _int]
        self._packed_bytes.restype = _i64
        self.native_bf16 = bool(lib.batchgen_gemm_native_bf16())
        self._attention = lib.batchgen_decode_attention
        self._attention.argtypes = [_p, _i64, _p, _p, _int, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _f32, _int,
                                    _p, _p, _i64, _p, _i64]
        self._attention.restype = _int
        self._prefill = lib.batchgen_prefill_attention
        self._prefill.argtypes = [_p, _i64, _i64, _p, _p, _int, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _p,
                                  _int]
        self._prefill.restype = _int
        self._supports = lib.batchgen_decode_attention_supports
        self._supports.argtypes = [_i64]
        self._supports.restype = _int
        self._add_rms_norm = lib.batchgen_add_rms_norm
        self._add_rms_norm.argtypes = [_p, _p, _p, _p, _p, _i64, _i64, _f32, _int]
        self._add_rms_norm.restype = None
        self._rotary = lib.batchgen_rotary
        self._rotary.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _f32, _int]
        self._rotary.restype = None
        self._silu_mul = lib.batchgen_silu_mul
        self._silu_mul.argtypes = [_p, _p, _i64, _i64, _int]
        self._silu_mul.restype = None
        self._topk = lib.batchgen_topk
        self._topk.argtypes = [_p, _i64, _i64, _i64, _int, _p, _p, _int]
        self._topk.restype = None
        self._logsumexp = lib.batchgen_logsumexp
        self._logsumexp.argtypes = [_p, _i64, _i64, _i64, _p, _int]
        self._logsumexp.restype = None

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """gemm.cpp's packed form of weight (N, K) float32 or bfloat16 (K even for bfloat16;
        rows may be strided, the last dim contiguous) and its bias (N,) or None. Raises
        ValueError for another dtype or an odd K in bfloat16."""
        if weight.dtype not in _GEMM_DTYPES or weight.dim() != 2:
            raise ValueError(f"gemm: weight must be a 2-d float32 or bfloat16 tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        n, k = weight.shape
        if weight.dtype == torch.bfloat16 and k % 2:
            raise ValueError(f"gemm: a bfloat16 weight needs an even K, got {k}")
        w = weight.detach()
        if w.stride(1) != 1:
            w = w.contiguous()
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if w.dtype == torch.bfloat16 and self.amx_order is not None:
            data = torch.empty(self._amx_packed_bytes(n, k), dtype=torch.uint8)
            self._amx_pack(w.data_ptr(), w.stride(0), n, k, int(self.amx_order == "swapped"), data.data_ptr())
            return PackedWeight(data, n, k, w.dtype, b, self.amx_order)
        code = _GEMM_DTYPES[w.dtype]
        data = torch.empty(self._packed_bytes(n, k, code), dtype=torch.uint8)
        self._pack(w.data_ptr(), w.stride(0), n, k, code, data.data_ptr())
        return PackedWeight(data, n, k, w.dtype, b)

    def gemm(self, x: torch.Tensor, w: PackedWeight, out_dtype: torch.dtype, threads: int) -> torch.Tensor:
        """x (M, K) @ W.T + bias, x with a contiguous last dim (rows may be strided) in the
        weight's dtype or float32 (a bfloat16 weight's float32 activations are rounded to
        bfloat16 first, as `.to(torch.bfloat16)` rounds); returns (M, N) of out_dtype
        (float32, or bfloat16 for a bfloat16 weight). Each element is one fused multiply-add
        chain over K in order (gemm.cpp), so a row's bits depend on that row alone, on any
        ISA and thread count. A weight packed for AMX tiles (`amx_order`) runs on them
        (gemm_amx.cpp; RuntimeError if Linux refuses the tile state)."""
        M = x.shape[0]
        y = torch.empty(M, w.n, dtype=out_dtype)
        if w.amx_order is not None:
            if not self.has_amx:
                raise ValueError(f"gemm: a weight packed for AMX tiles, and {self.path.name} has no AMX kernel")
            rc = _call("batchgen::gemm_amx", self._gemm_amx, x.data_ptr(), _GEMM_DTYPES[x.dtype], x.stride(0), M,
                       w.k, w.data.data_ptr(), w.n, _ptr(w.bias), y.data_ptr(), w.n, _GEMM_DTYPES[out_dtype], threads,
                       int(w.amx_order == "swapped"))
            if rc != 0:
                raise RuntimeError(f"gemm: Linux refused the AMX tile state ({os.strerror(rc)})")
            return y
        _call("batchgen::gemm", self._gemm, x.data_ptr(), _GEMM_DTYPES[x.dtype], x.stride(0), M, w.k,
              w.data.data_ptr(), w.n, _ptr(w.bias), y.data_ptr(), w.n, _GEMM_DTYPES[w.dtype],
              _GEMM_DTYPES[out_dtype], threads)
        return y

    def supports(self, head_dim: int) -> bool:
        """Whether decode and prefill attention handle head_dim: every multiple of 8 up to
        128, and 160, 192, 256."""
        return bool(self._supports(head_dim))

    def decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seg: torch.Tensor,
                         group_ptr: torch.Tensor, order: torch.Tensor, threads: int,
                         new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode attention of every row (engine/kernels/csrc/decode_attention.cpp).

        q: (B, Hq, D) float32 whose last two dims are contiguous (rows may be strided, as
        the q part of a fused qkv projection is); kc, vc: one layer's contiguous (positions,
        Hkv, D) arena, float32 or bfloat16 (each key and value widened to float32 as read);
        seg (B, 4) int64 rows of (prompt start, prompt length, own start, own length) in
        arena positions, every run inside the arena; group_ptr (G + 1,) and order (B,)
        int64: group i is rows order[group_ptr[i]:group_ptr[i + 1]], which share their
        prompt run. new_kv: (k, v, write), this step's keys and values (B, Hkv, D) float32
        (last two dims contiguous, rows strided alike) stored first (rounded to bfloat16 as
        torch rounds, into a bfloat16 arena) at arena positions write (B,) int64, each inside
        its row's own run. Returns (B, Hq, D) float32, scale 1/sqrt(D). The caller
        guarantees the bounds: the kernel reads and writes what it is told.
        """
        B, Hq, D = q.shape
        out = q.new_empty(B, Hq, D)
        k, v, write = new_kv if new_kv is not None else (None, None, None)
        kv_ld = 0 if k is None else k.stride(0)
        rc = _call("batchgen::decode_attention", self._attention, q.data_ptr(), q.stride(0), kc.data_ptr(),
                   vc.data_ptr(), int(kc.dtype == torch.bfloat16), out.data_ptr(), seg.data_ptr(),
                   group_ptr.data_ptr(), order.data_ptr(),
                   group_ptr.numel() - 1, Hq, kc.shape[1], D, D ** -0.5, threads, _ptr(k), _ptr(v), kv_ld,
                   _ptr(write), B)
        if rc != 0:
            raise ValueError(f"decode attention kernel: head_dim {D} is not supported")
        return out

    def prefill_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, starts: torch.Tensor,
                          lengths: torch.Tensor, window: int | None, threads: int) -> torch.Tensor:
        """Causal prefill attention of every prompt token to its prompt's keys, read from
        the arena (engine/kernels/csrc/prefill_attention.cpp).

        q: (B, T, Hq, D) float32 with its last two dims contiguous (tokens and prompts may be
        strided, as the q part of a fused qkv projection is); kc, vc: one layer's contiguous
        (positions, Hkv, D) arena, float32 or bfloat16, holding prompt b at positions
        starts[b] .. starts[b] + lengths[b] - 1 (starts, lengths: (B,) int64, lengths <= T);
        window: a query at t sees keys t - window .. t (None: all). Returns (B, T, Hq, D)
        float32, zeros past each prompt's length; scale 1/sqrt(D). Raises ValueError for an
        unsupported head_dim (`supports`)."""
        B, T, Hq, D = q.shape
        out = torch.empty(B, T, Hq, D)
        rc = _call("batchgen::prefill_attention", self._prefill, q.data_ptr(), q.stride(1), q.stride(0),
                   kc.data_ptr(), vc.data_ptr(), int(kc.dtype == torch.bfloat16), starts.data_ptr(),
                   lengths.data_ptr(), B, T, Hq, kc.shape[1], D, -1 if window is None else window, D ** -0.5,
                   out.data_ptr(), threads)
        if rc != 0:
            raise ValueError(f"prefill attention kernel: head_dim {D} is not supported")
        return out

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, rms_norm(x + y) * weight), or (x, rms_norm(x) * weight) when y is None:
        x, y (..., C) contiguous float32, weight (C,). Returns two new (..., C) tensors (the
        first is x itself when y is None)."""
        C = x.shape[-1]
        xo = x if y is None else torch.empty_like(x)
        out = torch.empty_like(x)
        _call("batchgen::rms_norm", self._add_rms_norm, x.data_ptr(), _ptr(y), xo.data_ptr(), weight.data_ptr(),
              out.data_ptr(), x.numel() // C, C, eps, threads)
        return xo, out

    def rotary(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               norm_weight: torch.Tensor | None, eps: float, threads: int) -> None:
        """In place: rotary embedding of the first `heads` heads of x (rows, >= heads, D)
        (last two dims contiguous), each first RMS-normed with norm_weight (heads, D) when
        given. cos, sin: (positions, D/2) contiguous float32 tables; positions: (rows,) int64
        contiguous, each < the tables' length."""
        rows, _, D = x.shape
        _call("batchgen::rotary", self._rotary, x.data_ptr(), rows, x.stride(0), heads, D, cos.data_ptr(),
              sin.data_ptr(), positions.data_ptr(), _ptr(norm_weight), eps, threads)

    def silu_mul(self, gate_up: torch.Tensor, threads: int) -> torch.Tensor:
        """silu(gate) * up of gate_up (..., 2I) contiguous float32 = cat(gate, up): (..., I)."""
        I = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], I)
        _call("batchgen::silu_mul", self._silu_mul, gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * I), I,
              threads)
        return out

    def topk(self, x: torch.Tensor, k: int, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.topk(x, k) of x (B, V) float32 with contiguous rows, 1 <= k <= V: (values (B,
        k) float32, ids (B, k) int64), largest first, equal values by smaller id, NaN first."""
        B, V = x.shape
        vals = x.new_empty(B, k)
        idx = torch.empty(B, k, dtype=torch.int64)
        _call("batchgen::topk", self._topk, x.data_ptr(), B, V, x.stride(0), k, vals.data_ptr(), idx.data_ptr(),
              threads)
        return vals, idx

    def logsumexp(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """torch.logsumexp(x, -1) of x (B, V) float32 with contiguous rows: (B,) float32."""
        B, V = x.shape
        out = x.new_empty(B)
        _call("batchgen::logsumexp", self._logsumexp, x.data_ptr(), B, V, x.stride(0), out.data_ptr(), threads)
        return out


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
                    path = _build(isa)
                    lib = ctypes.CDLL(str(path))
                    order = amx_verdict()[0] if isa == "amx" else None
                    rc = lib.batchgen_amx_request() if order is not None else 0
                    if rc != 0:  # e.g. ENOSPC: a sigaltstack too small for the tile state
                        log.info("batchgen: Linux refused the AMX tile state in this process (%s); bfloat16 GEMMs "
                                 "on vdpbf16ps", os.strerror(rc))
                        order = None
                    _libraries[isa] = NativeKernels(lib, isa, path, order)
                except (_Unavailable, OSError, AttributeError) as e:  # OSError, AttributeError: a bad library
                    log.info("batchgen: compiled kernels (%s) unavailable (%s); using torch's kernels", isa, e)
                    _libraries[isa] = None
    return _libraries[isa]


class _Unavailable(Exception):
    pass


_isa_choice: "str | None | bool" = False  # False: not decided yet


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where unreadable."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported_isas() -> list[str]:
    """The ISAs of `ISAS` this machine can run, narrowest first: what CPUID reports (on Linux;
    elsewhere, torch's CPU capability alone, without bf16), cut to what torch's own dispatch
    allows (`ATEN_CPU_CAPABILITY=avx2` leaves only `avx2`). Empty off x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    cap = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo: trust torch's capability, which never reports bf16
        return {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}.get(cap, [])
    out = [isa for isa, (_, need) in ISAS.items() if all(f in flags for f in need)]
    return out[:1] if cap == "AVX2" else out if cap == "AVX512" else []


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


# ---------------------------------------------------------------- AMX verification
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
        amx, ref = _build("amx"), _build("avx512_bf16")
    except _Unavailable as e:
        return None, f"the libraries could not be built ({e})"
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith("model name")), "")
    key = hashlib.sha256(f"{model}|amx|{amx.name}|{ref.name}".encode()).hexdigest()[:16]
    verdict = _cache_dir() / f"amx-verdict-{key}.json"
    try:
        saved = json.loads(verdict.read_text())
        return (saved["order"] if saved["order"] in AMX_ORDERS else None), str(saved["why"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    order, why = run_amx_probe(amx, ref)
    why = f"{why} ({model or 'this CPU'})"
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        tmp = verdict.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"order": order, "why": why}))
        os.replace(tmp, verdict)
    except OSError:
        pass
    return order, why


def run_amx_probe(amx: Path, ref: Path, timeout: float | None = None,
                  env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """`_amx_probe(amx, ref)` in a subprocess, and `decide_amx`'s verdict on what it reports
    (a crash, even a SIGILL or SIGSEGV inside the tiles, stays in the subprocess)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, **(env or {}), "BATCHGEN_ISA": "amx", "BATCHGEN_AMX_PROBING": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    code = "import sys; from engine.kernels.native import _amx_probe_main; _amx_probe_main(sys.argv[1], sys.argv[2])"
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
    M, K, N = _PROBE_SHAPE
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


_BF16_PROBE: "tuple[bool, str] | None" = None
_PROBE_SHAPE = (128, 2048, 1024)  # rows x K x N: a decode step's projection


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
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith("model name")), "")
    key = hashlib.sha256(f"{model}|{kernels.isa}|{kernels.path.name}".encode()).hexdigest()[:16]
    verdict = _cache_dir() / f"dtype-auto-{key}.json"
    try:
        saved = json.loads(verdict.read_text())
        return bool(saved["bfloat16"]), str(saved["why"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    M, K, N = _PROBE_SHAPE
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
    faster = times[torch.bfloat16] < 0.8 * times[torch.float32]
    why = (f"{kernels.isa}: a {M}x{K}x{N} product took {times[torch.bfloat16] * 1e3:.2f} ms in bfloat16 and "
           f"{times[torch.float32] * 1e3:.2f} ms in float32 on one thread of {model or 'this CPU'}")
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        tmp = verdict.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bfloat16": faster, "why": why}))
        os.replace(tmp, verdict)
    except OSError:
        pass
    return faster, why


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _cache_dir() -> Path:
    if os.environ.get("BATCHGEN_CACHE_DIR"):
        return Path(os.environ["BATCHGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgen"


def _build(isa: str, require_cpu: bool = True, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the shared library for `isa`, compiled if the cache lacks it (raises
    _Unavailable). require_cpu=False builds for an ISA this CPU cannot run (to check that
    it compiles; loading it is safe, calling it is not); extra_flags: more compiler flags
    (tests: -DBATCHGEN_AMX_EMULATE), in the file's name and key."""
    if os.environ.get("BATCHGEN_NATIVE", "1") == "0":
        raise _Unavailable("BATCHGEN_NATIVE=0")
    if require_cpu and isa not in supported_isas():
        raise _Unavailable(f"this CPU does not run {isa} (it runs {supported_isas() or 'none of ' + str(list(ISAS))})")
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise _Unavailable(f"no C++ compiler ({cxx})")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"{cxx} --version failed: {e}") from None
    sources = sorted(CSRC.glob("*.cpp"))
    flags = (*FLAGS, *ISAS[isa][0], *extra_flags)
    key = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in sources + sorted(CSRC.glob("*.h")))
                         + " ".join(flags).encode()
                         + version.encode()).hexdigest()[:16]
    tag = isa + "".join("-" + f.lstrip("-").split("=")[0].lower() for f in extra_flags)
    target = _cache_dir() / f"batchgen_kernels-{tag}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename into place: processes that build at once (the
        # workers of one machine) each get a whole file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            res = subprocess.run([cxx, *flags, "-o", str(out), *map(str, sources)], capture_output=True,
                                 text=True, timeout=300)
            if res.returncode != 0:
                raise _Unavailable(f"{cxx} failed: {res.stderr.strip()[-500:]}")
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building in {target.parent} failed: {e}") from None
    return target
