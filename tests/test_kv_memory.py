"""KV memory by need and prompts stored once (engine/scheduler.py, engine/kv_cache.py).

On the toy model (tests/toy.py): the budget bounds what requests need, not max_seq_len per
sample; a prompt with more samples than fit at once is prefilled exactly once and its later
samples equal those of a roomy run; tight memory with mixed requests never deadlocks;
memory is given back; prefix sharing on and off give bit-identical samples.
"""
import math
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
    streamed in while others run: every request finishes, equal to a roomy run, requests are
    admitted in arrival order and never kept waiting while enough blocks are free in total
    (`_admission_log`), and all memory comes back."""
    rng = random.Random(0)
    reqs = []
    for i in range(24):
        n = rng.choice([1, 5, 20, 40])
        reqs.append(([rng.randrange(256) for _ in range(n)],
                     SamplingParams(num_samples=rng.choice([1, 2, 7]), max_tokens=rng.choice([3, 15, 60]), top_k=0,
                                    stop_token_ids=[]), f"r{i}"))
    need = 2 * (model.info.context_len // BLOCK_SIZE) + 1
    tight = Engine(model, TOK, kv_cache_bytes=need * _block_bytes(model), prefix_sharing=prefix_sharing)
    log = _admission_log(tight)
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
    assert list(dict.fromkeys(rid for step in log for rid in step)) == [rid for _, _, rid in reqs]
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


# ---------------------------------------------------------------- fragmentation (issue 20, item 7)
# A full-attention model (no window: every stored key is read at every step, so a key moved to
# the wrong place changes the logits) with room for prompts of 40 tokens and 64 generated.
FULL = ToyLM(context_len=128).eval()
SHORT = SamplingParams(max_tokens=2, top_k=0, stop_token_ids=[])


def _admission_log(eng):
    """Record, per step, the prompt_ids of the requests the scheduler admits samples of, and
    check after every admission that the first waiting request (if any) could not have been
    admitted: with a free decoding slot and within the step's prefill budget, its next need
    (its prompt run unless stored, and one sample's run) is more than the free blocks in total."""
    log: list[list[str]] = []
    sched = eng.scheduler
    schedule = sched.schedule

    def checked():
        admitted = schedule()
        log.append([a.request.prompt_id for a in admitted])
        head = sched.waiting[0] if sched.waiting else None
        prefills = [len(a.request.prompt_tokens) for a in admitted if a.prefill]
        if head is not None and head.kv_block is None and prefills:
            within = (len(prefills) + 1) * max(*prefills, len(head.prompt_tokens)) <= sched.max_prefill_tokens
        else:
            within = True
        if head is not None and sched.num_free and within:
            need = (sched.prompt_blocks(head) if head.kv_block is None else 0) + sched.own_blocks(head)
            assert need > sched.allocator.num_free, \
                (f"{head.prompt_id} waits for {need} blocks with {sched.allocator.num_free} free "
                 f"(longest free range {sched.allocator.largest_free()})")
        return admitted

    sched.schedule = checked
    return log


def _fragment(eng, samples: int) -> list[tuple[list[int], SamplingParams, str]]:
    """Short and long requests alternating, admitted in one step (prompts from the top of the
    arena, samples from the bottom); the short ones finish in that step and leave a free block
    between every two live runs. With one sample per long request and 64 blocks this is the
    reported layout: 32 blocks free, the longest free range 1 block."""
    long = SamplingParams(num_samples=samples, max_tokens=16, top_k=0, stop_token_ids=[])
    pairs = 64 // (2 + 1 + samples)
    reqs = []
    for i in range(pairs):
        reqs.append(([100 + i, 2, 3, 4, 5], SHORT, f"S{i}"))
        reqs.append(([1 + i, 2, 3, 4, 5], long, f"L{i}"))
    for prompt, p, rid in reqs:
        eng.add_request(prompt, p, rid)
    done = eng.step()
    assert sorted(o.prompt_id for o in done) == sorted(f"S{i}" for i in range(pairs))
    return reqs


def _run_all(eng, outs):
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    return {o.prompt_id: o.samples for o in outs}


def _roomy(reqs, prefix_sharing=True, model=FULL):
    eng = Engine(model, TOK, prefix_sharing=prefix_sharing)
    return {rid: row for (_, _, rid), row in
            zip(reqs, eng.generate([r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs]))}


@pytest.mark.parametrize("samples", [1, 3], ids=["reported-layout", "shared-prompts"])
def test_fragmented_blocks_do_not_starve_a_large_request(samples):
    """The reported layout: 32 of 64 blocks free but no two adjacent, and a request needing a
    3-block prompt run and a 4-block sample run arrives before 20 small requests. It is admitted
    at the next step (the engine compacts the arena between steps), not after the small ones,
    and every sample, those whose KV was moved included (with "shared-prompts", stored prompts
    read by 3 running samples each), is bit-identical to a roomy run's."""
    eng = Engine(FULL, TOK, kv_cache_bytes=64 * _block_bytes(FULL))
    reqs = _fragment(eng, samples)
    a = eng.scheduler.allocator
    if samples == 1:
        assert (a.num_free, a.largest_free()) == (32, 1)
    assert a.largest_free() < 3 + 4 <= a.num_free
    big = (list(range(40)), SamplingParams(max_tokens=64, top_k=0, stop_token_ids=[]), "B")
    small = [([200 + j, 1, 2], SHORT, f"T{j}") for j in range(20)]
    log = _admission_log(eng)
    for prompt, p, rid in [big, *small]:
        eng.add_request(prompt, p, rid)
    outs = eng.step()
    assert "B" in log[0], f"the 3 + 4 block request waited while {log[0]} were admitted"
    got = _run_all(eng, outs)
    reqs += [big, *small]
    assert {rid: toks([row]) for rid, row in got.items() if not rid.startswith("S")} == \
        {rid: toks([row]) for rid, row in _roomy(reqs).items() if not rid.startswith("S")}
    assert eng.kv_used_bytes == 0


def test_later_requests_never_overtake_one_waiting_for_memory():
    """First come, first served: a request whose samples do not all fit in the free blocks
    (6 samples x 5 blocks + a 3-block prompt, 32 blocks free) takes what fits, and no later
    request is admitted before its last sample is, although a small one would fit beside it."""
    eng = Engine(FULL, TOK, kv_cache_bytes=64 * _block_bytes(FULL))
    reqs = _fragment(eng, 1)
    big = (list(range(40)), SamplingParams(num_samples=6, max_tokens=80, top_k=0, stop_token_ids=[]), "B")
    small = [([200 + j, 1, 2], SHORT, f"T{j}") for j in range(6)]
    log = _admission_log(eng)
    for prompt, p, rid in [big, *small]:
        eng.add_request(prompt, p, rid)
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
        admitted = [rid for step in log for rid in step]
        if any(r.prompt_id == "B" for r in eng.scheduler.waiting):
            assert not any(rid.startswith("T") for rid in admitted), \
                f"admitted while B waited for memory: {admitted}"
    first = list(dict.fromkeys(rid for step in log for rid in step))
    assert first == ["B"] + [f"T{j}" for j in range(6)]
    got = {o.prompt_id: o.samples for o in outs}
    reqs += [big, *small]
    assert {rid: toks([got[rid]]) for _, _, rid in reqs if not rid.startswith("S")} == \
        {rid: toks([row]) for rid, row in _roomy(reqs).items() if not rid.startswith("S")}


class StopsLate(ToyLM):
    """ToyLM whose stop token (STOP) cannot come before position `after` and then comes with
    probability 1/mean at every step (the other logits scaled close to 0): with prompts of
    20-400 tokens and after = 900, mean = 200, samples end after 500-1,500 tokens."""

    STOP = 0

    def __init__(self, after: int, mean: int, **kw):
        super().__init__(**kw)
        with torch.no_grad():
            self.head.mul_(0.02)
        self.after = after
        self.stop_logit = math.log(self.info.vocab_size - 1) - math.log(mean - 1)

    def forward_step(self, tokens, batch, kv):
        logits = super().forward_step(tokens, batch, kv)
        pos = batch.positions[torch.arange(tokens.shape[0]), batch.last_index]
        stop = torch.where(pos >= self.after, self.stop_logit, -1e9)
        return torch.cat([stop[:, None], logits[:, 1:]], 1)  # STOP == 0


@pytest.fixture(scope="module")
def rl_case():
    """RL-like requests: 6 prompts of 20-400 tokens x 2 samples, max_tokens 16k (1,000 blocks
    reserved per sample), samples ending after about 1k tokens (StopsLate); and a roomy run's
    samples (prefix sharing on and off give the same bits: test_sharing_off_is_batch_invariant...)."""
    model = StopsLate(900, 200, context_len=16384 + 512).eval()
    rng = random.Random(1)
    p = SamplingParams(num_samples=2, max_tokens=16000, stop_token_ids=[StopsLate.STOP])
    reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(20, 400))], p, f"r{i}") for i in range(6)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny steps: a second thread only adds synchronisation
    try:
        yield model, reqs, _roomy(reqs, True, model)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "own-copy"])
def test_rl_lengths_admit_whenever_the_free_blocks_suffice(rl_case, prefix_sharing):
    """RL-like lengths (rl_case) under a budget of 4 samples' runs: requests are admitted in
    arrival order, the first waiting one is never kept waiting while enough blocks are free in
    total (it was before: the free blocks were cut into ranges by the prompt runs and the
    samples' runs of other lengths freed between live ones), and every sample is bit-identical
    to a roomy run's, although compactions moved live runs."""
    model, reqs, roomy = rl_case
    own = 1000 + (0 if prefix_sharing else 26)
    eng = Engine(model, TOK, kv_cache_bytes=(4 * own + 60) * _block_bytes(model), prefix_sharing=prefix_sharing)
    log = _admission_log(eng)
    outs = []
    for prompt, params, rid in reqs:
        eng.add_request(prompt, params, rid)
        outs.extend(eng.step())
    got = _run_all(eng, outs)
    assert list(dict.fromkeys(rid for step in log for rid in step)) == [rid for _, _, rid in reqs]
    lengths = sorted(len(s.tokens) for row in got.values() for s in row)
    assert 500 <= lengths[0] and lengths[-1] <= 1500  # the RL shape: 16k reserved, about 1k used
    assert {rid: toks([row]) for rid, row in got.items()} == {rid: toks([row]) for rid, row in roomy.items()}
    assert eng.num_compactions > 0 and eng.kv_used_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slide_down_moves_runs_exactly(dtype):
    """KVCache.slide_down, given the moves of a compaction (runs of 1-8 blocks, with part of
    their positions written; holes of 1 block and of 3 below them, so that runs overlap their
    destination, moved by 16 positions through a buffer of 5 positions, in several chunks, or
    by 64 in pieces, and others clear of it): every moved position holds exactly the keys and
    values its source held, in every layer; moves out of order are refused."""
    from engine.run_allocator import RunAllocator

    rng = random.Random(0)
    kv = KVCache(3, 2, 8, 1, 64, dtype, "cpu", num_positions=80 * BLOCK_SIZE)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    k0, v0 = kv.k.clone(), kv.v.clone()
    a = RunAllocator(80)
    runs = []
    while (s := a.allocate(n := 1 + len(runs) % 8)) is not None:
        runs.append((s, n))
    for i in (2, 0):  # run 1 moves by 1 block, runs 3 and up by 4
        a.free(*runs.pop(i))
    stretches = a.compact()
    moves = []
    for s, n in runs:
        st, _, d = next(x for x in stretches if x[0] <= s < x[0] + x[1])
        moves.append((s * BLOCK_SIZE, (s - st + d) * BLOCK_SIZE, rng.randint(n * BLOCK_SIZE // 2, n * BLOCK_SIZE)))
    moves.sort()
    assert any(d < s < d + n for s, d, n in moves if s - d == 16)  # through the buffer, several chunks
    assert any(d + n > s for s, d, n in moves if s - d == 64)  # in several pieces
    assert any(s >= d + n for s, d, n in moves)  # clear of its destination
    kv.slide_down(moves, chunk_bytes=kv.k[:, :5].nbytes)
    for s, d, n in moves:
        assert torch.equal(kv.k[:, d:d + n], k0[:, s:s + n]) and torch.equal(kv.v[:, d:d + n], v0[:, s:s + n])
    with pytest.raises(ValueError, match="out of order"):
        kv.slide_down([(32, 0, 16), (16, 0, 16)])
    with pytest.raises(ValueError, match="out of order"):
        kv.slide_down([(0, 16, 16)])


def test_compaction_on_the_gpu_attention_path():
    """The batched attention path that GPUs run (on CPU here), in the reported layout: the
    large request is admitted at once, and the tokens equal a roomy run's on the same path
    (that path is not batch-invariant by construction, so this compares tokens: the toy model
    has no near-ties here)."""
    eng = Engine(FULL, TOK, kv_cache_bytes=64 * _block_bytes(FULL))
    eng.kv.batched_decode = True
    reqs = _fragment(eng, 3)
    big = (list(range(40)), SamplingParams(num_samples=2, max_tokens=64, top_k=0, stop_token_ids=[]), "B")
    eng.add_request(*big)
    outs = eng.step()
    assert eng.num_compactions == 1 and any(s.request.prompt_id == "B" for s in eng.running.values())
    got = _run_all(eng, outs)
    roomy = Engine(FULL, TOK)
    roomy.kv.batched_decode = True
    reqs.append(big)
    ref = roomy.generate([r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs])
    assert {rid: [s.tokens for s in got[rid]] for _, _, rid in reqs if rid[0] != "S"} == \
        {rid: [s.tokens for s in row] for (_, _, rid), row in zip(reqs, ref) if rid[0] != "S"}
