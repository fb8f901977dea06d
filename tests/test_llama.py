"""engine.models.llama against transformers' LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM and MistralForCausalLM (random weights written by save_pretrained, float32).

Each case stresses what its family adds: Llama with llama3 rope scaling, an untied head and
grouped-query attention; Qwen2 with q/k/v biases and a tied head (and with
use_sliding_window + max_window_layers); Qwen3 with per-head q/k norms and head_dim !=
hidden/heads; Mistral with a sliding window shorter than prompt + generated tokens; linear
and yarn rope scaling (the latter in transformers 4.x's config spelling) with biases.
Checks: cache-free logits, the engine's greedy tokens against `generate(do_sample=False)`
and its logprobs against transformers' log-softmax, sharded and .bin weights, bfloat16,
stop tokens from the config, and the loader's errors.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import tiktoken
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from engine import SamplingParams, load_engine  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kernels.native import bfloat16_is_faster, native_kernels  # noqa: E402
from engine.loading.checkpoint import detect_format  # noqa: E402
from engine.loading.errors import CheckpointError  # noqa: E402
from engine.loading.hf_config import parse_llama_config, parse_rope_scaling  # noqa: E402
from engine.loading.llama import build_llama, load_llama_checkpoint  # noqa: E402
from engine.models import base  # noqa: E402

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py

CPU = torch.device("cpu")
V, CTX = 384, 256
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=CTX)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 64}

# name -> (config class, model class, config overrides)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_parameters=LLAMA3)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=True,
                                                             sliding_window=12, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "llama-linear-bias": ("LlamaConfig", "LlamaForCausalLM",
                          dict(attention_bias=True, mlp_bias=True,
                               rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen3-yarn-4x": ("Qwen3Config", "Qwen3ForCausalLM", dict(attention_bias=True, head_dim=32,
                                                                 rope_parameters=YARN)),
}
GREEDY = ["llama", "qwen2", "qwen2-window", "qwen3", "mistral"]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.15), norm gains 1 + N(0, 0.3), biases N(0, 0.1): large enough that greedy
    sequences vary (20-30 distinct tokens in 32) and that the top two logits are rarely
    within float error of each other."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def _to_4x_spelling(d: Path) -> None:
    """Rewrite config.json as transformers 4.x wrote it: rope_theta + rope_scaling {"type": ...}."""
    cfg = json.loads((d / "config.json").read_text())
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (directory, transformers model): built once per module, on first use."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str):
        if name not in cache:
            cfg_cls, model_cls, extra = CASES[name]
            cfg = getattr(transformers, cfg_cls)(**SHAPE, **extra)
            torch.manual_seed(0)
            hf = getattr(transformers, model_cls)(cfg).eval()
            _randomize(hf, seed=len(cache) + 1)
            hf.generation_config.eos_token_id = None  # always generate max_new_tokens
            d = tmp_path_factory.mktemp(name)
            hf.save_pretrained(d)
            if name == "qwen2-window":  # the 4.x form: windows from use_sliding_window + max_window_layers
                cfg_json = json.loads((d / "config.json").read_text())
                assert cfg_json.pop("layer_types") == ["full_attention", "sliding_attention"]
                (d / "config.json").write_text(json.dumps(cfg_json))
            if name.endswith("-4x"):
                _to_4x_spelling(d)
            cache[name] = d, hf
        return cache[name]

    return get


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 5, 17, 9, 30, 2, 12, 23, 40, 7][:n]
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in lens]


class _Tokenizer:
    """What Engine needs from a tokenizer, for token-id tests: no specials, no stop tokens."""

    vocab_size = V
    default_stop_token_ids = ()

    def special(self, name):
        return None

    def decode(self, ids):
        return " ".join(map(str, ids))


# ---------------------------------------------------------------------- logits
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, checkpoint, record_property):
    """Cache-free logits equal transformers' within 1e-4 (measured: 0 to 1.4e-6), for single
    prompts up to the whole context and a batch."""
    d, hf = checkpoint(name)
    model = load_llama_checkpoint(d, CPU, torch.float32)
    c = hf.config
    assert model.info.arch == c.model_type and model.info.vocab_size == V and model.info.context_len == CTX
    assert model.info.n_layer == 2 and model.info.n_kv_head == 2
    assert model.info.head_dim == getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    worst = 0.0
    for p in _prompts(10, 3) + [torch.randint(0, V, (CTX,)).tolist()]:
        x = torch.tensor([p])
        with torch.no_grad():
            want = hf(x).logits
        got = model(x)
        assert got.dtype == torch.float32 and got.shape == want.shape
        worst = max(worst, (got - want).abs().max().item())
    batch = torch.randint(0, V, (4, 50))
    with torch.no_grad():
        worst = max(worst, (model(batch) - hf(batch).logits).abs().max().item())
    record_property("max_abs_diff", worst)
    print(f"{name}: max |logits - transformers| = {worst:.3g}")
    assert worst <= 1e-4


def test_sliding_window_is_applied(checkpoint):
    """The windowed cases are not vacuous: past the window, logits differ from the same
    weights with full attention, and transformers agrees with the windowed ones (above)."""
    for name, key in (("mistral", "sliding_window"), ("qwen2-window", "use_sliding_window")):
        d, _ = checkpoint(name)
        model = load_llama_checkpoint(d, CPU, torch.float32)
        cfg = json.loads((d / "config.json").read_text())
        cfg[key] = None if key == "sliding_window" else False
        full = build_llama(cfg, load_file(str(d / "model.safetensors")), CPU, torch.float32, "test")
        assert any(w is not None for w in model.cfg.windows) and all(w is None for w in full.cfg.windows)
        x = torch.tensor([_prompts(10, 3)[8]])  # 40 tokens
        W = 16 if name == "mistral" else 12
        a, b = model(x)[0], full(x)[0]
        assert torch.equal(a[:W], b[:W]) and not torch.allclose(a[W:], b[W:], atol=1e-3)


# ---------------------------------------------------------------------- greedy and logprobs
@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    """name -> (prompts, transformers' greedy tokens, its log-softmax per step), 8 prompts x
    32 tokens from one left-padded `generate(do_sample=False)` call."""
    cache = {}

    def get(name):
        if name not in cache:
            _, hf = checkpoint(name)
            prompts = _prompts(8, 5)
            L = max(map(len, prompts))
            ids = torch.zeros(len(prompts), L, dtype=torch.long)
            mask = torch.zeros(len(prompts), L, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, L - len(p):] = torch.tensor(p)
                mask[i, L - len(p):] = 1
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
            logprobs = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)  # (B, 32, V)
            cache[name] = prompts, out.sequences[:, L:].tolist(), logprobs
        return cache[name]

    return get


@pytest.mark.parametrize("ops", ["fused", "torch"])
@pytest.mark.parametrize("name", GREEDY)
def test_engine_greedy_matches_generate(name, ops, checkpoint, hf_greedy, record_property, monkeypatch):
    """The engine's greedy tokens equal transformers' for 8 prompts x 32 tokens (prompt +
    generated up to 62 tokens: past every sliding window), and its logprobs are within 1e-4
    of transformers' log-softmax: with the step's norms, rotary and gating fused in the
    compiled library, and with torch's operations (where it cannot be built)."""
    if ops == "torch":
        monkeypatch.setattr(base, "native_kernels", lambda: None)
    elif native_kernels() is None:
        pytest.skip("the compiled kernels are unavailable here")
    d, _ = checkpoint(name)
    prompts, want, want_lp = hf_greedy(name)
    assert min(len(set(w)) for w in want) >= 8  # not a degenerate repeat of one token
    eng = Engine(load_llama_checkpoint(d, CPU, torch.float32), _Tokenizer(), max_num_seqs=8)
    res = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[]))
    assert [r[0].tokens for r in res] == want
    worst = 0.0
    for i, r in enumerate(res):
        ref = want_lp[i, torch.arange(32), torch.tensor(r[0].tokens)]
        worst = max(worst, (torch.tensor(r[0].logprobs) - ref).abs().max().item())
    record_property("max_logprob_diff", worst)
    print(f"{name}: max |logprob - transformers| = {worst:.3g}")
    assert worst <= 1e-4


def test_bfloat16_load_is_close(checkpoint, hf_greedy):
    """bfloat16 weights and activations: logits within a few percent of float32's scale and
    most greedy tokens (the first 8 of each prompt) the same as float32's."""
    d, _ = checkpoint("llama")
    prompts, want, _ = hf_greedy("llama")
    model = load_llama_checkpoint(d, CPU, torch.bfloat16)
    assert model.embed.dtype == torch.bfloat16 and model.layers[0].qkv.dtype == torch.bfloat16
    ref = load_llama_checkpoint(d, CPU, torch.float32)
    x = torch.tensor([prompts[4]])
    got, base = model(x), ref(x)
    assert got.dtype == torch.float32
    assert (got - base).abs().max().item() < 0.1 * base.abs().max().item()
    res = Engine(model, _Tokenizer(), max_num_seqs=8).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[]))
    same = sum(a == b for r, w in zip(res, want) for a, b in zip(r[0].tokens, w[:8]))
    print(f"bfloat16: {same} of 64 greedy tokens equal float32's")
    assert same >= 48


# ---------------------------------------------------------------------- files
def test_sharded_and_bin_weights_load_identically(checkpoint, tmp_path):
    """save_pretrained with a small max_shard_size (model.safetensors.index.json + shards) and
    a pytorch_model.bin give bit-identical logits to the single safetensors file."""
    d, hf = checkpoint("qwen3")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(d / "config.json", binary / "config.json")
    torch.save(load_file(str(d / "model.safetensors")), binary / "pytorch_model.bin")
    x = torch.tensor([_prompts(5, 9)[4]])
    want = load_llama_checkpoint(d, CPU, torch.float32)(x)
    for path in (sharded, binary):
        model = load_llama_checkpoint(path, CPU, torch.float32)
        assert torch.equal(model(x), want)
    assert "shards" in load_llama_checkpoint(sharded, CPU, torch.float32).info.description


@pytest.mark.parametrize("index_name, content, pattern", [
    ("model.safetensors.index.json", {"weight_map": {}}, r"weight_map must be a non-empty object"),
    ("pytorch_model.bin.index.json", {"weight_map": {}}, r"weight_map must be a non-empty object"),
    ("model.safetensors.index.json", {"weight_map": {"model.norm.weight": 3}}, r"weight_map must be"),
    ("model.safetensors.index.json", {"metadata": {}}, r"weight_map must be"),
    ("model.safetensors.index.json", b"\xff\xfe garbage", r"not valid JSON"),
])
def test_malformed_shard_index_is_named(checkpoint, tmp_path, index_name, content, pattern):
    """A shard index with no shards listed (an empty weight_map), shard names that are not
    strings, or bytes that are not UTF-8 JSON is a CheckpointError naming the index file, for
    the loader and for a weight swap's skeleton alike (an empty index crashed with an
    IndexError, non-UTF-8 bytes with a bare UnicodeDecodeError)."""
    from engine.loading.checkpoint import model_skeleton

    d, _ = checkpoint("qwen2")
    p = tmp_path / "ckpt"
    p.mkdir()
    shutil.copy(d / "config.json", p / "config.json")
    shutil.copy(d / "model.safetensors", p / "model-00001-of-00001.safetensors")
    (p / index_name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    where = re.escape(str(p / index_name))
    with pytest.raises(CheckpointError, match=where + r": .*" + pattern):
        load_llama_checkpoint(p, CPU, torch.float32)
    with pytest.raises(CheckpointError, match=where + r": .*" + pattern):
        model_skeleton(p, "cpu", torch.float32)


def test_load_engine_detects_llama_family(checkpoint, tmp_path):
    """A config.json of the Llama family is detected from model_type / architectures and
    loads through load_engine (float32 on CPU with dtype auto), tokenizer given explicitly."""
    d, _ = checkpoint("mistral")
    assert detect_format(d) == "llama"
    enc = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|endoftext|>": 256})
    with open(tmp_path / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f)
    eng = load_engine(d, device="cpu", dtype="auto", tokenizer=tmp_path / "tokenizer.pkl")
    auto = torch.bfloat16 if bfloat16_is_faster()[0] else torch.float32  # this CPU's choice
    assert eng.dtype == auto and eng.model.info.arch == "mistral"
    out = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[]))
    assert len(out[0][0].tokens) == 4


def test_stop_tokens_from_config_and_generation_config(checkpoint, tmp_path):
    """eos_token_id (int or list) from generation_config.json, else config.json, becomes
    ModelInfo.stop_token_ids; the engine stops there by default (finish_reason "stop", the
    stop token kept as the last token) and not when the request says stop_token_ids=[]."""
    d, _ = checkpoint("qwen2")
    target = tmp_path / "ckpt"
    shutil.copytree(d, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["eos_token_id"] = 7
    (target / "config.json").write_text(json.dumps(cfg))
    (target / "generation_config.json").unlink(missing_ok=True)
    assert load_llama_checkpoint(target, CPU, torch.float32).info.stop_token_ids == (7,)
    model = load_llama_checkpoint(d, CPU, torch.float32)
    free = Engine(model, _Tokenizer()).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20,
                                                                             stop_token_ids=[]))[0][0]
    stop_at = free.tokens[3]
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_at, 9]}))
    model = load_llama_checkpoint(target, CPU, torch.float32)
    assert model.info.stop_token_ids == (stop_at, 9)
    s = Engine(model, _Tokenizer()).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20))[0][0]
    first = free.tokens.index(stop_at)
    assert s.finish_reason == "stop" and s.tokens == free.tokens[:first + 1] and s.stop_reason == stop_at
    s = Engine(model, _Tokenizer()).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20,
                                                                         stop_token_ids=[]))[0][0]
    assert s.finish_reason == "length" and s.tokens == free.tokens


# ---------------------------------------------------------------------- config parsing
def test_rope_tables_equal_transformers():
    """Inverse frequencies and attention scaling equal transformers' ROPE_INIT_FUNCTIONS bit
    for bit, for each supported type (yarn with and without mscale / mscale_all_dim /
    attention_factor / truncate), in both config spellings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    variants = [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
        {**LLAMA3, "rope_theta": 500000.0, "original_max_position_embeddings": 8192},
        LLAMA3,
        YARN,
        {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
        {**YARN, "attention_factor": 1.5, "truncate": False},
        {**YARN, "factor": None},  # factor from max_position_embeddings / original
    ]
    for head_dim in (16, 64, 128):
        for rp in variants:
            cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=512 // head_dim,
                                           max_position_embeddings=4096 if rp.get("factor", 1) else 256,
                                           rope_parameters=dict(rp))
            rope_type = rp["rope_type"]
            if rope_type == "default":
                want, want_scale = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding \
                    .compute_default_rope_parameters(cfg)
            else:
                want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, CPU)
            for config in (cfg.to_dict(), _spelled_4x(cfg.to_dict())):
                rope = parse_rope_scaling(config, "config.json")
                got, scale = rope.inv_freq(head_dim, cfg.max_position_embeddings)
                assert rope.rope_type == rope_type
                assert torch.equal(got, want), (rp, head_dim)
                assert scale == pytest.approx(want_scale, rel=1e-12), (rp, head_dim)


def _spelled_4x(cfg: dict) -> dict:
    cfg = dict(cfg)
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = None if rp["type"] == "default" else rp
    return cfg


def test_windows_follow_transformers():
    """Per-layer windows as transformers builds them: transformers' sliding_window W lets a
    query see W keys (kv.attend's window W - 1); Qwen2/Qwen3 window the layers from
    max_window_layers on, or as layer_types says, and only with use_sliding_window; Mistral
    windows every layer; Llama none."""
    base = {**SHAPE, "num_hidden_layers": 4}

    def windows(**kw):
        return parse_llama_config({**base, **kw}, "config.json").windows

    assert windows(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2) == \
        (None, None, 7, 7)
    assert windows(model_type="qwen2", use_sliding_window=False, sliding_window=8, max_window_layers=2) == (None,) * 4
    assert windows(model_type="qwen3", use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"] * 2) == (7, None, 7, None)
    assert windows(model_type="mistral", sliding_window=4096) == (4095,) * 4
    assert windows(model_type="mistral", sliding_window=None) == (None,) * 4
    assert windows(model_type="mistral") == (4095,) * 4  # MistralConfig's default
    assert windows(model_type="llama", sliding_window=8) == (None,) * 4
    for model_type, W in (("qwen2", 8), ("qwen3", 8)):
        cfg = getattr(transformers, f"{model_type.capitalize()}Config")(
            **base, use_sliding_window=True, sliding_window=W, max_window_layers=1)
        want = tuple(W - 1 if t == "sliding_attention" else None for t in cfg.layer_types)
        assert parse_llama_config(cfg.to_dict(), "config.json").windows == want == (None, 7, 7, 7)


def test_config_defaults_follow_transformers():
    """Keys a config.json omits take the defaults of transformers' config class for that
    model type (Qwen3's head_dim 128 and 32 KV heads, Llama's KV heads = heads, eos_token_id)."""
    c = parse_llama_config({"model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 32,
                            "num_hidden_layers": 1, "vocab_size": 100, "intermediate_size": 64}, "config.json")
    assert (c.head_dim, c.num_kv_heads, c.max_position_embeddings, c.rms_norm_eps) == (128, 32, 32768, 1e-6)
    assert c.qk_norm and not c.qkv_bias and not c.tie_word_embeddings
    c = parse_llama_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                            "num_hidden_layers": 1, "vocab_size": 100, "intermediate_size": 64}, "config.json")
    assert (c.model_type, c.head_dim, c.num_kv_heads, c.eos_token_ids, c.rope.rope_type) == \
        ("llama", 16, 4, (2,), "default")
    c = parse_llama_config({"model_type": "qwen2", "eos_token_id": [5, 6, 5], **SHAPE}, "config.json")
    assert c.qkv_bias and not c.o_bias and c.eos_token_ids == (5, 6)


# ---------------------------------------------------------------------- errors
def _variant(tmp_path: Path, src: Path, name: str, edit_sd=None, edit_cfg=None) -> Path:
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_cfg:
        edit_cfg(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if edit_sd:
        edit_sd(sd)
    save_file(sd, str(d / "model.safetensors"))
    return d


def test_unsupported_architectures_are_named(checkpoint, tmp_path):
    """An architecture outside GPT-2 and the Llama family fails detection and loading with
    an error naming it and listing the supported ones."""
    d, _ = checkpoint("llama")
    mixtral = _variant(tmp_path, d, "mixtral", edit_cfg=lambda c: c.update(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4))
    pattern = (r"config\.json: MixtralForCausalLM is not supported; supported: GPT2LMHeadModel, LlamaForCausalLM, "
               r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
    with pytest.raises(CheckpointError, match=pattern):
        detect_format(mixtral)
    with pytest.raises(CheckpointError, match=pattern):
        load_engine(mixtral, device="cpu")
    with pytest.raises(CheckpointError, match=r"MixtralForCausalLM is not supported"):
        load_llama_checkpoint(mixtral, CPU, torch.float32)
    gemma = _variant(tmp_path, d, "gemma", edit_cfg=lambda c: c.update(architectures=["Gemma2ForCausalLM"],
                                                                       model_type="gemma2"))
    with pytest.raises(CheckpointError, match=r"Gemma2ForCausalLM is not supported"):
        detect_format(gemma)
    # a config that names neither model_type nor architectures: its architecture is unknown,
    # said as such (it was read as GPT-2's and failed with "n_embd must be a positive integer")
    bare = _variant(tmp_path, d, "bare", edit_cfg=lambda c: (c.pop("model_type"), c.pop("architectures")))
    with pytest.raises(CheckpointError, match=r"config\.json: names neither model_type nor architectures.*"
                                              r"supported: GPT2LMHeadModel, LlamaForCausalLM"):
        load_engine(bare, device="cpu")
    (tmp_path / "gpt2").mkdir()  # an early GPT-2 config.json names neither and is still GPT-2's
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"n_embd": 64, "n_layer": 2, "n_head": 4,
                                                               "vocab_size": V}))
    assert detect_format(tmp_path / "gpt2") == "gpt2"
    odd = _variant(tmp_path, d, "odd", edit_cfg=lambda c: c.update(architectures=["Qwen2ForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"Qwen2ForCausalLM is not supported for model_type 'llama'"):
        load_llama_checkpoint(odd, CPU, torch.float32)


@pytest.mark.parametrize("edit, pattern", [
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope_type 'dynamic' is not supported \(supported: default, linear, llama3, yarn\)"),
    (lambda c: c.update(rope_parameters=None, rope_scaling={"type": "longrope", "short_factor": [1.0]}),
     r"rope_type 'longrope' is not supported"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     r"rope_type 'llama3' needs \['low_freq_factor', 'high_freq_factor'\]"),
    (lambda c: c.update(partial_rotary_factor=0.5), r"partial_rotary_factor 0\.5 is not supported"),
    (lambda c: c.update(hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
    (lambda c: c.update(attn_logit_softcapping=50.0), r"attn_logit_softcapping is not supported"),
    (lambda c: c.update(final_logit_softcapping=30.0), r"final_logit_softcapping is not supported"),
    (lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}), r"quant_method 'gptq'"),
    (lambda c: c.update(num_key_value_heads=3), r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (lambda c: c.update(hidden_size="64"), r"hidden_size must be a positive integer"),
])
def test_unsupported_config_features_are_named(checkpoint, tmp_path, edit, pattern):
    """Each config feature the decoder does not implement fails loading with a CheckpointError
    naming config.json and the feature."""
    d, _ = checkpoint("llama")
    p = _variant(tmp_path, d, "v", edit_cfg=edit)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + pattern):
        load_llama_checkpoint(p, CPU, torch.float32)


def test_missing_unknown_and_misshapen_weights_are_named(checkpoint, tmp_path):
    d, _ = checkpoint("qwen2")  # tied: lm_head.weight optional
    cases = [
        (dict(edit_sd=lambda sd: sd.pop("model.layers.1.self_attn.k_proj.bias")),
         r"model\.safetensors: missing keys \['model\.layers\.1\.self_attn\.k_proj\.bias'\]"),
        (dict(edit_sd=lambda sd: sd.update({"model.layers.0.mlp.experts.0.weight": torch.zeros(2)})),
         r"unknown keys \['model\.layers\.0\.mlp\.experts\.0\.weight'\]"),
        (dict(edit_sd=lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(160, 63)})),
         r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(160, 63\), expected \(160, 64\)"),
        (dict(edit_cfg=lambda c: c.update(vocab_size=V + 1)),
         r"model\.embed_tokens\.weight has shape \(384, 64\), expected \(385, 64\)"),
        (dict(edit_cfg=lambda c: c.update(tie_word_embeddings=False)), r"missing keys \['lm_head\.weight'\]"),
        (dict(edit_cfg=lambda c: c.update(num_hidden_layers=3, layer_types=None)), r"missing keys \['model\.layers\.2\."),
    ]
    for i, (kw, pattern) in enumerate(cases):
        p = _variant(tmp_path, d, str(i), **kw)
        with pytest.raises(CheckpointError, match=pattern):
            load_llama_checkpoint(p, CPU, torch.float32)
    # an old checkpoint's rotary buffer is ignored, as transformers does
    p = _variant(tmp_path, d, "inv_freq", edit_sd=lambda sd: sd.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_llama_checkpoint(p, CPU, torch.float32)
