"""The compiled attention kernels on their own: prefill (engine/kernels/csrc/prefill_attention.cpp) and
decode over a bfloat16 arena (engine/kernels/csrc/decode_attention.cpp), against float64 attention.

What this proves: prefill attention is causal attention (sliding windows, grouped-query
heads, every supported head size, padding rows zero) within float32 rounding; a query row's
bits depend on its own position and keys alone (the first n rows of a prompt equal the rows
of its first n tokens prefilled alone, wherever the prompt sits in the arena, whatever else
is in the batch, on one thread or two); decode over a bfloat16 arena takes bfloat16 products
within bfloat16 rounding, with rows as invariant, and stores a step's keys rounded as torch
rounds; and every ISA build this CPU runs gives the same bits.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import builds_to_compare, emulated_amx_build, every_build
from engine.kernels.native import native_kernels

K = native_kernels()
pytestmark = [pytest.mark.invariance,
              pytest.mark.skipif(K is None, reason="the compiled kernels are unavailable here")]


def reference(q, k, v, window):
    """Causal attention in float64: q (T, Hq, D), k, v (T, Hkv, D) -> (T, Hq, D)."""
    T, Hq, D = q.shape
    g = Hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) / math.sqrt(D)
    t = torch.arange(T)
    visible = (t[None, :] <= t[:, None]) & ((window is None) | (t[:, None] - t[None, :] <= (window or 0)))
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def batch(lengths, Hq, Hkv, D, seed, dtype=torch.float32, gap=7):
    """Prompts of `lengths` at scattered arena positions: (q (B, T, Hq, D) strided as a
    fused projection's q part, kc, vc, starts, lengths)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    fused = torch.randn(B, T, Hq + 2 * Hkv, D, generator=g)
    q = fused[:, :, :Hq]
    starts, pos = [], 3
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    kc = torch.randn(pos, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(pos, Hkv, D, generator=g).to(dtype)
    return q, kc, vc, torch.tensor(starts), torch.tensor(lengths)


def run(kern, q, kc, vc, starts, lengths, window=None, threads=2):
    return kern.prefill_attention(q, kc, vc, starts, lengths, window, threads)


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (2, 1, 32), (6, 2, 80), (4, 1, 96),
                                      (3, 1, 8), (2, 2, 24), (2, 1, 256)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_prefill_equals_causal_attention(Hq, Hkv, D, window):
    lengths = [1, 33, 70, 8]
    q, kc, vc, starts, lens = batch(lengths, Hq, Hkv, D, seed=Hq * D)
    out = run(K, q, kc, vc, starts, lens, window)
    for b, n in enumerate(lengths):
        s = int(starts[b])
        want = reference(q[b, :n], kc[s:s + n], vc[s:s + n], window)
        assert (out[b, :n].double() - want).abs().max() < 5e-6
        assert not out[b, n:].any()  # padding rows are zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_rows_depend_on_their_own_keys_only(dtype, window):
    """Prompt A's first n rows, prefilled beside other prompts, equal prompt A[:n] prefilled
    alone at another arena position, bit for bit, on 1 or 2 threads."""
    Hq, Hkv, D = 9, 3, 64
    q, kc, vc, starts, lens = batch([90, 5, 64], Hq, Hkv, D, seed=1, dtype=dtype)
    full = run(K, q, kc, vc, starts, lens, window)
    assert torch.equal(run(K, q, kc, vc, starts, lens, window, threads=1), full)
    for n in (1, 17, 32, 33, 64, 90):
        # prompt 0's first n tokens copied elsewhere in the arena, alone in the batch
        kc2, vc2 = torch.zeros(200, Hkv, D, dtype=dtype), torch.zeros(200, Hkv, D, dtype=dtype)
        kc2[101:101 + n], vc2[101:101 + n] = kc[3:3 + n], vc[3:3 + n]
        alone = run(K, q[:1, :n].contiguous(), kc2, vc2, torch.tensor([101]), torch.tensor([n]), window)
        assert torch.equal(alone[0], full[0, :n]), n


def test_bfloat16_arena_is_the_float32_result_on_its_values():
    q, kc, vc, starts, lens = batch([40, 12], 6, 2, 64, seed=3, dtype=torch.bfloat16)
    assert torch.equal(run(K, q, kc, vc, starts, lens), run(K, q, kc.float(), vc.float(), starts, lens))


def decode_reference(q, kc, vc, seg):
    """Decode attention in float64 over each row's two runs, the queries rounded to bfloat16
    as the kernel's products take them: q (B, Hq, D), arena (P, Hkv, D) -> (B, Hq, D)."""
    B, Hq, D = q.shape
    g = Hq // kc.shape[1]
    outs = []
    for b, (s0, n0, s1, n1) in enumerate(seg.tolist()):
        pos = torch.cat([torch.arange(s0, s0 + n0), torch.arange(s1, s1 + n1)])
        k = kc[pos].double().repeat_interleave(g, 1)  # (T, Hq, D)
        v = vc[pos].double().repeat_interleave(g, 1)
        s = torch.einsum("hd,thd->ht", q[b].bfloat16().double(), k) / math.sqrt(D)
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(outs).float()


def bf16_arena(B, Hq, Hkv, D, P, seed):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(P, Hkv, D, generator=g).bfloat16()
    vc = torch.randn(P, Hkv, D, generator=g).bfloat16()
    return torch.randn(B, Hq, D, generator=g), kc, vc


@pytest.mark.parametrize("D", [24, 64, 80])
def test_decode_over_a_bfloat16_arena(D):
    """Over a bfloat16 arena's prompt runs the decode kernel multiplies bfloat16 queries,
    keys, weights and values (attention_bf16.h; the rows' own runs keep float32 products of
    the widened values): within bfloat16 rounding of attention in float64 on the rounded
    queries (a head size with a partial block of 32 included), and it stores this step's
    float32 keys and values rounded as `.to(torch.bfloat16)`."""
    B, Hq, Hkv, P = 5, 8, 2, 300
    q, kc, vc = bf16_arena(B, Hq, Hkv, D, P, seed=5)
    g = torch.Generator().manual_seed(6)
    knew, vnew = torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
    seg = torch.tensor([[0, 40, 100 + 20 * b, 5 + b] for b in range(B)])  # a shared prompt, own runs
    write = torch.tensor([100 + 20 * b + 4 + b for b in range(B)])  # each row's last own position
    ptr, order = torch.tensor([0, B]), torch.arange(B)
    out = K.decode_attention(q, kc, vc, seg, ptr, order, 2, new_kv=(knew, vnew, write))
    assert torch.equal(kc[write], knew.bfloat16()) and torch.equal(vc[write], vnew.bfloat16())
    err = (out - decode_reference(q, kc, vc, seg)).abs().max().item()
    assert err < 1e-2, err  # bfloat16 weights: about 2^-9 of each value they scale
    f32 = K.decode_attention(q.bfloat16().float(), kc.float(), vc.float(), seg, ptr, order, 2)
    assert (out - f32).abs().max().item() < 1e-2 and not torch.equal(out, f32)  # the products are bfloat16 ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 64])
def test_decode_rows_depend_on_their_own_runs_only(D, dtype):
    """A row's bits over a float32 or bfloat16 arena are the same in a group of rows sharing
    its prompt, alone, with its prompt copied to a run of its own, and on one thread or two:
    a prompt block's products never depend on which queries share it (attention_f32.h: 4 at
    a time on AVX-512, 2 on AVX2; attention_bf16.h: 4 or 1) or on where the row sits, and a
    prompt run is read the same way whether it is shared or a copy."""
    B, Hq, Hkv, P = 7, 9, 3, 700
    q, kc, vc = bf16_arena(B, Hq, Hkv, D, P, seed=11)
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(12)
        kc, vc = torch.randn(P, Hkv, D, generator=g), torch.randn(P, Hkv, D, generator=g)
    kc[400:477], vc[400:477] = kc[0:77], vc[0:77]  # a copy of the shared prompt
    seg = torch.tensor([[0, 77, 100 + 40 * b, 3 + 5 * b] for b in range(B)])
    shared = K.decode_attention(q, kc, vc, seg, torch.tensor([0, B]), torch.arange(B), 2)
    one = K.decode_attention(q, kc, vc, seg, torch.tensor([0, B]), torch.arange(B), 1)
    assert torch.equal(shared, one)
    for b in (0, 3, 6):
        alone = K.decode_attention(q[b:b + 1], kc, vc, seg[b:b + 1], torch.tensor([0, 1]), torch.arange(1), 1)
        own = seg[b:b + 1].clone()
        own[0, 0] = 400
        copied = K.decode_attention(q[b:b + 1], kc, vc, own, torch.tensor([0, 1]), torch.arange(1), 1)
        assert torch.equal(alone[0], shared[b]) and torch.equal(copied[0], shared[b])
    groups = K.decode_attention(q, kc, vc, seg, torch.tensor([0, 2, 3, B]), torch.tensor([5, 1, 0, 2, 3, 4, 6]), 2)
    assert torch.equal(groups, shared)


@pytest.mark.skipif(builds_to_compare() is not None, reason=str(builds_to_compare()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [8, 24, 64, 80])
def test_every_isa_gives_the_same_bits(dtype, D):
    """Prefill and decode attention of the avx2 build (16-lane partial sums in two 8-lane
    registers, the softmax step on 8-lane vectors) and the AVX-512 builds (16 lanes; on a
    CPU without AVX-512, in software: conftest.software_avx512), head sizes with and without
    a half chunk; decode's prompt blocks whole and short (28, 13 and 16 keys: more and fewer
    valid keys than a 16-lane vector holds)."""
    q, kc, vc, starts, lens = batch([77, 3, 40], 9, 3, D, seed=9, dtype=dtype)
    builds = every_build()
    outs = [run(k, q, kc, vc, starts, lens, 30) for k in builds]
    assert all(torch.equal(o, outs[0]) for o in outs)
    s0, s1, s2 = (int(x) for x in starts)
    seg = torch.tensor([[s0, 60, s2, 40], [s0, 60, s1, 3], [s0 + 2, 45, s2, 17], [s0 + 1, 16, s1, 2]])
    qd = torch.cat([q[:, 0], q[:1, 1]])
    decodes = [k.decode_attention(qd, kc, vc, seg, torch.tensor([0, 2, 3, 4]), torch.arange(4), 2) for k in builds]
    assert all(torch.equal(o, decodes[0]) for o in decodes)


def test_prompt_blocks_on_emulated_amx_tiles_give_the_same_bits():
    """Decode attention over a bfloat16 arena's prompt blocks on AMX tiles (the
    BATCHGEN_AMX_EMULATE build: tile instructions computed as the hardware computes them)
    gives the avx512_bf16 build's bits (on a CPU without AVX-512 BF16, the software AVX-512
    build's tiles give the native build's): whole and short blocks, head sizes with and without
    a partial block of 32, groups of 1 to 20 rows (query tiles full and partial), 1 or 2
    threads; and with `attention_tiles` off, the same. On an AMX machine the tiles run in
    tests/test_gemm.py::test_engine_in_bfloat16_is_the_same_bits_on_amx."""
    import ctypes

    from engine.kernels import native as N
    path, ref = emulated_amx_build()
    tiles = N.NativeKernels(ctypes.CDLL(str(path)), "amx", path, "swapped")
    for D, sizes, plen in [(64, [16, 1, 3], 77), (24, [5, 20], 64), (80, [2, 7], 33), (128, [4], 32)]:
        B_ = sum(sizes)
        q, kc, vc = bf16_arena(B_, 9, 3, D, 600 + 40 * B_, seed=D)
        seg, order, ptr, pos = [], [], [0], 300
        for gi, n in enumerate(sizes):
            for _ in range(n):
                seg.append([100 * gi, plen, pos, 5 + len(seg)])
                pos += 40
                order.append(len(seg) - 1)
            ptr.append(len(order))
        args = (q, kc, vc, torch.tensor(seg), torch.tensor(ptr), torch.tensor(order))
        for threads in (1, 2):
            assert torch.equal(tiles.decode_attention(*args, threads), ref.decode_attention(*args, threads)), (D, sizes)
    tiles.attention_tiles = False  # the amx build's prompt blocks on vdpbf16ps (bench/lent_machine.py's "vector")
    assert torch.equal(tiles.decode_attention(*args, 2), ref.decode_attention(*args, 2))
