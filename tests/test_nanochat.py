"""nanochat architecture: golden parity with nanochat's own code, KV-cache parity, loader errors, the tiny-random model.

Fixtures (tests/fixtures/nanochat/*, see the README there) were produced by nanochat's real
code at 16788ee, aa530cd, e85db6b, 6ed7d1d and 92d63d4, in float32 on CPU.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCache, StepBatch
from engine.loading.errors import CheckpointError
from engine.loading.nanochat import build_tiny_random_model, load_nanochat_checkpoint

# invariance: run again limited to AVX2 by tests/test_isa.py
pytestmark = [pytest.mark.invariance, pytest.mark.usefixtures("one_torch_thread")]

FIXTURES = Path(__file__).parent / "fixtures" / "nanochat"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
CPU = torch.device("cpu")
F32 = torch.float32


def _load(name: str, **kw):
    return load_nanochat_checkpoint(FIXTURES / name, CPU, F32, **kw)


def test_fixtures_present():
    """The five reference generations are there (a missing one would silently shrink coverage)."""
    assert NAMES == ["nanochat_2025_16788ee", "nanochat_2026jan_aa530cd", "nanochat_2026jan_e85db6b",
                     "nanochat_2026jul_92d63d4", "nanochat_2026mar_6ed7d1d"]


@pytest.mark.parametrize("name", NAMES)
def test_golden_parity(name):
    """forward(tokens) equals nanochat's GPT.forward(idx) logits at that commit (fp32, <= 1e-4)."""
    model = _load(name)
    exp = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    assert model.info.vocab_size == 300 and model.info.arch == "nanochat"
    with torch.no_grad():
        for key, idx in exp["inputs"].items():
            got = model(idx)
            want = exp["logits"][key]
            assert got.dtype == torch.float32 and got.shape == want.shape
            diff = (got - want).abs().max().item()
            print(f"{name} {key} {tuple(idx.shape)}: max abs diff {diff:.3g}")
            assert diff <= 1e-4, f"{name}/{key}: max abs diff {diff}"


def test_detected_features():
    """Each generation is recognised from its keys/shapes, not a two-way switch."""
    c = {n: _load(n).config for n in NAMES}
    old, lam, ve32, new, mar = (c[n] for n in NAMES)
    assert old.padded_vocab_size == 300 and lam.padded_vocab_size == 320
    assert not old.resid_lambdas and lam.resid_lambdas and not lam.value_embeds
    assert (old.rotary_base, old.rotary_bf16_tables, old.qk_scale) == (10000, True, None)
    assert (ve32.ve_gate_channels, ve32.ve_gate_scale, ve32.rotary_base) == (32, 2, 10000)
    assert ve32.window_sizes() == [128, 128, None, None]  # fbc1484: short = sequence_len // 2
    assert (new.ve_gate_channels, new.ve_gate_scale, new.rotary_base, new.rotary_bf16_tables) == (12, 3, 100000, False)
    assert new.smear and new.backout and new.qk_scale == 1.2
    assert new.window_sizes() == [128, 128, 128, None]  # a825e63: ceil(512/4/128)*128, last layer long
    # 6ed7d1d..a825e63: 12-wide ve_gate without smear: q, k *= 1.15 (the 1.2 came with the smear),
    # short window ceil(256/3/128)*128 (it was read as no scaling: logits off by up to 4)
    assert (mar.ve_gate_channels, mar.ve_gate_scale, mar.rotary_base, mar.rotary_bf16_tables) == (12, 3, 100000, False)
    assert not mar.smear and not mar.backout and mar.qk_scale == 1.15
    assert mar.window_sizes() == [128, 128, 128, None]
    assert _load("nanochat_2026jul_92d63d4").info.state_dims == {"smear": 32} and _load(NAMES[0]).info.state_dims == {}


def _decode_batch(slots, positions, contiguous):
    pos = torch.tensor(positions, dtype=torch.long)[:, None]
    return StepBatch(slots=torch.tensor(slots, dtype=torch.long), positions=pos,
                     last_index=torch.zeros(len(slots), dtype=torch.long), prefill=False,
                     kv_len=int(pos.max()) + 1, slot_start=slots[0] if contiguous else None)


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_matches_forward(name):
    """Prefill (right-padded batch) + one-token decode through KVCache gives forward()'s logits.

    Rows sit at different positions, decode alternates the contiguous-slot view and the gather
    path (rows in permuted slot order), prompts and continuations are long enough that the
    128-token sliding windows bite (fixtures with windows), the smear state is carried per slot,
    and a slot fanned out with copy_slots continues correctly.
    """
    model = _load(name)
    info = model.info
    g = torch.Generator().manual_seed(7)
    prompt_lens, gen = [150, 100, 20], 45
    seqs = [torch.randint(0, info.vocab_size, (n + gen,), generator=g) for n in prompt_lens]
    fork = torch.randint(0, info.vocab_size, (gen,), generator=g)  # continuation of prompt 2 in a fanned-out slot
    seqs.append(torch.cat([seqs[2][:prompt_lens[2]], fork]))
    with torch.no_grad():
        refs = [model(s[None])[0] for s in seqs]
        kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, num_slots=6, max_seq_len=info.context_len,
                     dtype=F32, device=CPU, state_dims=info.state_dims)
        T = max(prompt_lens)
        toks = torch.zeros(3, T, dtype=torch.long)
        for r, n in enumerate(prompt_lens):
            toks[r, :n] = seqs[r][:n]
        slots = [1, 2, 3]
        pre = StepBatch(slots=torch.tensor(slots), positions=torch.arange(T).repeat(3, 1),
                        last_index=torch.tensor(prompt_lens) - 1, prefill=True)
        out = model.forward_step(toks, pre, kv)
        for r, n in enumerate(prompt_lens):
            torch.testing.assert_close(out[r], refs[r][n - 1], atol=1e-4, rtol=0)
        kv.copy_slots(torch.tensor([3]), torch.tensor([4]), prompt_lens[2])
        all_slots, lens = [1, 2, 3, 4], prompt_lens + [prompt_lens[2]]
        worst = 0.0
        for step in range(gen - 1):
            rows = [0, 1, 2, 3] if step % 2 == 0 else [3, 0, 2, 1]  # contiguous view / gather path
            positions = [lens[r] + step for r in rows]
            batch = _decode_batch([all_slots[r] for r in rows], positions, contiguous=step % 2 == 0)
            tok = torch.stack([seqs[r][p] for r, p in zip(rows, positions)])[:, None]
            out = model.forward_step(tok, batch, kv)
            for i, (r, p) in enumerate(zip(rows, positions)):
                worst = max(worst, (out[i] - refs[r][p]).abs().max().item())
        print(f"{name}: kv-cached vs forward max abs diff {worst:.3g}")
        assert worst <= 1e-4


def test_kv_cache_windows_bite():
    """The windowed fixtures really attend differently from full context at these lengths."""
    model = _load("nanochat_2026jul_92d63d4")
    assert model.windows[0] == 128
    idx = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(idx)
        model.windows = [None] * len(model.windows)
        b = model(idx)
    assert (a[0, :129] - b[0, :129]).abs().max() == 0  # within the window: identical
    assert (a[0, 150:] - b[0, 150:]).abs().max() > 1e-3  # beyond: the window changes the output


def _copy(name: str, dst: Path) -> Path:
    shutil.copytree(FIXTURES / name, dst)
    (dst / "expected.pt").unlink()
    return dst


def test_unknown_and_missing_keys_rejected(tmp_path):
    """A state dict with keys the loader does not understand (or lacks) fails, naming keys and file."""
    d = _copy("nanochat_2026jul_92d63d4", tmp_path / "ck")
    f = d / "model_000650.pt"
    sd = torch.load(f, weights_only=True)
    sd["_orig_mod.engram.weight"] = torch.zeros(3)
    del sd["_orig_mod.lm_head.weight"]
    torch.save(sd, f)
    with pytest.raises(CheckpointError) as e:
        load_nanochat_checkpoint(d, CPU, F32)
    msg = str(e.value)
    assert "engram.weight" in msg and "lm_head.weight" in msg and "model_000650.pt" in msg
    # a short-lived experimental layout (9a88194: a value embedding per layer + v0_lambdas) is refused too
    sd = torch.load(FIXTURES / "nanochat_2026jan_e85db6b" / "model_021400.pt", weights_only=True)
    sd["v0_lambdas"] = torch.zeros(4)
    sd["value_embeds.0.weight"] = sd["value_embeds.1.weight"].clone()
    d2 = _copy("nanochat_2026jan_e85db6b", tmp_path / "ck2")
    torch.save(sd, d2 / "model_021400.pt")
    with pytest.raises(CheckpointError, match=r"v0_lambdas.*value_embeds\.0\.weight|value_embeds\.0\.weight.*v0_lambdas"):
        load_nanochat_checkpoint(d2, CPU, F32)


def test_shape_mismatch_rejected(tmp_path):
    """Tensors whose shapes disagree with meta's model_config fail with the key named."""
    d = _copy("nanochat_2026jan_aa530cd", tmp_path / "ck")
    meta = d / "meta_001200.json"
    m = json.loads(meta.read_text())
    m["model_config"]["n_kv_head"] = 2
    meta.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="c_k.weight"):
        load_nanochat_checkpoint(d, CPU, F32)


def test_missing_meta(tmp_path):
    """model_<step>.pt without its meta_<step>.json is a clear CheckpointError."""
    d = _copy("nanochat_2025_16788ee", tmp_path / "ck")
    (d / "meta_000650.json").unlink()
    with pytest.raises(CheckpointError, match="meta_000650.json"):
        load_nanochat_checkpoint(d, CPU, F32)


def test_orig_mod_prefix_and_step_choice(tmp_path):
    """`_orig_mod.` keys load like plain ones; the highest step wins (any digit count) unless one is given."""
    src = FIXTURES / "nanochat_2026jul_92d63d4"
    raw = torch.load(src / "model_000650.pt", weights_only=True)
    assert all(k.startswith("_orig_mod.") for k in raw)
    d = tmp_path / "ck"
    d.mkdir()
    meta = (src / "meta_000650.json").read_text()
    plain = {k.removeprefix("_orig_mod."): v for k, v in raw.items()}
    torch.save(plain, d / "model_7.pt")
    (d / "meta_7.json").write_text(meta)
    other = dict(plain, **{"lm_head.weight": plain["lm_head.weight"] * 0.5})
    torch.save(other, d / "model_001200.pt")
    (d / "meta_001200.json").write_text(meta)
    idx = torch.load(src / "expected.pt", weights_only=True)["inputs"]["batch"]
    with torch.no_grad():
        ref = load_nanochat_checkpoint(src, CPU, F32)(idx)
        m7 = load_nanochat_checkpoint(d, CPU, F32, step=7)
        assert torch.equal(m7(idx), ref)
        latest = load_nanochat_checkpoint(d, CPU, F32)
        assert "model_001200.pt" in latest.info.description
        assert not torch.equal(latest(idx), ref)
    with pytest.raises(CheckpointError, match="step 5"):
        load_nanochat_checkpoint(d, CPU, F32, step=5)


def test_bfloat16_close_to_float32():
    """dtype=bfloat16 keeps matrices/embeddings in bf16, scalars in fp32, and stays close to fp32."""
    name = "nanochat_2026jul_92d63d4"
    exp = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    m = load_nanochat_checkpoint(FIXTURES / name, CPU, torch.bfloat16)
    assert m.wte.dtype == torch.bfloat16 and m.blocks[0].c_q.dtype == torch.bfloat16
    assert m.resid_lambdas.dtype == torch.float32 and m.smear_lambda.dtype == torch.float32
    with torch.no_grad():
        got = m(exp["inputs"]["batch"])
    assert got.dtype == torch.float32
    assert (got - exp["logits"]["batch"]).abs().mean() < 0.1


def test_tiny_random_model_deterministic_and_labelled():
    """The tiny-random model is the same on every build, has every 2026 feature, and says it is untrained."""
    a = build_tiny_random_model(100_286, CPU, F32)
    b = build_tiny_random_model(100_286, CPU, F32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "untrained" in a.info.description and "random weights" in a.info.description
    c = a.config
    assert a.info.vocab_size == 100_286 and c.padded_vocab_size == 100_288 and a.info.context_len == 1024
    assert c.smear and c.backout and c.value_embeds and c.resid_lambdas and c.qk_scale == 1.2
    assert c.window_sizes() == [256, 256, 256, None]
    # pinned values (recorded once): the seeded generator gives the same weights on any machine
    torch.testing.assert_close(a.wte[0, :3], torch.tensor([-2.1081741, -1.0125947, -0.0139549]), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.blocks[0].c_q[0, :2], torch.tensor([-0.0911442, 0.0954077]), atol=1e-5, rtol=0)
    assert abs(a.lm_head.double().sum().item() - (-731.20499)) < 1e-2
    with torch.no_grad():
        logits = a(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    torch.testing.assert_close(logits[0, -1, :3], torch.tensor([2.1470189, 3.4489064, 1.2267493]), atol=1e-4, rtol=0)
    p = logits.softmax(-1)
    assert p.shape == (1, 6, 100_286) and p.max() > 100 / 100_286  # far from uniform


def test_teacher_forced_logits_score_the_fixture_and_refuse_ids_outside_the_vocabulary():
    """engine.scoring.teacher_forced_logits on nanochat (smear state, windows, padded vocab)
    gives nanochat's own logits at every position; an id in the padded embedding's extra rows
    (300..319: untrained, it was scored silently), a negative one (an IndexError inside the
    embedding) or no tokens at all is a ValueError naming the token."""
    from engine.scoring import teacher_forced_logits

    name = "nanochat_2026jul_92d63d4"
    model = _load(name)
    exp = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    idx = exp["inputs"]["batch"][1]
    got = teacher_forced_logits(model, idx.tolist())
    torch.testing.assert_close(got, exp["logits"]["batch"][1], atol=1e-4, rtol=0)
    assert model.config.padded_vocab_size == 320
    for bad, needle in (([5, 300], "token 1 is 300"), ([-1], "token 0 is -1"), ([True], "token 0 is True"),
                        ([2.0], "token 0 is 2.0"), ([], "no tokens")):
        with pytest.raises(ValueError, match=needle):
            teacher_forced_logits(model, bad)
