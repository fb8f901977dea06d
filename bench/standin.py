"""A stand-in for a checkpoint on a machine its file cannot reach: the same architecture,
tokenizer and chat template, random weights.

A lent machine may take only a few tens of MiB per call (SmolLM2's GGUF is 98 MB). The speed
of a decode step depends on the model's shapes, not its weights, so a Hugging Face directory
with the checkpoint's config.json, tokenizer.json and tokenizer_config.json (written from the
checkpoint, about 1.6 MB for SmolLM2) and weights drawn on the machine itself runs the same
arithmetic. Each tensor is drawn from a normal distribution with that tensor's mean and
standard deviation in the real checkpoint (stats.json), seeded, so activations keep their
scale; its text is noise, and it generates to `max_tokens` (the real model stops earlier:
compare a stand-in only with itself).

    python bench/standin.py prepare OUT [--model smollm2]   # here: config, tokenizer, stats
    python bench/standin.py weights OUT                     # there: model.safetensors (float32)
    python bench/standin.py gguf OUT                        # there: model.gguf (F32)

Then `--model OUT` in bench/bench_dtypes.py and bench/invariance_smollm2.py. Llama-family
checkpoints only (what engine/loading/hf_weights.py reads back); raises ValueError for others.
From a GGUF checkpoint `prepare` also keeps its header (every key and value: the tokenizer, the
chat template, the hyperparameters; header.gguf, no tensors) and each tensor's statistics under
its GGUF name (gguf_stats.json), and `gguf` writes an F32 GGUF stand-in from them that
llama.cpp and batchgen both read (bench/bench_peers.py --model): other draws than
model.safetensors', so compare it with itself only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prepare(out: Path, model: str) -> None:
    """config.json, the tokenizer files and stats.json (each weight's shape, mean, std) in out."""
    from engine.export.artifacts import write_tokenizer
    from engine.loading.builtin import resolve_builtin
    from engine.loading.checkpoint import load_model

    m = load_model(model, device="cpu", dtype="float32")
    c = getattr(m, "cfg", None)
    if c is None or getattr(c, "architecture", None) != "LlamaForCausalLM" or c.qkv_bias or c.qk_norm:
        raise ValueError(f"{model}: the stand-in writes plain Llama checkpoints only")
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope.rope_theta, "max_position_embeddings": c.max_position_embeddings,
           "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "torch_dtype": "float32",
           "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    source = Path(resolve_builtin(model))
    fmt = "gguf" if source.suffix == ".gguf" else "llama"
    if not write_tokenizer(source, fmt, out):
        raise ValueError(f"{model}: no tokenizer could be written for it")
    params = dict(m.named_parameters())
    heads = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    stats = {}

    def put(name: str, t: torch.Tensor) -> None:
        stats[name] = [list(t.shape), float(t.float().mean()), float(t.float().std())]

    put("model.embed_tokens.weight", params["embed"])
    put("model.norm.weight", params["norm"])
    if not c.tie_word_embeddings:
        put("lm_head.weight", params["lm_head"])
    for i in range(c.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        put(p + "input_layernorm.weight", params[q + "input_norm"])
        put(p + "post_attention_layernorm.weight", params[q + "post_norm"])
        for proj, t in zip(("q_proj", "k_proj", "v_proj"), params[q + "qkv"].split(heads)):
            put(p + f"self_attn.{proj}.weight", t)
        put(p + "self_attn.o_proj.weight", params[q + "o_proj"])
        gate, up = params[q + "gate_up"].split([c.intermediate_size] * 2)
        put(p + "mlp.gate_proj.weight", gate)
        put(p + "mlp.up_proj.weight", up)
        put(p + "mlp.down_proj.weight", params[q + "down"])
    (out / "stats.json").write_text(json.dumps(stats))
    if fmt == "gguf":
        _prepare_gguf(source, out)


def write_f32_gguf(path: Path, reader, tensors) -> None:
    """An F32 GGUF file at path: every key and value of `reader` (a gguf.GGUFReader) but the
    header's counts and the architecture (the writer writes those) and general.file_type (now
    ALL_F32), then the (name, numpy array) `tensors`."""
    import gguf

    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, data in tensors:
        writer.add_tensor(name, data)  # numpy's shape is GGUF's reversed; the writer reverses it back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


def _prepare_gguf(source: Path, out: Path) -> None:
    """header.gguf (source's keys and values, no tensors) and gguf_stats.json (each tensor's
    numpy shape, mean and std, dequantized) in out."""
    import gguf

    reader = gguf.GGUFReader(source)
    write_f32_gguf(out / "header.gguf", reader, [])
    stats = {}
    for t in reader.tensors:
        data = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))  # a writable copy
        stats[t.name] = [list(data.shape), float(data.mean()), float(data.std())]
    (out / "gguf_stats.json").write_text(json.dumps(stats))


def weights(out: Path, seed: int = 0) -> None:
    """model.safetensors in out, each tensor normal(mean, std) of stats.json, seeded."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=g) * std + mean).contiguous()
               for name, (shape, mean, std) in json.loads((out / "stats.json").read_text()).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_gguf(out: Path, seed: int = 0) -> Path:
    """out/model.gguf (F32): header.gguf's keys and values, each tensor normal(mean, std) of
    gguf_stats.json, seeded. Returns its path. Raises FileNotFoundError where `prepare` had
    no GGUF to read."""
    import gguf

    if not (out / "header.gguf").exists():
        raise FileNotFoundError(f"{out / 'header.gguf'}: prepare the stand-in from a GGUF checkpoint")
    g = torch.Generator().manual_seed(seed)
    stats = json.loads((out / "gguf_stats.json").read_text())
    tensors = ((name, (torch.randn(shape, generator=g) * std + mean).numpy())
               for name, (shape, mean, std) in stats.items())
    write_f32_gguf(out / "model.gguf", gguf.GGUFReader(out / "header.gguf"), tensors)
    return out / "model.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("prepare", "weights", "gguf"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="smollm2", help="prepare: the checkpoint to copy the shapes of")
    args = ap.parse_args()
    if args.step == "prepare":
        prepare(args.out, args.model)
    elif args.step == "weights":
        weights(args.out)
    else:
        write_gguf(args.out)


if __name__ == "__main__":
    main()
