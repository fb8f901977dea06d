"""engine/kernels/csrc/layer_ops.cpp: the fused RMSNorm (with its residual add), rotary embedding
(with Qwen3's per-head norm) and SwiGLU gating of a Llama-family step.

Each must equal torch's operations (engine/models/layers.py), the reference that matches
transformers: rotary bit for bit (the same products and sums), the others within float
rounding (their own summation order and exp). And each row's bits must not depend on the
rest of the call: its row count, where the row sits, the thread count. Widths that are not
a multiple of 8 exercise the partial last vector, which must go through the same
instructions as a full one.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import builds_to_compare, every_build
from engine.kernels.native import native_kernels
from engine.models.layers import apply_rotary, rms_norm

K = native_kernels()
pytestmark = [pytest.mark.invariance, pytest.mark.skipif(K is None, reason="the compiled kernels are unavailable here")]


def _rows(n, width, seed):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 3


def _invariant(fn, *rows):
    """fn(*rows, threads) (rows: tensors whose first dim is the row) gives each row, alone,
    in a reversed sub-batch, and with 1 or 2 threads, the bits it gets in the full call."""
    full = fn(*rows, threads=2)
    assert torch.equal(full, fn(*rows, threads=1))
    n = rows[0].shape[0]
    for sub in [[0], [5], [n - 1], list(range(n - 1, 0, -3))]:
        assert torch.equal(fn(*(t[sub].clone() for t in rows), threads=2), full[sub]), sub


@pytest.mark.parametrize("width", [576, 100, 8, 3])
def test_add_rms_norm_equals_torch_and_is_row_invariant(width):
    x, y, w = _rows(300, width, 0), _rows(300, width, 1), _rows(1, width, 2)[0]
    xo, h = K.add_rms_norm(x, y, w, 1e-5, 2)
    assert torch.equal(xo, x + y)
    assert torch.allclose(h, rms_norm(x + y, w, 1e-5), rtol=1e-6, atol=1e-6)
    same_x, h2 = K.add_rms_norm(x, None, w, 1e-5, 2)
    assert same_x is x and torch.allclose(h2, rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    _invariant(lambda a, b, threads: K.add_rms_norm(a, b, w, 1e-5, threads)[1], x, y)


@pytest.mark.parametrize("D", [64, 20, 128])
def test_rotary_equals_torch_bit_for_bit(D):
    """Heads rotated in place (the first `heads` of each row; the rest untouched), equal to
    apply_rotary at each row's position; with per-head norm weights, equal to rms_norm then
    apply_rotary within rounding."""
    B, H, heads = 200, 5, 3
    x = _rows(B, H * D, 3).view(B, H, D)
    freqs = torch.arange(300)[:, None].float() * torch.rand(D // 2, generator=torch.Generator().manual_seed(4))
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    pos = torch.randint(0, 300, (B,), generator=torch.Generator().manual_seed(5))
    want = apply_rotary(x[:, :heads], cos[pos][:, None], sin[pos][:, None])
    got = x.clone()
    K.rotary(got, heads, cos, sin, pos, None, 1e-6, 2)
    assert torch.equal(got[:, :heads], want) and torch.equal(got[:, heads:], x[:, heads:])
    norm = 1 + _rows(heads, D, 6)
    got = x.clone()
    K.rotary(got, heads, cos, sin, pos, norm, 1e-6, 2)
    want = apply_rotary(rms_norm(x[:, :heads], norm, 1e-6), cos[pos][:, None], sin[pos][:, None])
    assert torch.allclose(got[:, :heads], want, rtol=1e-5, atol=1e-5)

    def rotated(a, p, threads):
        a = a.clone()
        K.rotary(a, heads, cos, sin, p, norm, 1e-6, threads)
        return a
    _invariant(rotated, x, pos)


@pytest.mark.parametrize("I", [1536, 13])
def test_silu_mul_equals_torch_and_is_row_invariant(I):
    gu = _rows(260, 2 * I, 7)
    got = K.silu_mul(gu, 2)
    want = F.silu(gu[:, :I]) * gu[:, I:]
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-6)
    g = torch.tensor([-200.0, -90, -88, -20, -1e-3, 0, 1e-3, 20, 88, 90, 200, 1e30, -1e30])  # past exp's range
    extremes = K.silu_mul(torch.cat([g, torch.ones_like(g)])[None], 2)[0]
    assert torch.allclose(extremes, F.silu(g), rtol=1e-6, atol=1e-30)
    _invariant(lambda a, threads: K.silu_mul(a, threads), gu)


def test_every_kernel_source_ships_with_the_package():
    """An installed (non-editable) batchgen compiles its kernels from the package's own copy
    of engine/kernels/csrc: pyproject's package-data must cover every source and header there, or
    the build fails on users' machines and decoding silently falls back to torch."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["engine"]
    for f in (root / "engine" / "kernels" / "csrc").iterdir():
        rel = f.relative_to(root / "engine").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in package-data"


@pytest.mark.skipif(builds_to_compare() is not None, reason=str(builds_to_compare()))
def test_every_isa_gives_the_same_bits():
    """The avx2 build (8 lanes) and the AVX-512 builds (16 lanes elementwise, 8-lane sums of
    squares; on a CPU without AVX-512, in software: conftest.software_avx512) agree bit for
    bit on every operation, partial last vectors included; so do the sampler's top-k and
    logsumexp."""
    builds = every_build()
    for width in (576, 100, 13, 3):
        x, y, w = _rows(20, width, 0), _rows(20, width, 1), _rows(1, width, 2)[0]
        outs = [torch.cat(k.add_rms_norm(x, y, w, 1e-5, 2), 1) for k in builds]
        assert all(torch.equal(o, outs[0]) for o in outs), width
        gu = _rows(20, 2 * width, 3) * 4
        outs = [k.silu_mul(gu, 2) for k in builds]
        assert all(torch.equal(o, outs[0]) for o in outs), width
        logits = _rows(6, 1000 + width, 4)
        outs = [torch.cat([k.logsumexp(logits, 2)[:, None], *k.topk(logits, 7, 2)], 1) for k in builds]
        assert all(torch.equal(o, outs[0]) for o in outs), width
    # the sampler's rows at a real vocabulary: every block size of the two-pass top-k, the heap
    # (k near V), rows with NaN, infinities and ties
    logits = _rows(8, 49152 + 5, 9)
    logits[1, 17] = float("nan")
    logits[2, :] = float("-inf")
    logits[3, 100:200] = 50.0
    logits[4, 9] = float("inf")
    logits[5] = logits[5].round()
    for k in (1, 50, 400, 3000, 40000):
        outs = [torch.cat([kn.logsumexp(logits, 2)[:, None], *kn.topk(logits, k, 2)], 1) for kn in builds]
        for o in outs[1:]:  # equal bits, NaN where NaN
            torch.testing.assert_close(o, outs[0], rtol=0, atol=0, equal_nan=True, msg=f"k={k}")
    for D in (64, 80, 128, 24):
        x = _rows(12, 5 * D, 5).view(12, 5, D)
        cos, sin = _rows(40, D // 2, 6), _rows(40, D // 2, 7)
        pos, nw = torch.randint(0, 40, (12,)), _rows(4, D, 8)
        outs = []
        for k in builds:
            z = x.clone()
            k.rotary(z, 4, cos, sin, pos, nw, 1e-6, 2)
            outs.append(z)
        assert all(torch.equal(o, outs[0]) for o in outs), D
