"""The compiled CPU kernels' functions with tensor arguments: `NativeKernels` over a loaded
library (engine/kernels/csrc/, built by engine/kernels/build.py), and `PackedWeight`, a
weight in the GEMM's panel layout.

What each kernel computes, and why its result for a row is independent of the batch, the
thread count and the instruction set, is in the sources' headers (gemm.cpp, gemm_amx.cpp,
prefill_attention.cpp, decode_attention.cpp, layer_ops.cpp, sampling_ops.cpp).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

# gemm_amx.cpp's pair orders (its `swap`): "swapped" packs each pair (odd, even), "unswapped"
# (even, odd). TDPBF16PS as measured (the SDM's even and odd partial sums) gives the same bits
# either way; the probe still checks both, since the intrinsics guide describes a chain that
# only one of them would match.
AMX_ORDERS = ("swapped", "unswapped")

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
    k_in: int | None = None  # the caller's K when it is odd in bfloat16: packed as k = k_in + 1, a zero column added

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
    them on vdpbf16ps (gemm.cpp) as the avx512_bf16 build does.

    `attention_tiles` (class attribute, True): with `amx_order` set, decode attention runs a
    bfloat16 cache's prompt blocks on the tiles too (csrc/attention_tiles.h); False keeps
    them on vdpbf16ps (csrc/attention_bf16.h). The same bits either way (tested); which is
    faster on an AMX CPU is not yet known per shape (bench/lent_machine.py times both)."""

    attention_tiles = True

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
                                    _p, _p, _i64, _p, _i64, _int]
        self._attention.restype = _int
        self._prefill = lib.batchgen_prefill_attention
        self._prefill.argtypes = [_p, _i64, _i64, _p, _p, _int, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f32,
                                  _p, _int]
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
        self._race_uniforms = lib.batchgen_race_uniforms
        self._race_uniforms.argtypes = [_p, _i64, _p, _p, _i64, _p, _i64, _int]
        self._race_uniforms.restype = None
        self._race_candidates = lib.batchgen_race_candidates
        self._race_candidates.argtypes = [_p, _i64, _p, _p, _p, _i64, _p, _i64, _i64, _p, _p, _p, _int]
        self._race_candidates.restype = None

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """gemm.cpp's packed form of weight (N, K) float32 or bfloat16 (rows may be strided,
        the last dim contiguous) and its bias (N,) or None. The bfloat16 kernels take K in
        pairs: an odd K is packed with a zero column added (K + 1) and `gemm` adds one to x,
        so the last pair is one real product and 0 x 0 (an exact +0), the same sequence on
        every build. Raises ValueError for another dtype or shape."""
        if weight.dtype not in _GEMM_DTYPES or weight.dim() != 2:
            raise ValueError(f"gemm: weight must be a 2-d float32 or bfloat16 tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        w = weight.detach()
        k_in = None
        if w.dtype == torch.bfloat16 and w.shape[1] % 2:
            k_in, w = w.shape[1], torch.nn.functional.pad(w, (0, 1))
        n, k = w.shape
        if w.stride(1) != 1:
            w = w.contiguous()
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if w.dtype == torch.bfloat16 and self.amx_order is not None:
            data = torch.empty(self._amx_packed_bytes(n, k), dtype=torch.uint8)
            self._amx_pack(w.data_ptr(), w.stride(0), n, k, int(self.amx_order == "swapped"), data.data_ptr())
            return PackedWeight(data, n, k, w.dtype, b, self.amx_order, k_in)
        code = _GEMM_DTYPES[w.dtype]
        data = torch.empty(self._packed_bytes(n, k, code), dtype=torch.uint8)
        self._pack(w.data_ptr(), w.stride(0), n, k, code, data.data_ptr())
        return PackedWeight(data, n, k, w.dtype, b, None, k_in)

    def gemm(self, x: torch.Tensor, w: PackedWeight, out_dtype: torch.dtype, threads: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, K) @ W.T + bias, x with a contiguous last dim (rows may be strided) in the
        weight's dtype or float32 (a bfloat16 weight's float32 activations are rounded to
        bfloat16 first, as `.to(torch.bfloat16)` rounds); returns (M, N) of out_dtype
        (float32, or bfloat16 for a bfloat16 weight). Each element is one fixed sequence of
        rounded operations over K in order (gemm.cpp's header), so a row's bits depend on that
        row alone, on any ISA and thread count. A weight packed for AMX tiles (`amx_order`) runs on them
        (gemm_amx.cpp; RuntimeError if Linux refuses the tile state).
        out: a contiguous (M, N) tensor of out_dtype to write instead of a new one (a step's
        logits: a fresh 25 MB tensor each step costs its pages' first-touch faults); ValueError
        if it is not one."""
        M = x.shape[0]
        if w.k_in is not None and x.shape[1] == w.k_in:  # an odd K in bfloat16: the weight's zero column's
            x = torch.nn.functional.pad(x, (0, 1))
        if out is None:
            y = torch.empty(M, w.n, dtype=out_dtype)
        elif out.shape != (M, w.n) or out.dtype != out_dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"gemm: out must be a contiguous CPU ({M}, {w.n}) {out_dtype} tensor, "
                             f"got {tuple(out.shape)} {out.dtype}")
        else:
            y = out
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
        Hkv, D) arena, float32 or bfloat16 (a float32 arena's prompt runs are transposed once
        per block for all the group's queries: csrc/attention_f32.h; a bfloat16 arena's take
        bfloat16 products: csrc/attention_bf16.h, on AMX tiles where this library's
        `amx_order` is set; its own runs are widened to float32 as read); seg (B, 4) int64 rows of (prompt start, prompt length, own start, own length) in
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
                   _ptr(write), B, int(self.amx_order is not None and self.attention_tiles))
        if rc != 0:
            raise ValueError(f"decode attention kernel: head_dim {D} is not supported")
        return out

    def prefill_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, starts: torch.Tensor,
                          lengths: torch.Tensor, window: int | None, threads: int,
                          cached: torch.Tensor | None = None) -> torch.Tensor:
        """Causal prefill attention of every prompt token to its prompt's keys, read from
        the arena (engine/kernels/csrc/prefill_attention.cpp).

        q: (B, T, Hq, D) float32 with its last two dims contiguous (tokens and prompts may be
        strided, as the q part of a fused qkv projection is); kc, vc: one layer's contiguous
        (positions, Hkv, D) arena, float32 or bfloat16, holding prompt b at positions
        starts[b] .. starts[b] + lengths[b] - 1 (starts, lengths: (B,) int64); cached: (B,)
        int64 or None, the positions of each prompt stored before this prefill (a cached
        prefix): q's row i of prompt b is its position cached[b] + i, and lengths - cached <= T.
        window: a query at t sees keys t - window .. t (None: all). Returns (B, T, Hq, D)
        float32 by row, zeros past each prompt's rows; scale 1/sqrt(D). A row's bits do not
        depend on cached. Raises ValueError for an unsupported head_dim (`supports`)."""
        B, T, Hq, D = q.shape
        out = torch.empty(B, T, Hq, D)
        rc = _call("batchgen::prefill_attention", self._prefill, q.data_ptr(), q.stride(1), q.stride(0),
                   kc.data_ptr(), vc.data_ptr(), int(kc.dtype == torch.bfloat16), starts.data_ptr(),
                   lengths.data_ptr(), _ptr(cached), B, T, Hq, kc.shape[1], D, -1 if window is None else window,
                   D ** -0.5, out.data_ptr(), threads)
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

    def race_uniforms(self, first: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                      threads: int) -> torch.Tensor:
        """The race's uniforms (engine/sampling.py race_noise) for every token of B rows, into
        `out` (B, V) float64 with contiguous rows: first (V,) int32 contiguous (each token's
        first hash round), keys (B, 2) and positions (B,) int64 contiguous. Returns out."""
        B, V = out.shape
        _call("batchgen::race_uniforms", self._race_uniforms, first.data_ptr(), V, keys.data_ptr(),
              positions.data_ptr(), B, out.data_ptr(), out.stride(0), threads)
        return out

    def race_candidates(self, first: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                        s0: torch.Tensor, cap: int, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens of B rows that can win the whole-vocabulary race (csrc/sampling_ops.cpp,
        batchgen_race_candidates): q (B, V) float32 with contiguous rows (logits / temperature),
        s0 (B,) float64 (one token's race score per row), first, keys, positions as
        race_uniforms. Returns (idx (B, cap) int64, u (B, cap) float64, count (B,) int64): row
        b's candidates idx[b, :count[b]] in increasing order and their uniforms; count[b] =
        cap + 1 where more than cap (the rest of that row is not written)."""
        B, V = q.shape
        idx = torch.empty(B, cap, dtype=torch.int64)
        u = torch.empty(B, cap, dtype=torch.float64)
        count = torch.empty(B, dtype=torch.int64)
        _call("batchgen::race_candidates", self._race_candidates, first.data_ptr(), V, keys.data_ptr(),
              positions.data_ptr(), q.data_ptr(), q.stride(0), s0.data_ptr(), B, cap, idx.data_ptr(), u.data_ptr(),
              count.data_ptr(), threads)
        return idx, u, count

    def logsumexp(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """torch.logsumexp(x, -1) of x (B, V) float32 with contiguous rows: (B,) float32."""
        B, V = x.shape
        out = x.new_empty(B)
        _call("batchgen::logsumexp", self._logsumexp, x.data_ptr(), B, V, x.stride(0), out.data_ptr(), threads)
        return out
