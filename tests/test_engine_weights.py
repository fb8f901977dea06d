"""Engine.load_weights (engine/loading/weight_swap.py) without Ray: another checkpoint's weights copied
into the loaded model in place.

On a nanochat checkpoint (the 2026 architecture), a Llama and a GPT-2 checkpoint with tied heads:
after the swap the engine generates exactly (tokens and logprobs, bit for bit) what a fresh
engine on the new checkpoint generates, although it ran before the swap (so oneDNN's packed
copies of the old weights existed and must not be used), and neither its KV cache nor its
parameters were reallocated. A checkpoint of another architecture (same shapes, another
config; or other tensors) is refused naming what differs, and the engine keeps generating
what it did. A swap while requests are unfinished is refused. A nanochat directory's highest
step is loaded unless a step is given.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import weights_cases
from engine import SamplingParams, load_engine
from engine.loading.weight_swap import WeightsMismatch

PROMPTS = [[256, 5, 6, 7, 8, 9], [256] + [3] * 20, [256, 100, 101], list(range(40, 80))]
IDS = ["a", "b", "c", "d"]
PARAMS = SamplingParams(num_samples=2, max_tokens=8, top_k=20, seed=3, stop_token_ids=[])


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    c = weights_cases.build(root)
    c["llama"], c["llama_trained"] = _llama(root / "llama", seed=0), _llama(root / "llama_trained", seed=1)
    c["gpt2"], c["gpt2_trained"] = _gpt2(root / "gpt2", seed=0), _gpt2(root / "gpt2_trained", seed=1)
    return c


def _save(d, cfg: dict, shapes: dict, seed: int):
    """config.json + model.safetensors with weights N(0, 0.15), norm gains 1 + N(0, 0.3)."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    sd = {k: (1 + 0.3 * torch.randn(s, generator=g)) if "norm" in k or ("ln_" in k and k.endswith("weight"))
          else 0.15 * torch.randn(s, generator=g) for k, s in shapes.items()}
    save_file(sd, str(d / "model.safetensors"))
    return d


def _llama(d, seed: int):
    """A Llama checkpoint with a tied head, named as transformers names it (no tokenizer files)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    shapes = {"model.embed_tokens.weight": (300, 32), "model.norm.weight": (32,)}
    for n in range(2):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
                       p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
                       p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
                       p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
                       p + "mlp.down_proj.weight": (32, 64)})
    return _save(d, cfg, shapes, seed)


def _gpt2(d, seed: int):
    """A GPT-2 checkpoint (Conv1D layouts, tied head), named as transformers names it."""
    cfg = {"model_type": "gpt2", "vocab_size": 300, "n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 4}
    shapes = {"wte.weight": (300, 32), "wpe.weight": (128, 32), "ln_f.weight": (32,), "ln_f.bias": (32,)}
    for n in range(2):
        p = f"h.{n}."
        shapes.update({p + "ln_1.weight": (32,), p + "ln_1.bias": (32,), p + "attn.c_attn.weight": (32, 96),
                       p + "attn.c_attn.bias": (96,), p + "attn.c_proj.weight": (32, 32), p + "attn.c_proj.bias": (32,),
                       p + "ln_2.weight": (32,), p + "ln_2.bias": (32,), p + "mlp.c_fc.weight": (32, 128),
                       p + "mlp.c_fc.bias": (128,), p + "mlp.c_proj.weight": (128, 32), p + "mlp.c_proj.bias": (32,)})
    return _save(d, cfg, shapes, seed)


def _engine(path, tok):
    return load_engine(path, device="cpu", dtype="float32", tokenizer=tok, max_seq_len=64, num_threads=1)


def _run(eng):
    """Every sample's tokens and logprobs (compared exactly)."""
    return [[(s.tokens, s.logprobs) for s in row] for row in eng.generate(PROMPTS, PARAMS, prompt_ids=IDS)]


def _pointers(eng):
    return ([eng.kv.k.data_ptr(), eng.kv.v.data_ptr()] + [t.data_ptr() for t in eng.kv.state.values()],
            [p.data_ptr() for p in eng.model.parameters()])


@pytest.mark.parametrize("old,new", [("base", "trained"), ("llama", "llama_trained"), ("gpt2", "gpt2_trained")])
def test_swapped_weights_generate_what_a_fresh_engine_does(cases, old, new):
    eng = _engine(cases[old], cases["tokenizer"])
    before = _run(eng)
    pointers = _pointers(eng)
    info = eng.load_weights(cases[new])
    assert info["path"] == str(cases[new]) and str(cases[new]) in eng.model.info.description
    after = _run(eng)
    assert after == _run(_engine(cases[new], cases["tokenizer"]))
    assert after != before
    assert _pointers(eng) == pointers  # the KV cache and every parameter kept their storage
    assert eng.load_weights(cases[old])["path"] == str(cases[old]) and _run(eng) == before  # and back


def test_other_architecture_is_refused_and_the_weights_kept(cases):
    eng = _engine(cases["base"], cases["tokenizer"])
    before = _run(eng)
    with pytest.raises(WeightsMismatch, match=r"other_config.*window_pattern 'L' \(loaded: 'SSSL'\)"):
        eng.load_weights(cases["other_config"])
    with pytest.raises(WeightsMismatch) as e:
        eng.load_weights(cases["other_shapes"])
    msg = str(e.value)
    assert "other_shapes" in msg and "n_layer 3 (loaded: 4)" in msg and "value_embeds" in msg
    with pytest.raises(WeightsMismatch, match="LlamaModel .*NanochatGPT"):
        eng.load_weights(cases["llama"])
    with pytest.raises(FileNotFoundError):
        eng.load_weights(cases["base"] / "missing")
    assert _run(eng) == before


def test_swap_is_refused_while_requests_are_unfinished(cases):
    eng = _engine(cases["base"], cases["tokenizer"])
    eng.add_request(PROMPTS[0], PARAMS, "a")
    with pytest.raises(RuntimeError, match="unfinished requests"):
        eng.load_weights(cases["trained"])
    while eng.has_unfinished_requests():
        eng.step()
    eng.load_weights(cases["trained"])


def test_nanochat_highest_step_unless_one_is_given(cases, tmp_path):
    """A trainer writing model_<step>.pt into one directory: the highest step loads by default."""
    d = tmp_path / "run"
    d.mkdir()
    meta = (cases["base"] / "meta_000650.json").read_text()
    for step, src in ((7, cases["base"]), (1200, cases["trained"])):
        shutil.copy(src / "model_000650.pt", d / f"model_{step:06d}.pt")
        (d / f"meta_{step:06d}.json").write_text(meta)
    eng = _engine(cases["base"], cases["tokenizer"])
    before = _run(eng)
    assert eng.load_weights(d)["step"] == 1200
    assert _run(eng) == _run(_engine(cases["trained"], cases["tokenizer"]))
    assert eng.load_weights(d, step=7)["step"] == 7 and _run(eng) == before


def test_nanochat_checkpoint_with_one_of_its_lambdas_swaps_in_as_it_loads(cases, tmp_path):
    """nanochat's loader takes a checkpoint holding resid_lambdas or x0_lambdas alone, the other
    patched to ones / zeros: load_weights and update_weights take it too, the checkpoint the
    engine was loaded from included, and give what a fresh engine on it gives (the missing
    one patched, not kept from the old weights, in either order). (Before: "tensors missing:
    x0_lambdas".) Holding neither is another architecture: refused, the weights kept."""
    tok = cases["tokenizer"]
    sd = torch.load(cases["trained"] / "model_000650.pt", weights_only=True)
    dirs = {}
    for drop in ("x0_lambdas", "resid_lambdas", "lambdas"):
        d = dirs[drop] = tmp_path / drop
        d.mkdir()
        shutil.copy(cases["trained"] / "meta_000650.json", d / "meta_000650.json")
        torch.save({k: v for k, v in sd.items() if not k.endswith(drop)}, d / "model_000650.pt")
    one = _engine(dirs["x0_lambdas"], tok)
    fresh = _run(one)
    one.load_weights(dirs["x0_lambdas"])
    assert _run(one) == fresh
    eng = _engine(cases["base"], tok)
    before = _run(eng)
    assert eng.model.x0_lambdas.abs().sum() > 0 and (eng.model.resid_lambdas != 1).any()  # base's own values
    m = eng.model
    for drop, patched, value in (("x0_lambdas", m.x0_lambdas, 0.0), ("resid_lambdas", m.resid_lambdas, 1.0)):
        eng.load_weights(dirs[drop])
        assert torch.equal(patched, torch.full_like(patched, value)), drop
        want = _run(_engine(dirs[drop], tok))
        assert _run(eng) == want, drop
        eng.load_weights(cases["base"])
        given = [(k, v) for k, v in sd.items() if not k.endswith(drop)]
        for pairs in (given, given[::-1]):  # from memory, in either order
            eng.update_weights(pairs)
            assert torch.equal(patched, torch.full_like(patched, value)) and _run(eng) == want, drop
            eng.load_weights(cases["base"])
    assert _run(eng) == before
    with pytest.raises(WeightsMismatch, match="resid_lambdas"):
        eng.load_weights(dirs["lambdas"])
    with pytest.raises(WeightsMismatch, match="tensors missing: resid_lambdas, x0_lambdas"):
        eng.update_weights([(k, v) for k, v in sd.items() if not k.endswith("lambdas")])
    assert _run(eng) == before
