"""Engine properties on the real architectures: the built-in tiny-random model (nanochat 2026, sliding
windows, smear, value embeddings), a late-2025 nanochat checkpoint, two GPT-2s written by
transformers (one 512 wide), and two Llama-family checkpoints written by transformers (Llama
with llama3 rope scaling and grouped-query attention; Qwen3 with q/k norms, attention biases,
head_dim 24 and a sliding window on its second layer). For each: KV-cached decode equals a full forward at every
step, logprobs equal the full forward's log-softmax, fanned-out samples equal samples run
alone, and a request's tokens and logprobs, bit for bit, do not depend on the batch size or
its neighbours (on CPU, where every projection, attention and fused operation is a compiled
kernel whose reduction order batchgen defines). Three of them again with bfloat16 weights.
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams, load_engine
from engine.engine import Engine
from engine.scoring import teacher_forced_logits
from engine.kernels.native import PackedWeight, native_kernels
from engine.sampling import token_logprobs

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py

FIXTURES = Path(__file__).parent / "fixtures" / "nanochat"


def _gpt2_dir(tmp_path_factory, n_embd=64, n_layer=2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=128, vocab_size=265)
    d = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    return d


def _llama_family_dir(tmp_path_factory, name):
    """A random Llama-family checkpoint (save_pretrained), weights N(0, 0.15), norm gains near 1."""
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    if name == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_parameters=rope))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **shape, head_dim=24, attention_bias=True, use_sliding_window=True, sliding_window=12, max_window_layers=1))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in n else 0.15 * noise)
    d = tmp_path_factory.mktemp(name)
    hf.save_pretrained(d)
    return d


@pytest.fixture(scope="module", params=["tiny-random", "nanochat-2025", "gpt2", "gpt2-wide", "llama", "qwen3-window",
                                        "tiny-random-bf16", "gpt2-bf16", "llama-bf16"])
def engine_parts(request, tmp_path_factory):
    """(model, tokenizer, vocab) for each architecture, loaded the way users load them; the
    -bf16 ones with bfloat16 weights (bfloat16 GEMMs and KV cache, float32 activations)."""
    name, dtype = request.param.removesuffix("-bf16"), "bfloat16" if request.param.endswith("-bf16") else "float32"
    if dtype == "bfloat16" and native_kernels() is None:
        pytest.skip("bfloat16 weights with float32 activations need the compiled kernels")
    if name == "tiny-random":
        eng = load_engine("tiny-random", device="cpu", dtype=dtype, max_seq_len=256)
    elif name == "nanochat-2025":
        d = next(p for p in FIXTURES.iterdir() if p.name.endswith("16788ee"))
        eng = load_engine(d, device="cpu", dtype=dtype, tokenizer=_byte_tokenizer_dir(tmp_path_factory))
    elif name in ("llama", "qwen3-window"):
        d = _llama_family_dir(tmp_path_factory, name)
        eng = load_engine(d, device="cpu", dtype=dtype, tokenizer=_byte_tokenizer_dir(tmp_path_factory))
    else:
        d = _gpt2_dir(tmp_path_factory, *((512, 1) if name == "gpt2-wide" else (64, 2)))
        eng = load_engine(d, device="cpu", dtype=dtype, tokenizer=_byte_tokenizer_dir(tmp_path_factory))
    assert eng.kv.k.dtype == getattr(torch, dtype)
    return eng.model, eng.tokenizer


def _byte_tokenizer_dir(tmp_path_factory):
    """A tokenizer.pkl with 256 byte tokens and nanochat's specials (vocab 265 <= the fixtures' 300)."""
    import pickle

    import tiktoken

    from toy import SPECIALS

    d = tmp_path_factory.mktemp("tok")
    enc = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={s: 256 + i for i, s in enumerate(SPECIALS)})
    with open(d / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f)
    return d / "tokenizer.pkl"


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 30, [100, 101], list(range(40, 90)), [7]]
IDS = ["p0", "p1", "p2", "p3", "p4"]


def generate(model, tok, max_num_seqs=64, prompts=PROMPTS, ids=IDS, **kw):
    params = SamplingParams(**{"num_samples": 3, "max_tokens": 10, "top_k": 20, "stop_token_ids": [], **kw})
    return Engine(model, tok, max_num_seqs=max_num_seqs).generate(prompts, params, prompt_ids=ids)


def tokens(res):
    """Each sample's tokens and logprobs: compared exactly, so the logits behind them must be
    bit-identical too."""
    return [[(s.tokens, s.logprobs) for s in row] for row in res]


def test_cached_greedy_equals_full_forward(engine_parts):
    """Greedy decoding through the KV cache gives the argmax of a cache-free forward at every step."""
    model, tok = engine_parts
    res = generate(model, tok, temperature=0.0, num_samples=1, max_tokens=12)
    for prompt, row in zip(PROMPTS, res):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert row[0].tokens == seq[len(prompt):]


def logprob_tolerance(model, fp32: float) -> float:
    """fp32 for a float32 model. With bfloat16 weights a last-bit difference upstream (the
    cached step and the full forward sum in other orders) can flip one activation's rounding
    to bfloat16, and every later position reads it: on these random-weight models a logprob
    moved by up to 0.031 (measured). A systematic error (a wrong rounding, a stale cache)
    moves them by far more; SmolLM2's bfloat16 parity is checked in test_smollm2.py."""
    return fp32 if model.act_dtype is None else 0.1


def test_logprobs_equal_full_forward(engine_parts):
    model, tok = engine_parts
    res = generate(model, tok, temperature=0.8, num_samples=2, max_tokens=8)
    for prompt, row in zip(PROMPTS, res):
        for s in row:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + s.tokens]))[0].float(), -1)
            want = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(s.tokens)]
            assert s.logprobs == pytest.approx(want, abs=logprob_tolerance(model, 2e-4))


@pytest.mark.parametrize("max_num_seqs", [1, 4, 32])
def test_batch_size_and_fan_out_independence(engine_parts, max_num_seqs):
    """Same tokens and logprobs at max batch sizes 1, 4 and 32 (1 also means every sample is
    prefilled alone, without padding)."""
    model, tok = engine_parts
    assert tokens(generate(model, tok, max_num_seqs=max_num_seqs)) == tokens(generate(model, tok))


def test_batch_variant_mode_gives_the_same_tokens(engine_parts):
    """batch_invariant=False (one masked attention call per step): the same tokens at batch
    sizes 1 and 32, logprobs equal within float error."""
    model, tok = engine_parts
    params = SamplingParams(num_samples=3, max_tokens=10, top_k=20, stop_token_ids=[])
    runs = [Engine(model, tok, max_num_seqs=n, batch_invariant=False).generate(PROMPTS, params, prompt_ids=IDS)
            for n in (1, 32)]
    exact = generate(model, tok)
    for a, b, c in zip(*runs, exact):
        assert [s.tokens for s in a] == [s.tokens for s in b] == [s.tokens for s in c]
        for x, y in zip(a, c):
            assert x.logprobs == pytest.approx(y.logprobs, abs=logprob_tolerance(model, 1e-4))


def test_thread_count_does_not_matter(engine_parts):
    """The same tokens and logprobs, bit for bit, with 1 and 2 torch threads: a worker's
    cpus_per_worker (its thread count) cannot change a sample (a lone-query SDPA call did)."""
    model, tok = engine_parts
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tokens(generate(model, tok))
        torch.set_num_threads(2)
        two = tokens(generate(model, tok))
    finally:
        torch.set_num_threads(threads)
    assert one == two


def test_neighbours_do_not_matter(engine_parts):
    model, tok = engine_parts
    ref = tokens(generate(model, tok))
    mixed = generate(model, tok, prompts=[[9] * 11, PROMPTS[3], [2, 3, 4], PROMPTS[0]], ids=["x", "p3", "y", "p0"])
    assert tokens(mixed)[1] == ref[3] and tokens(mixed)[3] == ref[0]



@pytest.mark.skipif(native_kernels() is None, reason="the compiled kernels are unavailable here")
def test_step_projections_use_the_compiled_gemm(engine_parts):
    """On CPU every projection of a step and the head run through the compiled GEMM
    (engine/kernels/csrc/gemm.cpp): each weight packed once, each result equal to F.linear within
    float error, each row bit-identical whatever the number of rows; the cache-free forward
    stays F.linear."""
    model, tok = engine_parts
    generate(model, tok, num_samples=1, max_tokens=2)
    packed = dict(model._packed_weights)
    weights = {n: w for n, w in model.named_parameters()
               if w.dim() == 2 and n.split(".")[-1] not in ("wte", "wpe", "ve", "embed")}  # not the embeddings
    assert packed and all(isinstance(v, PackedWeight) for v in packed.values())
    head = model.lm_head  # GPT-2's is the token embedding (tied), packed as the head
    assert {k[0] for k in packed} == {w.data_ptr() for w in weights.values()} | {head.data_ptr()}
    assert len(packed) == len({k[0] for k in packed})  # each weight once
    generate(model, tok, num_samples=2, max_tokens=3)
    assert model._packed_weights == packed  # nothing packed again
    g = torch.Generator().manual_seed(0)
    for w in weights.values():
        x = torch.randn(33, w.shape[1], generator=g)
        full = model.linear(x, w)  # bfloat16 weights: float32 activations, rounded for the products
        assert torch.allclose(full, F.linear(x.to(w.dtype).float(), w.float()), rtol=1e-4, atol=1e-4)
        for n in (1, 4, 17):
            assert torch.equal(model.linear(x[:n], w), full[:n])
        with_t = model.linear(x.view(3, 11, -1), w)  # (B, T, C), as in a prefill
        assert torch.equal(with_t.reshape(33, -1), full)
    if head.dtype == torch.bfloat16:  # an odd K (bfloat16 products go in pairs): the compiled GEMM all the same
        w = torch.randn(21, 37, generator=g).to(torch.bfloat16)
        x = torch.randn(33, 37, generator=g)
        full = model.linear(x, w)
        assert torch.allclose(full, F.linear(x.to(w.dtype).float(), w.float()), rtol=1e-4, atol=1e-4)
        key = next(k for k in model._packed_weights if k[0] == w.data_ptr())
        assert isinstance(model._packed_weights.pop(key), PackedWeight)
        for n in (1, 4, 17):
            assert torch.equal(model.linear(x[:n], w), full[:n])
        model._packed_weights.pop(next(k for k in model._packed_weights if k[0] == w.data_ptr()))
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = dict(model._packed_weights)
        model(x)
        assert model._packed_weights == before and not model._reference


def test_bfloat16_weights_keep_activations_in_float32(engine_parts):
    """dtype bfloat16 on CPU stores the matrices in bfloat16 and keeps norms, biases and
    per-layer scalars in float32; the step's activations and logits are float32 and its
    KV cache bfloat16 (models/base.py, CausalLM)."""
    model, tok = engine_parts
    if model.act_dtype is None:
        assert {p.dtype for p in model.parameters()} == {torch.float32} and model.kv_dtype == torch.float32
        return
    for name, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if p.dim() == 2 else torch.float32), name
    assert model.act_dtype == torch.float32 and model.kv_dtype == torch.bfloat16
    eng = Engine(model, tok, max_num_seqs=4)
    assert eng.kv.k.dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in eng.kv.state.values())
    with torch.no_grad():
        assert model(torch.tensor([PROMPTS[0]])).dtype == torch.float32


def test_teacher_forced_logits_are_each_prefixs_prefill(engine_parts):
    """teacher_forced_logits: row t of one prefill over a sequence is, bit for bit, the last
    row of prefilling its first t + 1 tokens alone (a prefill row depends on its own keys
    only), and the first generated token's logprob is the same number."""
    model, tok = engine_parts
    seq = PROMPTS[3]
    full = teacher_forced_logits(model, seq)
    for t in (0, 9, 31, 32, 49):
        assert torch.equal(full[t], teacher_forced_logits(model, seq[:t + 1])[-1]), t
    s = generate(model, tok, prompts=[seq[:20]], ids=["x"], temperature=0.0, num_samples=1, max_tokens=1)[0][0]
    assert s.tokens == [int(full[19].argmax())]
    assert s.logprobs[0] == token_logprobs(full[19:20].clone(), torch.tensor(s.tokens)).item()


def test_prefix_sharing_off_gives_identical_samples(engine_parts):
    """Each sample reading its own copy of the prompt (prefix_sharing=False) gives the same
    tokens and logprobs, bit for bit, as reading the shared one; with max_num_seqs=4 some
    samples join after their prompt's prefill (stored logits and model state)."""
    model, tok = engine_parts
    params = SamplingParams(num_samples=3, max_tokens=10, top_k=20, stop_token_ids=[])
    off = Engine(model, tok, max_num_seqs=4, prefix_sharing=False).generate(PROMPTS, params, prompt_ids=IDS)
    assert tokens(off) == tokens(generate(model, tok))


def test_prefix_caching_gives_identical_samples(engine_parts):
    """Four prompts behind a shared 40-token prefix and a duplicate of the first: with prefix
    caching each copies the stored prefix's KV (the 40 shared tokens; the duplicate all but its
    last token) and prefills the rest, and its samples equal those of whole prefills bit for
    bit, with max_num_seqs 64 (the donor prefilled in the same step) and 4 (in earlier
    steps too); nanochat's smear mixes the cached prefix's last token into the first computed
    one, as the whole prefill does."""
    model, tok = engine_parts
    shared = list(range(40, 80))
    prompts = [shared + [5 + i, 9, 11 + i] for i in range(4)] + [shared + [5, 9, 11]]
    params = SamplingParams(num_samples=3, max_tokens=10, top_k=20, stop_token_ids=[])
    want = tokens(Engine(model, tok, prefix_caching=False).generate(prompts, params))
    for seqs in (64, 4):
        eng = Engine(model, tok, max_num_seqs=seqs)
        assert tokens(eng.generate(prompts, params)) == want, f"max_num_seqs {seqs}"
        assert eng.prefix_caching
        # with 4 slots a prompt admitted after its predecessors finished finds no donor
        assert eng.num_cached_prompt_tokens == 3 * 40 + 42 if seqs == 64 else eng.num_cached_prompt_tokens >= 40
