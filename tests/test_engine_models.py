"""Engine properties on the real architectures: the built-in tiny-random model (nanochat 2026, sliding
windows, smear, value embeddings), a late-2025 nanochat checkpoint, two GPT-2s written by
transformers (one 512 wide), and two Llama-family checkpoints written by transformers (Llama
with llama3 rope scaling and grouped-query attention; Qwen3 with q/k norms, attention biases,
head_dim 24 and a sliding window on its second layer). For each: KV-cached decode equals a full forward at every
step, logprobs equal the full forward's log-softmax, fanned-out samples equal samples run
alone, and a request's tokens and logprobs, bit for bit, do not depend on the batch size or
its neighbours (on CPU in float32, where every projection is oneDNN's batch-invariant one).
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams, load_engine
from engine.engine import Engine

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


@pytest.fixture(scope="module", params=["tiny-random", "nanochat-2025", "gpt2", "gpt2-wide", "llama", "qwen3-window"])
def engine_parts(request, tmp_path_factory):
    """(model, tokenizer, vocab) for each architecture, loaded the way users load them."""
    if request.param == "tiny-random":
        eng = load_engine("tiny-random", device="cpu", dtype="float32", max_seq_len=256)
    elif request.param == "nanochat-2025":
        d = next(p for p in FIXTURES.iterdir() if p.name.endswith("16788ee"))
        eng = load_engine(d, device="cpu", dtype="float32", tokenizer=_byte_tokenizer_dir(tmp_path_factory))
    elif request.param in ("llama", "qwen3-window"):
        d = _llama_family_dir(tmp_path_factory, request.param)
        eng = load_engine(d, device="cpu", dtype="float32", tokenizer=_byte_tokenizer_dir(tmp_path_factory))
    else:
        d = _gpt2_dir(tmp_path_factory, *((512, 1) if request.param == "gpt2-wide" else (64, 2)))
        eng = load_engine(d, device="cpu", dtype="float32", tokenizer=_byte_tokenizer_dir(tmp_path_factory))
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


def test_logprobs_equal_full_forward(engine_parts):
    model, tok = engine_parts
    res = generate(model, tok, temperature=0.8, num_samples=2, max_tokens=8)
    for prompt, row in zip(PROMPTS, res):
        for s in row:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + s.tokens]))[0].float(), -1)
            want = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(s.tokens)]
            assert s.logprobs == pytest.approx(want, abs=2e-4)


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
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


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



@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_step_projections_use_onednn(engine_parts):
    """On CPU in float32 every projection of a step and the head run through oneDNN: each
    weight packed once, each result equal to F.linear within float error, each row
    bit-identical whatever the number of rows; the cache-free forward stays F.linear."""
    model, tok = engine_parts
    generate(model, tok, num_samples=1, max_tokens=2)
    packed = dict(model._packed_weights)
    weights = {n: w for n, w in model.named_parameters()
               if w.dim() == 2 and n.split(".")[-1] not in ("wte", "wpe", "ve", "embed")}  # not the embeddings
    assert packed and all(v is not None for v in packed.values())
    head = model.lm_head  # GPT-2's is the token embedding (tied), packed as the head
    assert {k[0] for k in packed} == {w.data_ptr() for w in weights.values()} | {head.data_ptr()}
    assert len(packed) == len({k[0] for k in packed})  # each weight once
    generate(model, tok, num_samples=2, max_tokens=3)
    assert model._packed_weights == packed  # nothing packed again
    g = torch.Generator().manual_seed(0)
    for w in weights.values():
        x = torch.randn(33, w.shape[1], generator=g)
        full = model.linear(x, w)
        assert torch.allclose(full, F.linear(x, w), rtol=1e-4, atol=1e-4)
        for n in (1, 4, 17):
            assert torch.equal(model.linear(x[:n], w), full[:n])
        with_t = model.linear(x.view(3, 11, -1), w)  # (B, T, C), as in a prefill
        assert torch.equal(with_t.reshape(33, -1), full)
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = dict(model._packed_weights)
        model(x)
        assert model._packed_weights == before and not model._reference


def test_prefix_sharing_off_gives_identical_samples(engine_parts):
    """Each sample reading its own copy of the prompt (prefix_sharing=False) gives the same
    tokens and logprobs, bit for bit, as reading the shared one; with max_num_seqs=4 some
    samples join after their prompt's prefill (stored logits and model state)."""
    model, tok = engine_parts
    params = SamplingParams(num_samples=3, max_tokens=10, top_k=20, stop_token_ids=[])
    off = Engine(model, tok, max_num_seqs=4, prefix_sharing=False).generate(PROMPTS, params, prompt_ids=IDS)
    assert tokens(off) == tokens(generate(model, tok))
