"""The engine's compiled CPU kernels (engine/csrc/), one shared library: decode attention
(decode_attention.cpp), the fused per-row operations of a Llama-family layer
(layer_ops.cpp: RMSNorm with its residual add, rotary embedding, SwiGLU gating), and the
sampler's passes over the vocabulary (sampling_ops.cpp: top-k, logsumexp).

Torch's CPU flash kernel costs tens of microseconds per call and a decode step makes one
call per prompt and cohort per layer; the C++ kernel attends a whole step's rows in one call
per layer, reading each prompt's keys once for all its samples and storing the step's keys
and values itself. Torch runs a norm or a gating as 3-10 kernels, each a pass over memory
with its own temporary; fused, each is one pass. Every function's result for a row is
independent of the batch by construction (see the sources' headers).

The library is compiled on first use with the system's C++ compiler (`$CXX`, else `c++`;
about two seconds, no torch headers) into a cache directory keyed by the sources' hash, the
flags and the compiler (`$BATCHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/batchgen`, else
`~/.cache/batchgen`), and loaded with ctypes. It needs x86-64 with AVX2 and FMA (torch's
CPU capability AVX2 or AVX512). Where it cannot be built or loaded (no compiler, another
CPU, `BATCHGEN_NATIVE=0`), `native_kernels()` returns None and the engine uses torch's
operations (engine/attention.py, engine/models/layers.py): the same results to about 1e-6,
slower.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"  # every .cpp in it is compiled into one library; the .h are shared
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

_lock = threading.Lock()
_library: "NativeKernels | None | bool" = False  # False: not tried yet

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


class NativeKernels:
    """The loaded library's functions, with tensor arguments. Each checks nothing the caller
    can check more cheaply: shapes, contiguity, float32 and bounds are the caller's (the
    docstrings say what). All run on `threads` threads (OpenMP, the runtime torch uses) and
    are batch-invariant: a row's result depends only on that row (see the sources)."""

    def __init__(self, lib: ctypes.CDLL):
        self._attention = lib.batchgen_decode_attention
        self._attention.argtypes = [_p, _i64, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _f32, _int,
                                    _p, _p, _i64, _p, _i64]
        self._attention.restype = _int
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

    def supports(self, head_dim: int) -> bool:
        """Whether decode attention handles head_dim: 32, 64, 80, 96, 128."""
        return bool(self._supports(head_dim))

    def decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seg: torch.Tensor,
                         group_ptr: torch.Tensor, order: torch.Tensor, threads: int,
                         new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode attention of every row (engine/csrc/decode_attention.cpp).

        q: (B, Hq, D) float32 whose last two dims are contiguous (rows may be strided, as
        the q part of a fused qkv projection is); kc, vc: one layer's contiguous (positions,
        Hkv, D) float32 arena; seg (B, 4) int64 rows of (prompt start, prompt length, own
        start, own length) in arena positions, every run inside the arena; group_ptr (G + 1,)
        and order (B,) int64: group i is rows order[group_ptr[i]:group_ptr[i + 1]], which
        share their prompt run. new_kv: (k, v, write), this step's keys and values (B, Hkv,
        D) (last two dims contiguous, rows strided alike) stored first at arena positions
        write (B,) int64, each inside its row's own run. Returns (B, Hq, D) float32, scale
        1/sqrt(D). The caller guarantees the bounds: the kernel reads and writes what it is told.
        """
        B, Hq, D = q.shape
        out = q.new_empty(B, Hq, D)
        k, v, write = new_kv if new_kv is not None else (None, None, None)
        kv_ld = 0 if k is None else k.stride(0)
        rc = _call("batchgen::decode_attention", self._attention, q.data_ptr(), q.stride(0), kc.data_ptr(),
                   vc.data_ptr(), out.data_ptr(), seg.data_ptr(), group_ptr.data_ptr(), order.data_ptr(),
                   group_ptr.numel() - 1, Hq, kc.shape[1], D, D ** -0.5, threads, _ptr(k), _ptr(v), kv_ld,
                   _ptr(write), B)
        if rc != 0:
            raise ValueError(f"decode attention kernel: head_dim {D} is not supported")
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


def native_kernels() -> NativeKernels | None:
    """The compiled library, built and loaded once per process; None where it is unavailable
    (the reason is logged once at INFO)."""
    global _library
    if _library is False:
        with _lock:
            if _library is False:
                try:
                    _library = NativeKernels(ctypes.CDLL(str(_build())))
                except (_Unavailable, OSError, AttributeError) as e:  # OSError, AttributeError: a bad library
                    log.info("batchgen: compiled kernels unavailable (%s); using torch's kernels", e)
                    _library = None
    return _library


class _Unavailable(Exception):
    pass


def _cache_dir() -> Path:
    if os.environ.get("BATCHGEN_CACHE_DIR"):
        return Path(os.environ["BATCHGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgen"


def _build() -> Path:
    """Path of the shared library, compiled if the cache lacks it (raises _Unavailable)."""
    if os.environ.get("BATCHGEN_NATIVE", "1") == "0":
        raise _Unavailable("BATCHGEN_NATIVE=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise _Unavailable(f"{platform.machine()} is not x86-64")
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        raise _Unavailable(f"CPU capability {cap}, AVX2 needed")
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise _Unavailable(f"no C++ compiler ({cxx})")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"{cxx} --version failed: {e}") from None
    sources = sorted(CSRC.glob("*.cpp"))
    key = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in sources + sorted(CSRC.glob("*.h")))
                         + " ".join(FLAGS).encode()
                         + version.encode()).hexdigest()[:16]
    target = _cache_dir() / f"batchgen_kernels-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename into place: processes that build at once (the
        # workers of one machine) each get a whole file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            res = subprocess.run([cxx, *FLAGS, "-o", str(out), *map(str, sources)], capture_output=True,
                                 text=True, timeout=300)
            if res.returncode != 0:
                raise _Unavailable(f"{cxx} failed: {res.stderr.strip()[-500:]}")
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building in {target.parent} failed: {e}") from None
    return target
