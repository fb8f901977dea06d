"""bench/standin.py: a checkpoint's stand-in for machines its file cannot reach.

What this proves: the stand-in of SmolLM2 (written from the GGUF, weights drawn afterwards)
loads as a Hugging Face checkpoint with the GGUF's shapes, renders chat prompts to the same
token ids with the same stop token, draws the same weights each time (a lent machine and this
one get the same model), and keeps each weight tensor's scale; and its F32 GGUF form (what
llama.cpp and batchgen both read in bench/bench_peers.py) the same, from the GGUF's own header.
"""
from __future__ import annotations

import hashlib
import json
import shutil

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


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The stand-in's folder, prepared once from the GGUF (config, tokenizer, stats, header)."""
    out = tmp_path_factory.mktemp("standin") / "standin"
    _standin().prepare(out, "smollm2")
    return out


@pytest.fixture(scope="module")
def real():
    return load_engine("smollm2", device="cpu", dtype="float32")


def _same_model_and_tokens(real, standin_path):
    """The stand-in's engine (float32), after checking that it has SmolLM2's config, renders a
    chat prompt to the same ids and stops on the same tokens."""
    fake = load_engine(standin_path, device="cpu", dtype="float32")
    assert fake.model.cfg == real.model.cfg
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April."}]
    assert fake.tokenizer.render_chat(messages, date="2026-01-01") == real.tokenizer.render_chat(messages,
                                                                                                 date="2026-01-01")
    assert fake.default_stop_ids == real.default_stop_ids
    return fake


def _first_stats(src, dst, name: str, n: int = 3):
    """dst: a copy of the prepared folder whose statistics file `name` keeps its first n
    tensors: the seeded draw checked twice on a few MB, not 540 MB."""
    shutil.copytree(src, dst)
    stats = json.loads((src / name).read_text())
    (dst / name).write_text(json.dumps(dict(list(stats.items())[:n])))
    return dst


def test_the_standin_has_the_models_shapes_tokens_and_weight_scales(prepared, real, tmp_path):
    standin = _standin()
    assert sum(f.stat().st_size for f in prepared.iterdir()) < 4 << 20  # small enough to send anywhere
    few = _first_stats(prepared, tmp_path / "few", "stats.json")
    standin.weights(few)
    first = hashlib.sha256((few / "model.safetensors").read_bytes()).hexdigest()
    standin.weights(few)
    assert hashlib.sha256((few / "model.safetensors").read_bytes()).hexdigest() == first  # seeded

    out = tmp_path / "standin"
    shutil.copytree(prepared, out)
    standin.weights(out)
    fake = _same_model_and_tokens(real, out)
    real_w, fake_w = dict(real.model.named_parameters()), dict(fake.model.named_parameters())
    for name in ("embed", "norm", "layers.3.qkv", "layers.3.down", "layers.29.post_norm"):
        r, f = real_w[name].float(), fake_w[name].float()
        assert f.shape == r.shape, name
        assert abs(float(f.mean()) - float(r.mean())) < 0.05 * float(r.std()) + 0.05 * abs(float(r.mean())), name
        assert abs(float(f.std()) - float(r.std())) < 0.25 * float(r.std()), name  # qkv mixes three tensors
    del fake, real_w, fake_w, r, f
    (out / "model.safetensors").unlink()  # 540 MB, and pytest keeps the temporary folders of its last runs


def test_the_gguf_standin_is_the_models_header_with_drawn_tensors(prepared, real, tmp_path):
    import gguf

    standin = _standin()
    few = _first_stats(prepared, tmp_path / "few", "gguf_stats.json")
    first = bytes(gguf.GGUFReader(standin.write_gguf(few)).tensors[1].data[:64].tobytes())
    assert bytes(gguf.GGUFReader(standin.write_gguf(few)).tensors[1].data[:64].tobytes()) == first  # seeded

    out = tmp_path / "standin"
    shutil.copytree(prepared, out)
    path = standin.write_gguf(out)
    real_reader, fake_reader = gguf.GGUFReader(smollm2_path()), gguf.GGUFReader(path)
    assert [t.name for t in fake_reader.tensors] == [t.name for t in real_reader.tensors]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in fake_reader.tensors)
    assert fake_reader.fields["tokenizer.chat_template"].contents() == \
        real_reader.fields["tokenizer.chat_template"].contents()
    del fake_reader

    fake = _same_model_and_tokens(real, path)
    r, f = dict(real.model.named_parameters())["layers.3.down"], dict(fake.model.named_parameters())["layers.3.down"]
    assert abs(float(f.std()) - float(r.std())) < 0.1 * float(r.std())
    del fake
    path.unlink()  # 540 MB, and pytest keeps the temporary folders of its last runs
