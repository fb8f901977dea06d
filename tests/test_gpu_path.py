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


@pytest.fixture
def head_buffer_path(monkeypatch):
    """The head's path on a GPU in float32, forced on CPU: no compiled kernels (what
    BATCHGEN_NATIVE=0 decides) and no oneDNN, so `project_head` multiplies into the buffer
    it reuses from call to call (engine/models/base.py). Models loaded inside the test take it."""
    import engine.kernels.native as native

    monkeypatch.setattr(native, "_isa_choice", None)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)


def test_prefill_chunks_keep_each_prompts_last_logits(head_buffer_path):
    """Prompts of 4 and 50 tokens admitted in one step are prefilled in two chunks (their
    lengths differ too much to pad together), and each chunk's logits come out of the
    head's reused buffer: each prompt's first token (and every later one) is still the one
    it gets alone, for samples admitted with the prefill and for a sample admitted later
    from the stored logits (3 slots for 2 x 2 samples)."""
    from engine.engine import Engine

    eng = load_engine("tiny-random", device="cpu", dtype="float32", max_seq_len=256)
    long, short = list(range(40, 90)), [5, 6, 7, 8]
    p = SamplingParams(num_samples=2, max_tokens=4, temperature=0, stop_token_ids=[])
    alone = [[s.tokens for s in eng.generate([x], p)[0]] for x in (long, short)]
    assert eng.model._head_out is not None  # the reused buffer is what this test is about
    assert alone[0][0][0] != alone[1][0][0]
    for slots in (8, 3):
        e = Engine(eng.model, eng.tokenizer, max_seq_len=256, max_num_seqs=slots)
        together = [[s.tokens for s in row] for row in e.generate([long, short], p)]
        assert together == alone, f"max_num_seqs {slots}"
