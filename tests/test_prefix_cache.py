"""Prefix caching across prompts (engine/prefix_cache.py): a prompt that begins with a stored
prompt's blocks copies their KV and is prefilled from there on.

What must hold: the prefill kernel computes a row after a cached prefix exactly as in the
whole prompt's prefill; a prompt's samples (tokens and logprob bits) are the same with the
cache and without it, whether the donor was prefilled in an earlier step or in the same one
(two waves), for duplicate prompts (all but the last token cached), short prompts (nothing to
match), prefix sharing on or off (tests/test_engine_models.py checks the same on every
architecture, float32 and bfloat16, nanochat's smear included); a prompt whose run was freed
is no donor; a hash collision costs a comparison, never a wrong prefix; and paths that cannot
resume a prefill (per-sequence state the model cannot resume, torch's attention, GPUs)
prefill whole prompts.
"""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.kernels.attention_backend import BatchedAttention, CpuAttention
from engine.kernels.kv_layout import KVLayout
from engine.kernels.native import native_kernels
from engine.models.base import ModelInfo
from engine.params import SamplingParams
from engine.prefix_cache import PrefixIndex, plan_prefills
from engine.scheduler import Admission
from engine.sequence import Request
from toy import ByteTokenizer, ScriptedLM, ToyLM

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py

TOK = ByteTokenizer()
KERNELS = native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the compiled kernels are unavailable here")


def toks(results):
    return [[(s.tokens, s.logprobs) for s in row] for row in results]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window"])
@pytest.mark.parametrize("D", [64, 24])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_after_a_cached_prefix_are_the_whole_prompts_rows(kv_dtype, window, D, threads):
    """Three prompts (70, 33 and 130 positions) in one arena: prefilled with 50, 0 and 97 of
    their positions cached, each row equals the whole prompt's row at its position bit for
    bit, and the padding rows are 0."""
    g = torch.Generator().manual_seed(D)
    Hq, Hkv = 6, 2
    lengths, cached = [70, 33, 130], [50, 0, 97]
    starts = [0, 80, 120]
    kc = torch.randn(260, Hkv, D, generator=g).to(kv_dtype)
    vc = torch.randn(260, Hkv, D, generator=g).to(kv_dtype)
    T = max(lengths)
    q = torch.randn(3, T, Hq, D, generator=g)
    s, n = torch.tensor(starts), torch.tensor(lengths)
    whole = KERNELS.prefill_attention(q, kc, vc, s, n, window, threads)
    Tc = max(m - c for m, c in zip(lengths, cached))
    qc = torch.zeros(3, Tc, Hq, D)
    for b, (m, c) in enumerate(zip(lengths, cached)):
        qc[b, :m - c] = q[b, c:m]
    part = KERNELS.prefill_attention(qc, kc, vc, s, n, window, threads, torch.tensor(cached))
    for b, (m, c) in enumerate(zip(lengths, cached)):
        assert torch.equal(part[b, :m - c], whole[b, c:m]), f"prompt {b}"
        assert not part[b, m - c:].any()


def _prompts(n: int, prefix: int = 35, seed: int = 0) -> list[list[int]]:
    """n prompts behind one shared prefix of `prefix` tokens, each with its own 3-8 tokens."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (3 + i % 6,), generator=g).tolist() for i in range(n)]


def _engines(model, **kw):
    return Engine(model, TOK, prefix_caching=True, **kw), Engine(model, TOK, prefix_caching=False, **kw)


@needs_kernels
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("max_num_seqs,prefix_sharing", [(64, True), (4, True), (4, False)],
                         ids=["one-step", "later-steps", "own-copies"])
def test_samples_are_the_same_bits_with_and_without_the_cache(window, max_num_seqs, prefix_sharing):
    """7 prompts behind a 35-token prefix, a duplicate of the first, and a prompt shorter than
    a block; 3 samples each. With everything admitted at once the donor is prefilled in the
    first wave and the others copy from it; with few slots, donors are prompts stored by
    earlier steps. Either way every sample equals the uncached engine's, bit for bit, and
    the cache did its work: cached and computed prompt tokens add up to the prompts'."""
    model = ToyLM(window=window).eval()
    prompts = _prompts(7)
    prompts += [list(prompts[0]), [1, 2, 3]]
    p = SamplingParams(num_samples=3, max_tokens=10, top_k=0, stop_token_ids=[], seed=5)
    on, off = _engines(model, max_num_seqs=max_num_seqs, prefix_sharing=prefix_sharing)
    assert on.prefix_caching and not off.prefix_caching
    got, want = on.generate(prompts, p), off.generate(prompts, p)
    assert toks(got) == toks(want)
    total = sum(map(len, prompts))
    assert off.num_prefill_tokens == total and off.num_cached_prompt_tokens == 0
    assert on.num_prefill_tokens + on.num_cached_prompt_tokens == total
    if max_num_seqs == 64:  # the 6 other prompts copy the prefix, the duplicate all but its last token
        assert on.num_cached_prompt_tokens >= 6 * 35 + len(prompts[0]) - 1
    else:  # a donor must still be stored: a prompt admitted after its predecessors finished has none
        assert on.num_cached_prompt_tokens >= 35


@needs_kernels
@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "own-copy"])
def test_a_prompt_stored_by_an_earlier_step_is_a_donor(prefix_sharing):
    """A prompt added while another with the same 35-token prefix decodes copies that prefix
    from the stored run, with the samples an uncached engine gives. Without prefix sharing a
    prompt's run is freed once its samples have their copies, so there is no donor."""
    model = ToyLM().eval()
    a, b = _prompts(2)
    p = SamplingParams(num_samples=2, max_tokens=12, top_k=0, stop_token_ids=[], seed=2)
    on, off = _engines(model, prefix_sharing=prefix_sharing)
    outs = {}
    for eng in (on, off):
        eng.add_request(a, p, "a")
        done = eng.step()
        eng.add_request(b, p, "b")
        done += eng.step()
        while eng.has_unfinished_requests():
            done += eng.step()
        outs[eng is on] = {o.prompt_id: [(s.tokens, s.logprobs) for s in o.samples] for o in done}
    assert on.num_cached_prompt_tokens == (35 if prefix_sharing else 0)
    assert outs[True] == outs[False]


@needs_kernels
def test_a_freed_prompt_is_no_donor():
    """Once a prompt's samples are done its run is freed: a later prompt with the same prefix
    is prefilled whole (nothing copied from freed memory), with the same samples."""
    model = ToyLM().eval()
    a, b = _prompts(2)
    p = SamplingParams(num_samples=2, max_tokens=6, top_k=0, stop_token_ids=[], seed=1)
    on, off = _engines(model)
    first = on.generate([a], p)
    assert on.num_cached_prompt_tokens == 0
    second = on.generate([b], p)
    assert on.num_cached_prompt_tokens == 0 and on.num_prefill_tokens == len(a) + len(b)
    assert toks(first + second) == toks(off.generate([a], p) + off.generate([b], p))


def _request(tokens: list[int], i: int) -> Request:
    return Request(i, str(i), tokens, SamplingParams(), frozenset(), [None])


def test_a_hash_collision_costs_a_comparison_not_a_wrong_prefix():
    """Two prompts whose block hashes were made to collide: the index compares the tokens and
    finds no prefix; a true match is found, cut to leave the last token to compute."""
    stored = _request(list(range(40)), 0)
    other = _request(list(range(100, 140)), 1)
    index = PrefixIndex(16)
    index.add(stored)
    other.block_hashes = list(stored.block_hashes)  # forged: every block collides
    assert index.match(other) == (None, 0)
    same = _request(list(range(40)), 2)
    assert index.match(same) == (stored, 39)  # all but the last token
    longer = _request(list(range(37)) + [0, 0, 0, 0], 3)
    assert index.match(longer) == (stored, 37)  # two whole blocks, then as far as the tokens agree
    short = _request(list(range(10)), 4)
    assert index.match(short) == (None, 0)  # no whole block to find it by


def test_a_prompt_whose_donor_is_new_this_step_waits_for_the_second_wave():
    """plan_prefills: the first new prompt is computed in the first wave; new prompts sharing
    its blocks copy from it in the second; one matching a stored prompt copies from that in
    the first; an unrelated one is computed whole in the first."""
    stored = _request(list(range(50, 90)), 0)
    new = [_request(list(range(40)) + [i], 10 + i) for i in range(3)]
    stored_like = _request(list(range(50, 90)) + [7], 20)
    lone = _request([9] * 20, 30)
    adm = [Admission(r, 0, [i], [i], True) for i, r in enumerate(new + [stored_like, lone])]
    waves, cached = plan_prefills(adm, [stored], 16)
    assert [[a.request.request_id for a in w] for w in waves] == [[10, 20, 30], [11, 12]]
    assert cached[id(new[1])] == (new[0], 40) and cached[id(new[2])] == (new[0], 40)
    assert cached[id(stored_like)] == (stored, 40) and id(lone) not in cached and id(new[0]) not in cached


def test_paths_that_cannot_resume_a_prefill_compute_whole_prompts():
    """A model with per-sequence state that does not say it can resume a prefill
    (`CausalLM.resumes_prefill`; nanochat's says so), a head size the compiled kernel lacks
    (torch's attention) and the batched path (GPUs) turn the cache off, and a layout with a
    cached prefix is refused there rather than attended wrongly."""
    stateful = ToyLM().eval()
    stateful.info = ModelInfo("toy", 265, 64, 2, 2, 8, state_dims={"smear": 32})
    assert not Engine(stateful, TOK).prefix_caching
    assert not Engine(ScriptedLM(list(range(40)), 265), TOK).prefix_caching  # head_dim 4
    assert not BatchedAttention().resumes_prefill(torch.float32, 64)
    assert not CpuAttention(True).resumes_prefill(torch.bfloat16, 64)
    layout = KVLayout.for_prefill([0], [20], "cpu", cached=[16])
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="cached prefix needs the compiled kernel"):
        BatchedAttention().prefill(q, q, q, torch.zeros(32, 2, 4), torch.zeros(32, 2, 4), layout, None, None)
    with pytest.raises(ValueError, match="cached prefix shorter than it"):
        KVLayout.for_prefill([0], [20], "cpu", cached=[20])
