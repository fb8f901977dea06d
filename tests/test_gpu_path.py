"""The GPU code path, exercised on CPU (no GPU is lent to this project).

GPUs run the batched attention path (engine/kernels/batched_attention.py: decode_batched) in
bfloat16; on CPU `KVCache.batched_decode` selects it. On tiny-random (nanochat architecture: sliding
windows, per-sequence smear state, GQA): bfloat16 greedy tokens equal float32's up to
near-ties, in both attention paths and both prefix-sharing modes; the batched path in float32
gives the CPU path's tokens; and `dtype: auto` picks bfloat16 only on GPUs with native
support.
"""
import pytest
import torch

from engine import SamplingParams, load_engine
from engine.engine import Engine
from engine.loading import checkpoint
from engine.loading.checkpoint import resolve_dtype

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 30, [100, 101], list(range(40, 90)), [7]]
STEPS = 16


@pytest.fixture(scope="module")
def engines():
    kw = dict(device="cpu", max_seq_len=256)
    return {dt: load_engine("tiny-random", dtype=dt, **kw) for dt in ("float32", "bfloat16")}


def _engine(eng, batched: bool = False, **kw):
    from engine.engine import Engine

    e = Engine(eng.model, eng.tokenizer, max_seq_len=256, **kw)
    e.kv.batched_decode = batched
    return e


def _greedy(eng, batched: bool = False, **kw):
    e = _engine(eng, batched, **kw)
    p = SamplingParams(num_samples=2, max_tokens=STEPS, temperature=0, stop_token_ids=[])
    return [[s.tokens for s in row] for row in e.generate(PROMPTS, p)]


@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "own-copy"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "grouped"])
def test_bfloat16_tokens_equal_float32_up_to_near_ties(engines, batched, prefix_sharing):
    """Where a bfloat16 greedy sample first leaves the float32 one, the float32 logits of the
    two tokens are closer than bfloat16's own error on that step's logits (a near-tie); most
    tokens agree."""
    ref = _greedy(engines["float32"])
    got = _greedy(engines["bfloat16"], batched, prefix_sharing=prefix_sharing)
    agreed = 0
    for prompt, rows_ref, rows_got in zip(PROMPTS, ref, got):
        assert rows_got[0] == rows_got[1]  # greedy samples of one prompt agree with each other
        a, b = rows_ref[0], rows_got[0]
        j = next((i for i in range(STEPS) if a[i] != b[i]), STEPS)
        agreed += j
        if j == STEPS:
            continue
        x = torch.tensor([prompt + a[:j]])
        with torch.no_grad():
            l32 = engines["float32"].model(x)[0, -1]
            l16 = engines["bfloat16"].model(x)[0, -1].float()
        err = (l16 - l32).abs().max().item()
        assert l32[a[j]] - l32[b[j]] <= 2 * err, f"prompt {prompt[:4]}...: step {j} is not a near-tie"
    assert agreed >= 0.6 * len(PROMPTS) * STEPS


@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "own-copy"])
def test_batched_path_is_used_and_close_to_the_invariant_one(engines, prefix_sharing):
    """KVCache.batched_decode runs decode_batched (the GPU path): in float32 the same tokens
    as the CPU path, logprobs within 1e-4."""
    import engine.kernels.attention_backend as backend

    calls = []
    original = backend.decode_batched

    def spy(*a, **k):
        calls.append(1)
        return original(*a, **k)

    eng = engines["float32"]
    p = SamplingParams(num_samples=3, max_tokens=8, top_k=20, stop_token_ids=[])
    inv = _engine(eng, prefix_sharing=prefix_sharing).generate(PROMPTS, p)
    backend.decode_batched = spy
    try:
        bat = _engine(eng, batched=True, max_num_seqs=4, prefix_sharing=prefix_sharing).generate(PROMPTS, p)
    finally:
        backend.decode_batched = original
    assert calls
    for a, b in zip(inv, bat):
        for x, y in zip(a, b):
            assert x.tokens == y.tokens
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_dtype_auto_is_bfloat16_only_on_native_gpus(monkeypatch):
    """auto: bfloat16 on CUDA compute capability >= 8.0, float32 on older GPUs (emulated
    bfloat16 is slower); on CPU what the bfloat16 probe says (tests/test_gemm.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    for cap, want in (((7, 5), torch.float32), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16),
                      ((6, 1), torch.float32)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert resolve_dtype("auto", cuda) == want, cap
    monkeypatch.setattr(checkpoint, "bfloat16_is_faster", lambda: (False, "probe"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(checkpoint, "bfloat16_is_faster", lambda: (True, "probe"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.fixture(params=["torch", "compiled-float32", "compiled-bfloat16"])
def head_buffer_path(request, monkeypatch):
    """A path whose head writes into the buffer `project_head` reuses from call to call
    (engine/models/base.py), and the dtype to load: "torch" is a GPU's path in float32,
    forced on CPU (no compiled kernels, what BATCHGEN_NATIVE=0 decides, and no oneDNN);
    "compiled-*" the compiled GEMM's (skipped where the library cannot be built). Models
    loaded inside the test take it."""
    import engine.kernels.native as native

    if request.param == "torch":
        monkeypatch.setattr(native, "_isa_choice", None)
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        return "float32"
    if native.native_kernels() is None:
        pytest.skip("the compiled kernels cannot be built here")
    return request.param.split("-")[1]


def test_prefill_chunks_keep_each_prompts_last_logits(head_buffer_path):
    """Prompts of 4 and 50 tokens admitted in one step are prefilled in two chunks (their
    lengths differ too much to pad together), and each chunk's logits come out of the
    head's reused buffer: each prompt's first token (and every later one) is still the one
    it gets alone, for samples admitted with the prefill and for a sample admitted later
    from the stored logits (3 slots for 2 x 2 samples)."""
    from engine.engine import Engine

    eng = load_engine("tiny-random", device="cpu", dtype=head_buffer_path, max_seq_len=256)
    long, short = list(range(40, 90)), [5, 6, 7, 8]
    p = SamplingParams(num_samples=2, max_tokens=4, temperature=0, stop_token_ids=[])
    alone = [[s.tokens for s in eng.generate([x], p)[0]] for x in (long, short)]
    assert eng.model._head_out is not None  # the reused buffer is what this test is about
    assert alone[0][0][0] != alone[1][0][0]
    for slots in (8, 3):
        e = Engine(eng.model, eng.tokenizer, max_seq_len=256, max_num_seqs=slots)
        together = [[s.tokens for s in row] for row in e.generate([long, short], p)]
        assert together == alone, f"max_num_seqs {slots}"


def _profiled(fn):
    """(fn()'s result, the aten operations it issued at top level, names of all its aten
    operations): what the torch profiler records on CPU, where each top-level operation
    stands for a kernel launch (or a view) on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]

    def top(e):
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return False
            p = p.cpu_parent
        return True

    return out, sum(1 for e in events if top(e)), {e.name for e in events}


def _rows(B, V, kinds, seed=0):
    """B rows of logits over V tokens and their parameters, cycling through `kinds`
    ((temperature, top_k, top_p, min_p) each)."""
    from engine.sampling import request_key

    g = torch.Generator().manual_seed(seed)
    params = [kinds[i % len(kinds)] for i in range(B)]
    col = lambda j, dt: torch.tensor([p[j] for p in params], dtype=dt)
    keys = torch.tensor([request_key(5, f"p{i}", i % 3) for i in range(B)], dtype=torch.long)
    return (torch.randn(B, V, generator=g) * 3, col(0, torch.float32), col(1, torch.long), col(2, torch.float32),
            col(3, torch.float32), keys, torch.arange(B, dtype=torch.long) + 7)


KINDS = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 20, 1.0, 0.0), (1.2, 5, 0.9, 0.0), (0.9, 0, 0.8, 0.0),
         (1.1, 0, 1.0, 0.03), (0.7, 0, 1.0, 0.0)]  # plain, greedy, top_k, top_k + top_p, top_p, min_p, plain


@pytest.mark.parametrize("kinds", [KINDS, KINDS[:1], KINDS[2:3], KINDS[4:5]], ids=["mixed", "plain", "top_k", "top_p"])
@pytest.mark.parametrize("modes", ["raw", "processed", "both"])
def test_gpu_sampling_path_gives_the_cpu_paths_bits(kinds, modes):
    """The sampling path GPUs take (`batched`: the whole batch at once, no host
    synchronisation), run on CPU tensors, gives the CPU path's tokens and logprobs bit for
    bit, for every sampling kind alone and mixed in one batch, in either logprobs mode and
    both, and reads no device value on the host (no .item(), bool() or int() of a tensor:
    on a GPU each is a synchronisation)."""
    from engine.sampling import row_kinds, sample_step

    B, V = 45, 3001
    args = _rows(B, V, kinds)
    kinds_ = row_kinds(*args[1:5])
    processed = {"raw": [False] * B, "processed": [True] * B, "both": [i % 2 == 0 for i in range(B)]}[modes]
    want = sample_step(args[0].clone(), *args[1:], kinds_, processed)
    (got, _, names) = _profiled(lambda: sample_step(args[0].clone(), *args[1:], kinds_, processed, batched=True))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not names & {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"}, names


def test_gpu_plain_sampling_issues_a_bounded_number_of_operations():
    """Plain sampling (no truncation) over Qwen2.5's 151,936-token vocabulary: the GPU path
    issues the same number of operations for 4 rows as for 64 (under 100: one pass; the CPU
    path races a cache-sized chunk of 3 rows at a time, about 70 operations per chunk, so it
    issues about 1,500 for 64 rows), with the CPU path's tokens and logprobs."""
    from engine.sampling import row_kinds, sample_step

    V = 151_936
    counts = {}
    for B in (4, 64):
        args = _rows(B, V, KINDS[:1], seed=B)
        kinds = row_kinds(*args[1:5])
        want = sample_step(args[0].clone(), *args[1:], kinds, [False] * B)
        got, counts[B], _ = _profiled(lambda: sample_step(args[0].clone(), *args[1:], kinds, [False] * B,
                                                          batched=True))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counts[4] == counts[64] < 100, counts


def test_engine_on_the_gpu_sampling_path_gives_the_same_samples(monkeypatch):
    """An engine whose sampling takes the GPU path (`batched_sampling`, on by default on a
    GPU) gives the CPU path's samples, tokens and logprobs bit for bit, for plain requests
    and for plain, top_k, top_p and greedy ones mixed in either logprobs mode, and every
    step's sampling of plain rows issues the same number of operations whatever the number
    of rows (24, 18, 12, 6)."""
    import engine.engine as E

    eng = load_engine("tiny-random", device="cpu", dtype="float32", max_seq_len=128)
    prompts = [[5, 6, 7, 8], [9] * 12, [100, 3], list(range(20, 40))]
    params = [SamplingParams(num_samples=6, max_tokens=n, temperature=1.0, top_k=0, stop_token_ids=[])
              for n in (6, 5, 7, 4)]  # plain rows, raw logprobs: 24 rows, then 18, 12, 6 as requests end
    mixed = [SamplingParams(num_samples=3, max_tokens=6, temperature=0.7, top_k=20, stop_token_ids=[]),
             SamplingParams(num_samples=2, max_tokens=5, temperature=1.2, top_p=0.8, logprobs_mode="processed",
                            stop_token_ids=[]),
             SamplingParams(num_samples=1, max_tokens=7, temperature=0.0, stop_token_ids=[]),
             SamplingParams(num_samples=4, max_tokens=4, temperature=1.0, top_k=0, stop_token_ids=[])]
    ops: dict[int, set[int]] = {}
    original = E.sample_step

    def counted(logits, *a, **k):
        out, n, _ = _profiled(lambda: original(logits, *a, **k))
        ops.setdefault(logits.shape[0], set()).add(n)
        return out

    for ps in (params, mixed):
        want = Engine(eng.model, eng.tokenizer, max_seq_len=128).generate(prompts, ps)
        e = Engine(eng.model, eng.tokenizer, max_seq_len=128)
        e.batched_sampling = True
        if ps is params:
            monkeypatch.setattr(E, "sample_step", counted)
        got = e.generate(prompts, ps)
        monkeypatch.undo()
        for a, b in zip(want, got):
            assert [(s.tokens, s.logprobs) for s in a] == [(s.tokens, s.logprobs) for s in b]
    assert sorted(ops) == [6, 12, 18, 24] and len(set().union(*ops.values())) == 1, ops
    assert Engine(eng.model, eng.tokenizer, max_seq_len=128).batched_sampling is False  # on CPU; True on a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (none is lent to this project's tests)")
def test_gpu_sampling_does_not_synchronise_on_cuda():
    """On a GPU: sampling rows of every kind, in both logprobs modes, waits for nothing
    (torch's sync debug mode raises on any synchronisation), and gives the CPU's tokens
    (logprobs within 1e-4: the GPU's log_softmax and top-k are not the CPU's kernels)."""
    from engine.sampling import row_kinds, sample_step

    B = 45
    host = _rows(B, 3001, KINDS)
    kinds = row_kinds(*host[1:5])
    processed = [i % 2 == 0 for i in range(B)]
    want = sample_step(host[0].clone(), *host[1:], kinds, processed)
    dev = [x.cuda() for x in host]
    sample_step(dev[0].clone(), *dev[1:], kinds, processed)  # warm-up: pinned memory, kernels loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sample_step(dev[0].clone(), *dev[1:], kinds, processed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.allclose(got[1].cpu(), want[1], atol=1e-4, rtol=0)
