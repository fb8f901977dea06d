"""KV memory by need and prompts stored once (engine/scheduler.py, engine/kv_cache.py).

On the toy model (tests/toy.py): the budget bounds what requests need, not max_seq_len per
sample; a prompt with more samples than fit at once is prefilled exactly once and its later
samples equal those of a roomy run; tight memory with mixed requests never deadlocks;
memory is given back; prefix sharing on and off give bit-identical samples.
"""
import random

import pytest
import torch

from engine.engine import BLOCK_SIZE, Engine
from engine.kv_cache import KVCache
from engine.params import SamplingParams
from toy import ByteTokenizer, ToyLM

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    return ToyLM(window=6).eval()


def _block_bytes(m) -> int:
    i = m.info
    return BLOCK_SIZE * KVCache.bytes_per_position(i.n_layer, i.n_kv_head, i.head_dim, torch.float32)


def toks(results):
    return [[(s.tokens, s.logprobs) for s in row] for row in results]


def test_budget_bounds_memory_by_need_not_max_seq_len(model):
    """A budget of 3 full-context sequences runs 8 short samples of one prompt at once (their
    prompt stored once); a budget below one sequence is refused with a clear message."""
    ctx = model.info.context_len
    budget = 3 * ctx // BLOCK_SIZE * _block_bytes(model)
    eng = Engine(model, TOK, kv_cache_bytes=budget)
    assert eng.kv_capacity_bytes == budget
    eng.add_request([1, 2, 3, 4, 5], SamplingParams(num_samples=8, max_tokens=10, stop_token_ids=[]), "p")
    eng.step()
    assert len(eng.running) == 8
    assert eng.kv_used_bytes == (1 + 8) * _block_bytes(model)  # one prompt block + one block per sample
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.peak_kv_bytes == 9 * _block_bytes(model)
    assert eng.kv_bytes_per_running_sample() == 9 * _block_bytes(model) / 8
    assert eng.kv_used_bytes == 0 and eng.scheduler.allocator.free_ranges() == [(0, budget // _block_bytes(model))]
    with pytest.raises(ValueError, match=f"cannot hold one sequence of {ctx} tokens"):
        Engine(model, TOK, kv_cache_bytes=100)


@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "own-copy"])
def test_prompt_with_more_samples_than_fit_is_prefilled_once(model, prefix_sharing):
    """num_samples=12 with memory for 3 samples' runs at a time: the prompt is prefilled exactly
    once, the later samples read the stored prompt, and every sample (tokens and logprobs,
    bit for bit) equals the one a roomy cache gives."""
    prompt = list(range(40, 57))
    p = SamplingParams(num_samples=12, max_tokens=30, top_k=0, stop_token_ids=[])
    bb = _block_bytes(model)
    own = -(-(30 + (0 if prefix_sharing else len(prompt))) // BLOCK_SIZE)
    need = 2 * (model.info.context_len // BLOCK_SIZE) + 2  # the least the engine accepts, either mode
    tight = Engine(model, TOK, kv_cache_bytes=max(need, 2 + 3 * own) * bb, prefix_sharing=prefix_sharing)
    tight.add_request(prompt, p, "x")
    most = 0
    outs = []
    while tight.has_unfinished_requests():
        outs += tight.step()
        most = max(most, len(tight.running))
    assert 1 < most < 12  # the samples really were admitted in several groups
    assert tight.num_prefill_tokens == len(prompt)
    roomy = Engine(model, TOK, prefix_sharing=prefix_sharing).generate([prompt], p, prompt_ids=["x"])
    assert toks([outs[0].samples]) == toks(roomy)
    assert [s.sample_index for s in outs[0].samples] == list(range(12))


@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "own-copy"])
def test_tight_memory_with_mixed_requests_never_deadlocks(model, prefix_sharing):
    """Random prompts, sample counts and lengths under the smallest budget the engine accepts,
    streamed in while others run: every request finishes, equal to a roomy run, and all memory
    comes back."""
    rng = random.Random(0)
    reqs = []
    for i in range(24):
        n = rng.choice([1, 5, 20, 40])
        reqs.append(([rng.randrange(256) for _ in range(n)],
                     SamplingParams(num_samples=rng.choice([1, 2, 7]), max_tokens=rng.choice([3, 15, 60]), top_k=0,
                                    stop_token_ids=[]), f"r{i}"))
    need = 2 * (model.info.context_len // BLOCK_SIZE) + 1
    tight = Engine(model, TOK, kv_cache_bytes=need * _block_bytes(model), prefix_sharing=prefix_sharing)
    got = {}
    for i, (prompt, p, rid) in enumerate(reqs):
        tight.add_request(prompt, p, rid)
        if i % 3 == 2:
            for out in tight.step():
                got[out.prompt_id] = out.samples
    while tight.has_unfinished_requests():
        for out in tight.step():
            got[out.prompt_id] = out.samples
    assert tight.kv_used_bytes == 0
    roomy = Engine(model, TOK, prefix_sharing=prefix_sharing)
    for prompt, p, rid in reqs:
        assert toks([got[rid]]) == toks(roomy.generate([prompt], p, prompt_ids=[rid])), rid


def test_prompt_is_stored_once_with_sharing_and_copied_without(model):
    """With sharing the prompt's blocks are reserved once per request; without it each sample
    also holds its own copy (and the stored prompt is freed once every sample has one)."""
    prompt = list(range(70, 110))  # 40 tokens: 3 blocks
    p = SamplingParams(num_samples=4, max_tokens=8, stop_token_ids=[])
    used = {}
    for sharing in (True, False):
        eng = Engine(model, TOK, prefix_sharing=sharing)
        eng.add_request(prompt, p, "p")
        eng.step()
        used[sharing] = eng.kv_used_bytes // _block_bytes(model)
    assert used == {True: 3 + 4 * 1, False: 4 * 3}  # 8 generated fit 1 block; 40 + 8 need 3


@pytest.mark.parametrize("max_num_seqs", [1, 4, 32])
def test_sharing_off_is_batch_invariant_and_equals_sharing_on(model, max_num_seqs):
    """prefix_sharing=False is batch-invariant too, and gives bit-identical samples to the
    default: both split each row's attention at the end of its prompt (engine/kernels/attention.py)."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20, [42], list(range(30, 45))]
    ids = ["a", "b", "c", "d", "e"]
    p = SamplingParams(num_samples=3, max_tokens=12, top_k=0, stop_token_ids=[])
    off = Engine(model, TOK, max_num_seqs=max_num_seqs, prefix_sharing=False).generate(prompts, p, prompt_ids=ids)
    on = Engine(model, TOK, max_num_seqs=64).generate(prompts, p, prompt_ids=ids)
    assert toks(off) == toks(on)
