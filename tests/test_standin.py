"""bench/standin.py: a checkpoint's stand-in for machines its file cannot reach.

What this proves: the stand-in of SmolLM2 (written from the GGUF, weights drawn afterwards)
loads as a Hugging Face checkpoint with the GGUF's shapes, renders chat prompts to the same
token ids with the same stop token, draws the same weights each time (a lent machine and this
one get the same model), and keeps each weight tensor's scale; and its F32 GGUF form (what
llama.cpp and batchgen both read in bench/bench_peers.py) the same, from the GGUF's own header.
"""
from __future__ import annotations

import hashlib

import pytest

from conftest import bench_module
from engine import load_engine
from engine.loading.builtin import SMOLLM2_INSTALL, smollm2_path

try:
    smollm2_path()
except FileNotFoundError:  # pragma: no cover - `make install` installs it
    pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_INSTALL})", allow_module_level=True)


def _standin():
    return bench_module("standin")


def _same_model_and_tokens(standin_path):
    """SmolLM2's engine and the stand-in's (float32), after checking that the stand-in has its
    config, renders a chat prompt to the same ids and stops on the same tokens."""
    real = load_engine("smollm2", device="cpu", dtype="float32")
    fake = load_engine(standin_path, device="cpu", dtype="float32")
    assert fake.model.cfg == real.model.cfg
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April."}]
    assert fake.tokenizer.render_chat(messages, date="2026-01-01") == real.tokenizer.render_chat(messages,
                                                                                                 date="2026-01-01")
    assert fake.default_stop_ids == real.default_stop_ids
    return real, fake


def test_the_standin_has_the_models_shapes_tokens_and_weight_scales(tmp_path):
    standin = _standin()
    out = tmp_path / "standin"
    standin.prepare(out, "smollm2")
    assert sum(f.stat().st_size for f in out.iterdir()) < 4 << 20  # small enough to send anywhere
    standin.weights(out)
    first = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    standin.weights(out)
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == first

    real, fake = _same_model_and_tokens(out)
    real_w, fake_w = dict(real.model.named_parameters()), dict(fake.model.named_parameters())
    for name in ("embed", "norm", "layers.3.qkv", "layers.3.down", "layers.29.post_norm"):
        r, f = real_w[name].float(), fake_w[name].float()
        assert f.shape == r.shape, name
        assert abs(float(f.mean()) - float(r.mean())) < 0.05 * float(r.std()) + 0.05 * abs(float(r.mean())), name
        assert abs(float(f.std()) - float(r.std())) < 0.25 * float(r.std()), name  # qkv mixes three tensors
    del real, fake, real_w, fake_w, r, f
    (out / "model.safetensors").unlink()  # 540 MB, and pytest keeps the temporary folders of its last runs


def test_the_gguf_standin_is_the_models_header_with_drawn_tensors(tmp_path):
    import gguf

    standin = _standin()
    out = tmp_path / "standin"
    standin.prepare(out, "smollm2")
    path = standin.write_gguf(out)
    real_reader, fake_reader = gguf.GGUFReader(smollm2_path()), gguf.GGUFReader(path)
    assert [t.name for t in fake_reader.tensors] == [t.name for t in real_reader.tensors]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in fake_reader.tensors)
    assert fake_reader.fields["tokenizer.chat_template"].contents() == \
        real_reader.fields["tokenizer.chat_template"].contents()
    first = bytes(fake_reader.tensors[5].data[:64].tobytes())
    del fake_reader
    assert bytes(gguf.GGUFReader(standin.write_gguf(out)).tensors[5].data[:64].tobytes()) == first  # seeded

    real, fake = _same_model_and_tokens(path)
    r, f = dict(real.model.named_parameters())["layers.3.down"], dict(fake.model.named_parameters())["layers.3.down"]
    assert abs(float(f.std()) - float(r.std())) < 0.1 * float(r.std())
    del real, fake
    path.unlink()  # 540 MB, and pytest keeps the temporary folders of its last runs
