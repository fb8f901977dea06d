"""engine.models.gpt2 against transformers' GPT2LMHeadModel (random weights, fp32).

Checks: cache-free logits, the KV-cached path (batched right-padded prefill, decode at
per-row positions, contiguous and gathered slots), greedy decoding vs `generate`, the
loader's errors, and the engine end to end (`load_engine`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from engine.kv_cache import KVCache, StepBatch  # noqa: E402
from engine.loading.errors import CheckpointError  # noqa: E402
from engine.loading.gpt2 import load_gpt2_checkpoint  # noqa: E402

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py

CPU = torch.device("cpu")
MERGES = [" t", " a", "he", "in", "re", "on", " the", "er", " s", "at", "en", "nd"]
VOCAB = 256 + len(MERGES) + 1  # bytes, merges, <|endoftext|>
EOT = VOCAB - 1
N_POS = 96


def _byte_unicode() -> dict[int, str]:
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in bs]
    return {**{b: chr(b) for b in bs}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def write_tokenizer(d: Path) -> None:
    """A small GPT-2 byte-level vocabulary: 256 bytes, MERGES, <|endoftext|> (VOCAB ids)."""
    bu = _byte_unicode()
    vocab = {bu[b]: i for i, b in enumerate(sorted(bu))}
    lines = ["#version: 0.2"]
    for m in MERGES:
        s = "".join(bu[b] for b in m.encode())
        # split the merge into two known tokens (longest known prefix)
        for cut in range(len(s) - 1, 0, -1):
            if s[:cut] in vocab and s[cut:] in vocab:
                lines.append(f"{s[:cut]} {s[cut:]}")
                break
        vocab[s] = len(vocab)
    vocab["<|endoftext|>"] = EOT
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def make_hf(seed: int, **kw) -> GPT2LMHeadModel:
    """A random GPT-2 with every parameter non-trivial (LayerNorm gains/biases included)."""
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=N_POS, bos_token_id=EOT, eos_token_id=EOT, **kw)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("weight") else torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    return model


@pytest.fixture(scope="module")
def ckpt_st(tmp_path_factory):
    """safetensors checkpoint (transformers' save_pretrained), 3 layers x 64 wide, 4 heads."""
    d = tmp_path_factory.mktemp("gpt2_st")
    hf = make_hf(0, n_embd=64, n_layer=3, n_head=4)
    hf.save_pretrained(d)
    write_tokenizer(d)
    return d, hf


@pytest.fixture(scope="module")
def ckpt_bin(tmp_path_factory):
    """pytorch_model.bin checkpoint, old style: lm_head.weight and attn.bias buffers present,
    2 layers x 96 wide, 3 heads, plus the inverse-layer-index attention scale."""
    d = tmp_path_factory.mktemp("gpt2_bin")
    hf = make_hf(1, n_embd=96, n_layer=2, n_head=3, scale_attn_by_inverse_layer_idx=True,
                 reorder_and_upcast_attn=True)
    hf.config.save_pretrained(d)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for i in range(2):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(N_POS, N_POS, dtype=torch.bool))[None, None]
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, d / "pytorch_model.bin")
    write_tokenizer(d)
    return d, hf


@pytest.fixture(scope="module")
def ckpt_wide(tmp_path_factory):
    """safetensors, 2 layers x 512 wide, 8 heads: GPT-2-like widths, where the oneDNN step
    path (engine/models/base.py) and F.linear differ the most in their last bits."""
    d = tmp_path_factory.mktemp("gpt2_wide")
    hf = make_hf(2, n_embd=512, n_layer=2, n_head=8)
    hf.save_pretrained(d)
    write_tokenizer(d)
    return d, hf


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 5, 17, 9, 30, 2, 12, 23, 7, 14][:n]
    return [torch.randint(0, VOCAB, (L,), generator=g).tolist() for L in lens]


@pytest.mark.parametrize("which", ["ckpt_st", "ckpt_bin", "ckpt_wide"])
def test_logits_match_transformers(which, request, record_property):
    d, hf = request.getfixturevalue(which)
    model = load_gpt2_checkpoint(d, CPU, torch.float32)
    assert model.info.arch == "gpt2" and model.info.vocab_size == VOCAB and model.info.context_len == N_POS
    assert model.info.n_layer == hf.config.n_layer and model.info.n_kv_head == hf.config.n_head
    assert model.info.head_dim == hf.config.n_embd // hf.config.n_head and model.info.state_dims == {}
    worst = 0.0
    for p in _prompts(10, 3) + [list(range(N_POS))[:N_POS]]:
        x = torch.tensor([p]) % VOCAB
        with torch.no_grad():
            want = hf(x).logits
        got = model(x)
        assert got.dtype == torch.float32 and got.shape == want.shape
        worst = max(worst, (got - want).abs().max().item())
    batch = torch.randint(0, VOCAB, (4, 20))
    with torch.no_grad():
        worst = max(worst, (model(batch) - hf(batch).logits).abs().max().item())
    record_property("max_abs_diff", worst)
    print(f"{which}: max |logits - transformers| = {worst:.3g}")
    assert worst <= 1e-4


def _run_cached(model, prompts, slots, slot_start, steps, num_slots=8):
    """Prefill `prompts` right-padded into `slots`, then `steps` greedy decode steps; compare
    every step's logits with the cache-free forward over each row's whole sequence."""
    info = model.info
    kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, num_slots, 64, torch.float32, CPU)
    kv.k.zero_(), kv.v.zero_()  # decode reads up to the longest row: no uninitialised memory (NaN * 0)
    B, T = len(prompts), max(map(len, prompts))
    toks = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    batch = StepBatch(slots=torch.tensor(slots), positions=torch.arange(T).expand(B, T), last_index=lens - 1,
                      prefill=True)
    logits = model.forward_step(toks, batch, kv)
    seqs = [list(p) for p in prompts]
    worst = 0.0
    for step in range(steps + 1):
        for i, s in enumerate(seqs):
            ref = model(torch.tensor([s]))[0, -1]
            worst = max(worst, (logits[i] - ref).abs().max().item())
        if step == steps:
            break
        nxt = logits.argmax(-1)
        pos = torch.tensor([len(s) for s in seqs])
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        batch = StepBatch(slots=torch.tensor(slots), positions=pos[:, None], last_index=torch.zeros(B, dtype=torch.long),
                          prefill=False, kv_len=int(pos.max()) + 1, slot_start=slot_start)
        logits = model.forward_step(nxt[:, None], batch, kv)
        assert logits.shape == (B, VOCAB) and logits.dtype == torch.float32
    return worst


@pytest.mark.parametrize("which", ["ckpt_st", "ckpt_bin", "ckpt_wide"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["slot_start", "gather"])
def test_cached_path_matches_forward(which, contiguous, request):
    d, _ = request.getfixturevalue(which)
    model = load_gpt2_checkpoint(d, CPU, torch.float32)
    prompts = _prompts(5, 11)  # lengths 1, 5, 17, 9, 30
    slots = [2, 3, 4, 5, 6] if contiguous else [6, 0, 4, 1, 7]
    worst = _run_cached(model, prompts, slots, 2 if contiguous else None, steps=12)
    print(f"{which} {'slot_start' if contiguous else 'gather'}: max |cached - forward| = {worst:.3g}")
    assert worst <= 1e-4


def _hf_greedy(hf, prompts, n):
    """transformers' greedy continuation of each prompt (one left-padded batch)."""
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0)
    assert out.shape == (len(prompts), L + n)
    return out[:, L:].tolist()


@pytest.fixture(scope="module")
def greedy_ref(ckpt_st):
    d, hf = ckpt_st
    prompts = _prompts(8, 5)
    return prompts, _hf_greedy(hf, prompts, 32)


def test_greedy_matches_generate(ckpt_st, greedy_ref):
    d, _ = ckpt_st
    prompts, want = greedy_ref
    model = load_gpt2_checkpoint(d, CPU, torch.float32)
    info = model.info
    B, T = len(prompts), max(map(len, prompts))
    kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, B, T + 32, torch.float32, CPU)
    kv.k.zero_(), kv.v.zero_()
    toks = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    slots = torch.arange(B)
    logits = model.forward_step(toks, StepBatch(slots, torch.arange(T).expand(B, T), lens - 1, True), kv)
    got = [[] for _ in prompts]
    pos = lens.clone()
    for step in range(32):
        nxt = logits.argmax(-1)
        for i in range(B):
            got[i].append(int(nxt[i]))
        if step == 31:
            break
        batch = StepBatch(slots, pos[:, None], torch.zeros(B, dtype=torch.long), False,
                          kv_len=int(pos.max()) + 1, slot_start=0)
        logits = model.forward_step(nxt[:, None], batch, kv)
        pos += 1
    assert got == want


def test_engine_greedy_matches_transformers(ckpt_st, greedy_ref):
    from engine import SamplingParams, load_engine

    d, _ = ckpt_st
    prompts, want = greedy_ref
    eng = load_engine(d, device="cpu", dtype="float32")
    res = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[]))
    assert [r[0].tokens for r in res] == want


def test_bfloat16_load_is_close(ckpt_st):
    d, hf = ckpt_st
    model = load_gpt2_checkpoint(d, CPU, torch.bfloat16)
    assert model.wte.dtype == torch.bfloat16
    x = torch.tensor([_prompts(3, 1)[2]])
    got = model(x)
    assert got.dtype == torch.float32
    with torch.no_grad():
        want = hf(x).logits
    assert (got - want).abs().max().item() < 0.25 * want.abs().max().item()


def test_bare_gpt2model_keys_load(tmp_path, ckpt_st):
    """GPT2Model checkpoints have no "transformer." prefix and no lm_head."""
    d, hf = ckpt_st
    sd = {k.removeprefix("transformer."): v for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    model = load_gpt2_checkpoint(tmp_path, CPU, torch.float32)
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------- loader errors
def _variant(tmp_path: Path, src: Path, edit_sd=None, edit_cfg=None) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    if edit_cfg:
        edit_cfg(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if edit_sd:
        edit_sd(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_loader_unknown_and_missing_keys(tmp_path, ckpt_st):
    d, _ = ckpt_st
    (tmp_path / "a").mkdir()
    p = _variant(tmp_path / "a", d, edit_sd=lambda sd: sd.update({"transformer.h.0.attn.rotary": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*unknown keys \['h\.0\.attn\.rotary'\]"):
        load_gpt2_checkpoint(p, CPU, torch.float32)
    (tmp_path / "b").mkdir()
    p = _variant(tmp_path / "b", d, edit_sd=lambda sd: sd.pop("transformer.h.2.ln_2.bias"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*missing keys \['h\.2\.ln_2\.bias'\]"):
        load_gpt2_checkpoint(p, CPU, torch.float32)
    (tmp_path / "c").mkdir()
    p = _variant(tmp_path / "c", d, edit_cfg=lambda c: c.update(n_layer=2))
    with pytest.raises(CheckpointError, match=r"unknown keys \['h\.2\."):
        load_gpt2_checkpoint(p, CPU, torch.float32)


def test_loader_shape_and_config_errors(tmp_path, ckpt_st):
    d, _ = ckpt_st
    cases = [
        (dict(edit_sd=lambda sd: sd.update({"transformer.h.1.mlp.c_fc.bias": torch.zeros(7)})),
         r"h\.1\.mlp\.c_fc\.bias has shape \(7,\), expected \(256,\)"),
        (dict(edit_cfg=lambda c: c.update(vocab_size=VOCAB + 5)), r"wte\.weight has shape"),
        (dict(edit_cfg=lambda c: c.update(model_type="llama")), r"config\.json: model_type 'llama'"),
        (dict(edit_cfg=lambda c: c.update(activation_function="swiglu")), r"activation_function 'swiglu'"),
        (dict(edit_cfg=lambda c: c.update(n_head=5)), r"n_embd 64 is not a multiple of n_head 5"),
        (dict(edit_cfg=lambda c: c.pop("n_layer")), r"n_layer must be a positive integer"),
    ]
    for i, (kw, pattern) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        p = _variant(tmp_path / str(i), d, **kw)
        with pytest.raises(CheckpointError, match=pattern):
            load_gpt2_checkpoint(p, CPU, torch.float32)


def test_loader_missing_files(tmp_path, ckpt_st):
    d, _ = ckpt_st
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_gpt2_checkpoint(tmp_path, CPU, torch.float32)
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        load_gpt2_checkpoint(tmp_path, CPU, torch.float32)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read weights"):
        load_gpt2_checkpoint(tmp_path, CPU, torch.float32)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_gpt2_checkpoint(tmp_path, CPU, torch.float32)
