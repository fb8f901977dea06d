"""engine/kernels/csrc/sampling_ops.cpp: the sampler's passes over the vocabulary on CPU, top-k and
logsumexp.

top-k must be exact: the same candidates and values as torch, in a fixed order (larger
value first, equal values by smaller id, NaN first), which is what a stable descending sort
gives. logsumexp must equal torch's within float rounding (its own summation order and exp).
Both must give a row the same bits whatever else is in the call (its row count, where it
sits, the row stride, the thread count), and vocabulary sizes that are not a multiple of 8
exercise the partial last vector.
"""
import pytest
import torch

from engine.kernels.native import native_kernels
from engine.sampling import token_logprobs

K = native_kernels()
pytestmark = [pytest.mark.invariance, pytest.mark.skipif(K is None, reason="the compiled kernels are unavailable here")]


def _logits(n, V, seed):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


def _stable_topk(x, k):
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)  # NaN sorts as the largest
    return vals[:, :k], idx[:, :k]


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t  # NaN equals NaN bit for bit


def _invariant(fn, x):
    """fn(x, threads) gives each row, alone, in a reversed sub-batch, with 1 or 2 threads, and
    as a strided view of a wider tensor, the bits it gets in the full call."""
    full = [_bits(t) for t in fn(x, threads=2)]

    def same(got, rows=slice(None)):
        return all(torch.equal(_bits(a), b[rows]) for a, b in zip(got, full))

    assert same(fn(x, threads=1))
    n = x.shape[0]
    for sub in [[0], [n - 1], list(range(n - 1, 0, -3))]:
        assert same(fn(x[sub].clone(), threads=2), sub), sub
    wide = torch.full((n, x.shape[1] + 5), 1e30)
    wide[:, :x.shape[1]] = x
    assert same(fn(wide[:, :x.shape[1]], threads=2))


@pytest.mark.parametrize("V,k", [(49152, 50), (50257, 1), (50257, 1024), (13, 13), (13, 5), (8, 3)])
def test_topk_equals_torch(V, k):
    x = _logits(40, V, 0)
    vals, idx = K.topk(x, k, 2)
    assert torch.equal(vals, torch.topk(x, k, dim=-1).values)
    assert torch.equal(idx, _stable_topk(x, k)[1])  # 50,257 random floats do hold ties
    assert vals.shape == (40, k) and idx.dtype == torch.int64
    _invariant(lambda t, threads: K.topk(t, k, threads), x)


def test_topk_ties_nan_and_infinities_in_a_fixed_order():
    """Few distinct values (ties everywhere, including across the k-th place), NaN, +-inf:
    the order of a stable descending sort."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 6, (30, 1001), generator=g).float()
    x[3, 17] = x[3, 900] = float("nan")
    x[4, :] = float("-inf")
    x[5, 500] = float("inf")
    x[6, ::2] = float("-inf")
    for k in (1, 7, 64, 1001):
        vals, idx = K.topk(x, k, 2)
        want_vals, want_idx = _stable_topk(x, k)
        assert torch.equal(idx, want_idx), k
        assert torch.allclose(vals, want_vals, rtol=0, atol=0, equal_nan=True), k
    _invariant(lambda t, threads: K.topk(t, 64, threads), x)


@pytest.mark.parametrize("V", [49152, 50257, 13, 3])
def test_logsumexp_equals_torch_and_is_row_invariant(V):
    x = _logits(40, V, 2)
    x[7, ::3] = float("-inf")
    got = K.logsumexp(x, 2)
    assert torch.allclose(got, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)
    _invariant(lambda t, threads: (K.logsumexp(t, threads),), x)


def test_logsumexp_of_special_rows():
    x = torch.zeros(4, 100)
    x[0] = float("-inf")
    x[1, 5] = float("inf")
    x[2, 99] = float("nan")
    x[3, :] = 1e30  # no overflow: the max is taken out first
    got = K.logsumexp(x, 2)
    assert got[0] == float("-inf") and got[1] == float("inf") and got[2].isnan()
    assert torch.allclose(got[3], torch.logsumexp(x[3], -1))


def test_token_logprobs_use_the_compiled_logsumexp():
    """The sampler's raw logprobs on CPU: logits[token] - logsumexp, within rounding of
    log_softmax, and the logits are left as they were."""
    x = _logits(64, 49152, 3)
    toks = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(4))
    before = x.clone()
    got = token_logprobs(x, toks, inplace=True)
    assert torch.equal(x, before)
    assert torch.equal(got, x.gather(1, toks[:, None])[:, 0] - K.logsumexp(x, torch.get_num_threads()))
    assert torch.allclose(got, torch.log_softmax(x, -1).gather(1, toks[:, None])[:, 0], atol=2e-6)
