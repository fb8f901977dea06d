"""The engine's one compiled kernel: CPU decode attention (engine/csrc/decode_attention.cpp).

Torch's CPU flash kernel costs tens of microseconds per call and a decode step makes one
call per prompt and cohort per layer; the C++ kernel attends a whole step's rows in one call
per layer, reading each prompt's keys once for all its samples, with every row's result
independent of the batch by construction (see the source's header).

It is compiled on first use with the system's C++ compiler (`$CXX`, else `c++`; about a
second, no torch headers) into a cache directory keyed by the source's hash, the flags and
the compiler (`$BATCHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/batchgen`, else
`~/.cache/batchgen`), and loaded with ctypes. It needs x86-64 with AVX2 and FMA (torch's
CPU capability AVX2 or AVX512). Where it cannot be built or loaded (no compiler, another
CPU, `BATCHGEN_NATIVE=0`), `decode_attention_kernel()` returns None and attention uses
torch's kernels (engine/attention.py): the same results to about 1e-6, slower.
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

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

_lock = threading.Lock()
_kernel: "DecodeAttentionKernel | None | bool" = False  # False: not tried yet


class DecodeAttentionKernel:
    """The loaded library: `supports(head_dim)` and `__call__` (see `decode_attention_kernel`)."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._run = lib.batchgen_decode_attention
        self._run.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        self._run.restype = ctypes.c_int
        self._supports = lib.batchgen_decode_attention_supports
        self._supports.argtypes = [i64]
        self._supports.restype = ctypes.c_int

    def supports(self, head_dim: int) -> bool:
        """head_dim in 32, 64, 80, 96, 128."""
        return bool(self._supports(head_dim))

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seg: torch.Tensor,
                 group_ptr: torch.Tensor, order: torch.Tensor, threads: int) -> torch.Tensor:
        """Decode attention of every row: q (B, Hq, D) float32 contiguous; kc, vc one layer's
        contiguous (positions, Hkv, D) float32 arena; seg (B, 4) int64 rows of (prompt start,
        prompt length, own start, own length) in arena positions, every run inside the arena;
        group_ptr (G + 1,) and order (B,) int64: group i is rows order[group_ptr[i]:group_ptr[i
        + 1]], which share their prompt run. Returns (B, Hq, D) float32, scale 1/sqrt(D).
        The caller guarantees the bounds: the kernel reads what seg says."""
        B, Hq, D = q.shape
        out = torch.empty_like(q)
        with torch.profiler.record_function("batchgen::decode_attention"):  # visible to torch.profiler
            rc = self._run(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), seg.data_ptr(),
                           group_ptr.data_ptr(), order.data_ptr(), group_ptr.numel() - 1, Hq, kc.shape[1], D,
                           D ** -0.5, threads)
        if rc != 0:
            raise ValueError(f"decode attention kernel: head_dim {D} is not supported")
        return out


def decode_attention_kernel() -> DecodeAttentionKernel | None:
    """The compiled kernel, built and loaded once per process; None where it is unavailable
    (the reason is logged once at INFO)."""
    global _kernel
    if _kernel is False:
        with _lock:
            if _kernel is False:
                try:
                    _kernel = DecodeAttentionKernel(ctypes.CDLL(str(_build())))
                except (_Unavailable, OSError, AttributeError) as e:  # OSError, AttributeError: a bad library
                    log.info("batchgen: compiled decode attention unavailable (%s); using torch's kernels", e)
                    _kernel = None
    return _kernel


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
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename into place: processes that build at once (the
        # workers of one machine) each get a whole file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            res = subprocess.run([cxx, *FLAGS, "-o", str(out), str(SOURCE)], capture_output=True, text=True,
                                 timeout=300)
            if res.returncode != 0:
                raise _Unavailable(f"{cxx} failed: {res.stderr.strip()[-500:]}")
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building in {target.parent} failed: {e}") from None
    return target
