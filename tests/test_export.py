"""engine/export: every architecture batchgen loads, exported to ONNX and run in onnxruntime
(CPU provider) in a greedy loop against the engine (engine/export/verify.py): 4 prompts of
different lengths left-padded in one batch, 32 tokens, tokens identical, logits and every
`present.*` within tolerance. Checkpoints are written here: transformers' save_pretrained (Llama,
Qwen2, Qwen3, Mistral, GPT-2), nanochat's fixtures (tests/fixtures/nanochat), GGUF via gguf.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from engine.export import ExportError, VerificationError, export  # noqa: E402
from engine.export.kv_forward import KVExplicitForward  # noqa: E402
from engine.export.onnx_writer import onnx_runner, write_onnx  # noqa: E402
from engine.export.verify import check, verify  # noqa: E402
from engine.loading.checkpoint import load_model  # noqa: E402

NANOCHAT = Path(__file__).parent / "fixtures" / "nanochat"
V = 320
# eos_token_id: an end token in the vocabulary, the engine's default stop, which genai_config.json
# needs (Qwen2/Qwen3 configs have none by default)
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# name -> (config class, model class, overrides): each Llama-family feature the engine loads
HF_CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_parameters=LLAMA3)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=12,
                                                             max_window_layers=1, layer_types=None)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=128)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy tokens vary (norm gains 1 + N(0, 0.3), others N(0, 0.15))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if ("norm" in name or ".ln_" in name) else 0.15 * noise)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    def get(name: str) -> Path:
        cfg_cls, model_cls, extra = HF_CASES[name]
        kw = extra if name == "gpt2" else {**SHAPE, **extra}
        torch.manual_seed(0)
        hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
        _randomize(hf, seed=sorted(HF_CASES).index(name) + 1)
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        if name == "gpt2":  # batchgen's GPT-2 takes its end token from the tokenizer: <|endoftext|> here
            _gpt2_tokenizer(d)
        return d
    return get


def _gpt2_tokenizer(d: Path) -> None:
    """GPT-2 tokenizer files in `d`: the 256 byte tokens, no merges, <|endoftext|> at 256."""
    from engine.tokenizers.byte_level import byte_to_unicode

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    (d / "vocab.json").write_text(json.dumps({**vocab, "<|endoftext|>": 256}))
    (d / "merges.txt").write_text("#version: 0.2\n")


def _nanochat_with_tokenizer(dst: Path) -> Path:
    """The e85db6b fixture (no smear gate: genai's interface) copied to `dst` with a
    tokenizer.pkl: bytes 0..255 and tests/toy.py's nanochat specials from 256 (<|bos|> 256,
    <|assistant_end|> 260), the engine's default stops. The fixtures ship no tokenizer."""
    import pickle
    import shutil

    import tiktoken
    from toy import SPECIALS

    shutil.copytree(NANOCHAT / "nanochat_2026jan_e85db6b", dst)
    enc = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={s: 256 + i for i, s in enumerate(SPECIALS)})
    (dst / "tokenizer.pkl").write_bytes(pickle.dumps(enc))
    return dst


def _exported_ok(record: dict, out: Path) -> None:
    v = record["verification"]
    print(f"{record['model']['arch']}: {json.dumps({k: v[k] for k in ('max_logit_diff', 'max_kv_diff')})}")
    assert v["passed"] and v["tokens_identical"], v["first_difference"]
    assert v["prompt_lengths"] == [5, 13, 2, 21] and len(v["tokens"]) == 4 and len(v["tokens"][0]) == 32
    assert len({tuple(t) for t in v["tokens"]}) >= 3  # the prompts really generate different tokens
    on_disk = json.loads((out / "batchgen_export.json").read_text())
    assert on_disk["verification"] == v and len(on_disk["source"]["sha256"] or "x" * 64) == 64


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_hf_checkpoint_exports_and_verifies(name, hf_checkpoint, tmp_path):
    """Llama (llama3 rope, untied head), Qwen2 (q/k/v biases, tied head), Qwen2 and Mistral
    sliding windows (that bite: prompts + 32 tokens exceed them), Qwen3 (q/k norms, explicit
    head_dim) and GPT-2: the ONNX graph in onnxruntime generates the engine's greedy tokens,
    logits within 1e-4 and KV within 1e-5, and names the HF optimum interface with dynamic axes."""
    import onnxruntime as ort

    src = hf_checkpoint(name)
    record = export(src, tmp_path / "out", verify=True, log=lambda *_: None)
    _exported_ok(record, tmp_path / "out")
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    ins = {i.name: i.shape for i in sess.get_inputs()}
    outs = {o.name: o.shape for o in sess.get_outputs()}
    n_layer = record["interface"]["num_layers"]
    assert list(ins)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert ins["attention_mask"] == ["batch", "total"] and ins["past_key_values.0.key"][::2] == ["batch", "past"]
    assert outs["logits"][:2] == ["batch", "seq"] and outs[f"present.{n_layer - 1}.value"][::2] == ["batch", "total"]
    assert len(ins) == 3 + 2 * n_layer and len(outs) == 1 + 2 * n_layer
    assert record["source"]["sha256"] and record["genai_config"]
    genai = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"


@pytest.mark.parametrize("name", sorted(p.name for p in NANOCHAT.iterdir() if p.is_dir()))
def test_nanochat_exports_and_verifies(name, tmp_path):
    """Both nanochat generations (2025: bfloat16 rotary tables; 2026: value embeddings, resid
    lambdas, windows, backout, q/k scale, and the smear gate whose carried state is the
    past_smear/present_smear pair) export and generate the engine's tokens in onnxruntime."""
    record = export(NANOCHAT / name, tmp_path / "out", verify=True, log=lambda *_: None)
    _exported_ok(record, tmp_path / "out")
    has_smear = record["model"]["architecture"]["smear"]
    assert ("past_smear" in record["interface"]["inputs"]) == has_smear
    # onnxruntime-genai's decoder interface has no place for the smear state; the others would
    # get genai_config.json but for the end token: the fixtures ship no tokenizer to name one
    assert not (tmp_path / "out" / "genai_config.json").exists() and not record["genai_config"]
    assert ("no end token" in record.get("genai_config_skipped", "")) == (not has_smear)


def test_nanochat_windows_that_bite(tmp_path):
    """With windows of 6 positions (the fixtures' 128 never bite 53 positions), the exported
    graph still matches the engine, and the windows change the tokens, so the mask is tested."""
    model = load_model(NANOCHAT / "nanochat_2026jul_92d63d4", "cpu", torch.float32)
    full = verify(_onnx(model, tmp_path / "full.onnx"), model)
    model.windows = [6, 6, 6, None]
    windowed = check(verify(_onnx(model, tmp_path / "w.onnx"), model))
    assert windowed.tokens != full.tokens


def _onnx(model, path: Path):
    write_onnx(KVExplicitForward(model), path)
    return onnx_runner(path)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_exports_and_verifies(arch, tmp_path):
    """GGUF files (llama: Q/K permuted; qwen3: q/k norms, explicit head_dim; Q8_0 projections)
    load into the Llama model and export and verify like a Hugging Face directory."""
    from test_gguf import Q, random_model, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", random_model(arch),
                      lambda hf: Q.Q8_0 if hf.endswith("proj.weight") else Q.F32)
    record = export(path, tmp_path / "out", verify=True, log=lambda *_: None)
    _exported_ok(record, tmp_path / "out")
    assert record["source"]["format"] == "gguf" and record["model"]["arch"] == arch


def test_verification_names_the_first_difference(hf_checkpoint, tmp_path):
    """An artifact whose layer-1 values are off at one position fails verification, and the
    message names the layer and the position (what `--verify` exits 1 with)."""
    model = load_model(hf_checkpoint("qwen3"), "cpu", torch.float32)
    run = _onnx(model, tmp_path / "m.onnx")

    def broken(feed):
        out = run(feed)
        if feed["attention_mask"].shape[1] == 21:  # the prefill: prompt 3 (21 tokens, no padding)
            out["present.1.value"] = out["present.1.value"].copy()
            out["present.1.value"][3, :, 7] += 1e-3
        return out

    with pytest.raises(VerificationError, match=r"prompt 3: present\.1\.value \(layer 1\) at position 7"):
        check(verify(broken, model))


def test_top_left_causal_mask_is_caught(hf_checkpoint, tmp_path, monkeypatch):
    """The bug of the unmerged nanochat export: SDPA's is_causal with one query and many keys
    aligns the mask top-left, so a decode step attends to key 0 only. An artifact built that way
    fails verification (the check can see it), and ours passes."""
    from engine.export import kv_forward

    model = load_model(hf_checkpoint("llama"), "cpu", torch.float32)

    def top_left(q, k, v, bias):
        rep = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)

    monkeypatch.setattr(kv_forward, "attend", top_left)
    result = verify(_onnx(model, tmp_path / "bad.onnx"), model, prompts=[[5, 6, 7, 8]])
    assert not result.passed and "step 1" in result.first_difference


def test_bad_options_are_named_and_write_nothing(hf_checkpoint, tmp_path):
    """An unknown format or dtype, a pt2 export without a static length, a static length below
    the verification prompt or beyond the context, an output under a file, and an output that
    is not empty: each an ExportError naming it, and no directory (not even a temporary one)."""
    src = hf_checkpoint("qwen2")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [(dict(format="tflite"), "--format 'tflite'"), (dict(dtype="int8"), "--dtype 'int8'"),
             (dict(format="pt2"), "--static-max-len"),
             (dict(static_max_len=40, verify=True), "--static-max-len 40 is below"),
             (dict(static_max_len=4096), "exceeds the model's context of 256")]
    for kw, msg in cases:
        with pytest.raises(ExportError, match=msg):
            export(src, tmp_path / "out", log=lambda *_: None, **kw)
    with pytest.raises(ExportError, match="parent directory"):
        export(src, tmp_path / "file" / "out", log=lambda *_: None)
    with pytest.raises(ExportError, match="not an empty directory"):
        export(src, tmp_path / "full", log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_a_missing_export_extra_is_named_before_any_work(hf_checkpoint, tmp_path, monkeypatch, capsys):
    """Without the `export` extra (a `make demo` install: no onnx, onnxscript, onnxruntime),
    `batchgen export` exits 2 naming the missing packages and the install command (it ended in
    torch.onnx's traceback, exit 1); pt2 needs none of them."""
    from jobs.cli import main

    for name in ("onnx", "onnxscript", "onnxruntime"):
        monkeypatch.setitem(sys.modules, name, None)  # importlib.util.find_spec: None, as if absent
    src = hf_checkpoint("qwen2")
    assert main(["export", str(src), "--out", str(tmp_path / "out"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "needs onnx, onnxscript, onnxruntime, not installed" in err and "pip install -e '.[export]'" in err
    with pytest.raises(ExportError, match="needs onnx, onnxscript, not installed"):
        export(src, tmp_path / "out", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_model_without_kv_forward_is_refused(tmp_path):
    """A CausalLM the exporter has no KV-explicit forward for (here tests/toy.py's) is refused
    by name, before anything is written; `engine.export(...)` is the same call."""
    import engine
    from toy import ToyLM

    with pytest.raises(ExportError, match="no KV-explicit forward for ToyLM"):
        engine.export(ToyLM().eval(), tmp_path / "out", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_failed_verification_leaves_no_directory(hf_checkpoint, tmp_path, monkeypatch, capsys):
    """An export whose verification fails raises VerificationError, `batchgen export --verify`
    exits 1 saying where, and nothing is left behind (here the logit tolerance is made 0)."""
    from engine.export import verify as verify_mod
    from jobs.cli import main

    monkeypatch.setattr(verify_mod, "LOGIT_TOL", {torch.float32: 0.0, torch.float16: 0.0})
    with pytest.raises(VerificationError, match="logits at step"):
        export(hf_checkpoint("gpt2"), tmp_path / "out", verify=True, log=lambda *_: None)
    assert main(["export", str(hf_checkpoint("gpt2")), "--out", str(tmp_path / "out"), "--verify"]) == 1
    assert "verify FAILED: prompt 0: logits at step 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_onnx_decode_matches_prefill_of_the_whole_sequence(hf_checkpoint, tmp_path):
    """One graph serves prefill and decode: prefilling 9 tokens at once equals prefilling 6 and
    decoding 3 one at a time (last logits and the final KV at the real positions), with a
    left-padded row beside."""
    model = load_model(hf_checkpoint("mistral"), "cpu", torch.float32)
    run = _onnx(model, tmp_path / "m.onnx")
    L = model.info.n_layer
    ids = np.array([[0, 0, 11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27, 28, 29]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], np.int64)
    pos = np.maximum(mask.cumsum(1) - 1, 0)
    empty = {f"past_key_values.{i}.{kv}": np.zeros((2, 2, 0, 16), np.float32)
             for i in range(L) for kv in ("key", "value")}
    whole = run({"input_ids": ids, "attention_mask": mask, "position_ids": pos, **empty})
    step = run({"input_ids": ids[:, :6], "attention_mask": mask[:, :6], "position_ids": pos[:, :6], **empty})
    for t in range(6, 9):
        past = {"past_key_values." + k[8:]: v for k, v in step.items() if k.startswith("present.")}
        step = run({"input_ids": ids[:, t:t + 1], "attention_mask": mask[:, :t + 1], "position_ids": pos[:, t:t + 1],
                    **past})
    assert np.abs(step["logits"][:, -1] - whole["logits"][:, -1]).max() < 1e-5
    a, b = step[f"present.{L - 1}.key"], whole[f"present.{L - 1}.key"]
    assert np.abs(a[0, :, 2:] - b[0, :, 2:]).max() < 1e-5 and np.abs(a[1] - b[1]).max() < 1e-5  # real positions


def test_onnx_is_imported_only_by_export_code():
    """engine/ outside engine/export never imports onnx, onnxruntime or onnxruntime_genai, and
    engine/export imports them only inside functions (an engine without the export extra loads)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "engine"
    bad = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("onnx", "onnxruntime", "onnxruntime_genai", "onnxscript") for n in names):
                if "export" not in path.relative_to(root).parts or id(node) in top:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bad, bad


def test_cli_export_and_its_exit_codes(hf_checkpoint, tmp_path):
    """`batchgen export MODEL --out DIR --verify` writes the model, the tokenizer files beside it
    (as the checkpoint has them), genai_config.json and batchgen_export.json and exits 0; an
    unknown format exits 2 naming it, with no directory left."""
    import subprocess
    import sys

    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = hf_checkpoint("qwen3")
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1",
                            chat_template="{% for m in messages %}{{ m.content }}{% endfor %}").save_pretrained(src)
    root = Path(__file__).resolve().parents[1]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "jobs.cli", "export", *map(str, args)], capture_output=True,
                              text=True, cwd=root, timeout=300)

    bad = cli(src, "--out", tmp_path / "bad", "--format", "tflite")
    assert bad.returncode == 2 and "--format 'tflite'" in bad.stderr and not (tmp_path / "bad").exists()
    ok = cli(src, "--out", tmp_path / "ok", "--verify")
    assert ok.returncode == 0, ok.stderr
    assert "verify passed" in ok.stdout
    files = {p.name for p in (tmp_path / "ok").iterdir()}
    assert {"model.onnx", "genai_config.json", "batchgen_export.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert "chat_template" in (tmp_path / "ok" / "tokenizer_config.json").read_text() or \
        "chat_template.jinja" in files
    record = json.loads((tmp_path / "ok" / "batchgen_export.json").read_text())
    assert record["verification"]["passed"] and record["source"]["files"]["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


@pytest.mark.parametrize("name", ["qwen2-window", "gpt2", "nanochat"])
def test_onnxruntime_genai_runs_the_directory(name, hf_checkpoint, tmp_path):
    """onnxruntime-genai loads the exported directory as it is (genai_config.json) and its greedy
    tokens (batch 1, 40 tokens: past Qwen2's 12-token window) equal the engine's: Qwen2 with a
    sliding window under its own type, GPT-2 and nanochat (value embeddings) under genai's
    generic "decoder" type."""
    og = pytest.importorskip("onnxruntime_genai")
    from engine.export.verify import engine_reference

    src = _nanochat_with_tokenizer(tmp_path / "nc") if name == "nanochat" else hf_checkpoint(name)
    export(src, tmp_path / "out", log=lambda *_: None)
    prompt = [5, 17, 33, 2, 9, 100, 7]
    model = og.Model(str(tmp_path / "out"))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 40, min_length=len(prompt) + 40, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, np.int32))
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    want, _ = engine_reference(load_model(src, "cpu", torch.float32), [prompt], 40)
    assert got == want[0]


@pytest.mark.slow
def test_smollm2_in_onnxruntime_genai_matches_the_engine(tmp_path):
    """SmolLM2-135M-Instruct exported with --verify (under 2 minutes) loads in onnxruntime-genai
    as the directory is (genai_config.json, tokenizer), and genai's greedy tokens on 4 GSM8K
    chat prompts x 64 tokens equal the engine's (8 in the issue's measurement: docs/export.md) (each up to and including its end token)."""
    og = pytest.importorskip("onnxruntime_genai")
    import time

    from engine import SamplingParams, load_engine
    from engine.loading.builtin import smollm2_path
    from hf_cases import GSM8K_TEST

    try:
        smollm2_path()
    except FileNotFoundError:
        pytest.skip("SmolLM2 is not installed")
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} is missing")
    t0 = time.perf_counter()
    record = export("smollm2", tmp_path / "smollm2", verify=True, log=print)
    print(f"export + verify: {time.perf_counter() - t0:.1f} s (export {record['export_seconds']} s)")
    assert record["verification"]["passed"] and record["export_seconds"] < 120
    eng = load_engine("smollm2", device="cpu", dtype="float32")
    questions = [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines()[:4]]
    prompts = [eng.tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions]
    want = [r[0].tokens for r in eng.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0),
                                              prompt_ids=list(range(4)))]
    model = og.Model(str(tmp_path / "smollm2"))
    got = []
    for p in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(p) + 64, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array(p, dtype=np.int32))
        out = []
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        got.append(out)
    tok = og.Tokenizer(model)
    assert list(tok.encode("Hello world")) == eng.tokenizer.encode("Hello world")  # genai's own tokenizer agrees
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: genai {g} vs engine {w}"
    assert sum(map(len, want)) > len(want) * 32  # real answers, not immediate stops


@pytest.mark.parametrize("name", ["mistral", "nanochat"])
def test_static_variant_gives_the_same_tokens(name, hf_checkpoint, tmp_path):
    """--static-max-len: fixed (batch, kv_heads, N, head_dim) buffers written at cache_position,
    one graph for every position; the same greedy tokens as the dynamic graph and the engine
    (Mistral's sliding window; nanochat's smear state and windows), and the buffers keep N."""
    import onnxruntime as ort

    src = NANOCHAT / "nanochat_2026jul_92d63d4" if name == "nanochat" else hf_checkpoint(name)
    dynamic = export(src, tmp_path / "dyn", verify=True, log=lambda *_: None)
    static = export(src, tmp_path / "static", static_max_len=64, verify=True, log=lambda *_: None)
    _exported_ok(static, tmp_path / "static")
    assert static["verification"]["tokens"] == dynamic["verification"]["tokens"]
    sess = ort.InferenceSession(str(tmp_path / "static" / "model.onnx"), providers=["CPUExecutionProvider"])
    shapes = {o.name: o.shape for o in sess.get_outputs()}
    assert shapes["present.0.key"][0] == "batch" and shapes["present.0.key"][2] == 64
    assert "cache_position" in {i.name for i in sess.get_inputs()}
    assert not (tmp_path / "static" / "genai_config.json").exists()


def test_float16_export_verifies(hf_checkpoint, tmp_path):
    """--dtype float16: weights and KV in float16 (logits float32), the engine's tokens in its
    own float16 run, logits within 5e-2 and KV within 1e-2 (scaled as verify.py says)."""
    import onnxruntime as ort

    record = export(hf_checkpoint("qwen3"), tmp_path / "out", dtype="float16", verify=True, log=lambda *_: None)
    _exported_ok(record, tmp_path / "out")
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    types = {o.name: o.type for o in sess.get_outputs()}
    assert types["logits"] == "tensor(float)" and types["present.0.key"] == "tensor(float16)"


@pytest.mark.slow
def test_pt2_package_gives_the_same_tokens_without_batchgen(tmp_path):
    """--format pt2: torch.export + AOTInductor (compiles C++, about a minute): the package
    generates the engine's tokens in the verification loop, and a Python without batchgen on
    its path loads it with torch._inductor.aoti_load_package and runs a prefill."""
    import subprocess
    import sys

    src = NANOCHAT / "nanochat_2026jul_92d63d4"
    record = export(src, tmp_path / "pt2", format="pt2", static_max_len=64, verify=True, log=print)
    _exported_ok(record, tmp_path / "pt2")
    onnx = export(src, tmp_path / "onnx", verify=True, log=lambda *_: None)
    assert record["verification"]["tokens"] == onnx["verification"]["tokens"]
    code = """
import json, sys, torch
names = json.load(open("batchgen_export.json"))["interface"]
m = torch._inductor.aoti_load_package("model.pt2")
L, N = names["num_layers"], names["static_max_len"]
ids = torch.tensor([[1, 2, 3]]); mask = torch.zeros(1, N, dtype=torch.long); mask[:, :3] = 1
kv = [torch.zeros(1, 1, N, 16) for _ in range(2 * L)]
out = m(ids, mask, torch.arange(3)[None], torch.arange(3), *kv, torch.zeros(1, 32))
assert "engine" not in sys.modules and out[0].shape == (1, 3, 300), out[0].shape
print("ok", len(out))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "pt2", capture_output=True, text=True,
                       timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_the_documented_onnxruntime_loop_runs(hf_checkpoint, tmp_path):
    """docs/export.md's onnxruntime generation loop, run as written on an export, gives the
    tokens of the verifier's loop (engine/export/verify.py) for the same prompts."""
    import re

    from engine.export.verify import greedy_loop

    text = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    section = text.split("## Generating with onnxruntime", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    export(hf_checkpoint("llama"), tmp_path / "out", log=lambda *_: None)
    scope = {"DIR": str(tmp_path / "out")}
    exec(code, scope)
    model = load_model(hf_checkpoint("llama"), "cpu", torch.float32)
    want, _, _ = greedy_loop(_onnx(model, tmp_path / "m.onnx"), [[1, 2, 3], [4, 5, 6, 7, 8]], 32, n_layer=2,
                             n_kv_head=2, head_dim=16, kv_dtype=np.float32)
    assert scope["tokens"].shape == (2, 32) and (scope["tokens"] == want).all()


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_genai_config_sizes_are_the_models(name, hf_checkpoint):
    """genai_config.json's hidden_size is the model's (config.json's hidden_size, GPT-2's
    n_embd), not heads x head_dim: Qwen3 here has 4 heads of 24 in a 64-wide model (it wrote 96)."""
    from engine.export.artifacts import genai_config

    src = hf_checkpoint(name)
    cfg = json.loads((src / "config.json").read_text())
    dec = genai_config(load_model(src, "cpu", torch.float32), "model.onnx", [2], None)["model"]["decoder"]
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    assert dec["hidden_size"] == cfg.get("hidden_size", cfg.get("n_embd"))
    assert dec["num_attention_heads"] == heads
    assert dec["head_size"] == (cfg.get("head_dim") or cfg.get("hidden_size", cfg.get("n_embd")) // heads)
    if name == "qwen3":
        assert (dec["hidden_size"], dec["head_size"], heads) == (64, 24, 4)


def test_genai_config_ends_on_the_engines_end_tokens(tmp_path):
    """genai_config.json's end tokens are the engine's default stop tokens (nanochat: none in the
    model's info, the tokenizer's <|assistant_end|> and <|bos|>), its pad one of them, never a
    made-up token 0 (byte '\\x00' here): onnxruntime-genai stops where the engine stops, on the
    same tokens. Without a tokenizer no end token is known and the file is skipped, saying so."""
    og = pytest.importorskip("onnxruntime_genai")
    from engine import SamplingParams, load_engine

    src = _nanochat_with_tokenizer(tmp_path / "nc")
    record = export(src, tmp_path / "out", log=lambda *_: None)
    cfg = json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]
    eng = load_engine(src, device="cpu", dtype="float32")
    assert sorted(cfg["eos_token_id"]) == sorted(eng.default_stop_ids) == [256, 260]
    assert cfg["pad_token_id"] in cfg["eos_token_id"] and cfg["bos_token_id"] == 256 and record["genai_config"]
    # a prompt the engine answers with an end token (<|bos|>) after 30 tokens, within genai's 60
    prompt = [171, 206, 5, 206, 120, 131]
    (want,) = eng.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0))[0]
    assert want.finish_reason == "stop" and len(want.tokens) < 60
    params = og.GeneratorParams(og_model := og.Model(str(tmp_path / "out")))
    params.set_search_options(max_length=len(prompt) + 60, do_sample=False)
    gen = og.Generator(og_model, params)
    gen.append_tokens(np.array(prompt, np.int32))
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == want.tokens
    # the fixture as shipped, without tokenizer.pkl: nothing names an end token
    bare = export(NANOCHAT / "nanochat_2026jan_e85db6b", tmp_path / "bare", log=lambda *_: None)
    assert not (tmp_path / "bare" / "genai_config.json").exists() and not bare["genai_config"]
    assert "no end token is known" in bare["genai_config_skipped"]


def test_verification_length_must_fit_the_context(tmp_path, capsys):
    """On a GPT-2 with a 40-token context, `export --verify --max-tokens 20` (the longest
    verification prompt, 21 tokens, + 20 > 40) exits 2 naming --max-tokens and the context,
    before anything is written (it crashed in onnxruntime's Gather and exited 1), and plain
    `--verify` clamps its default 32 tokens to the 19 the context leaves and passes."""
    from jobs.cli import main

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=V,
                                                              n_positions=40)).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "gpt2"), "--out", str(out), "--verify", "--max-tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 20" in err and "context of 40 tokens" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]
    assert main(["export", str(tmp_path / "gpt2"), "--out", str(out), "--verify"]) == 0
    assert "verifying 19 tokens per prompt" in capsys.readouterr().out
    v = json.loads((out / "batchgen_export.json").read_text())["verification"]
    assert v["passed"] and v["max_tokens"] == 19 and len(v["tokens"][3]) == 19
    with pytest.raises(ExportError, match="--max-tokens 0: must be at least 2"):
        export(tmp_path / "gpt2", tmp_path / "zero", verify=True, max_tokens=0, log=lambda *_: None)


def test_verification_needs_a_decode_step(hf_checkpoint, tmp_path, capsys):
    """`export --verify --max-tokens 1` checked the prefill only (the KV cache never read back
    in) and said verified: it exits 2 naming the flag, before anything is written; 2 tokens
    verify one decode step; without --verify the flag is not read."""
    from jobs.cli import main

    src = hf_checkpoint("gpt2")
    assert main(["export", str(src), "--out", str(tmp_path / "one"), "--verify", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 1: must be at least 2" in err and "decode step" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert main(["export", str(src), "--out", str(tmp_path / "two"), "--verify", "--max-tokens", "2"]) == 0
    v = json.loads((tmp_path / "two" / "batchgen_export.json").read_text())["verification"]
    assert v["passed"] and v["max_tokens"] == 2 and all(len(t) == 2 for t in v["tokens"])
    assert main(["export", str(src), "--out", str(tmp_path / "plain"), "--max-tokens", "1"]) == 0


def test_float16_tie_is_a_tie_not_a_failure(tmp_path):
    """float16 nanochat e85db6b: at prompt 3 step 5 the engine's own float16 logits for tokens
    61 and 48 are equal, the engine's loop takes 61 and the artifact 48. Verification accepts
    that step as a tie (logits within tolerance, the artifact's token within the logit
    tolerance of the engine's top), records it, and goes on from the engine's token, so the
    later steps compare the same prefix and pass (it failed: "step 5 gives token 48, the engine 61")."""
    record = export(NANOCHAT / "nanochat_2026jan_e85db6b", tmp_path / "out", dtype="float16", verify=True,
                    log=lambda *_: None)
    v = record["verification"]
    assert v["passed"] and not v["tokens_identical"] and v["first_difference"] is None
    assert v["ties"][0].startswith("prompt 3 step 5: token 48, the engine 61, 0 below")
    assert v["tokens"][3][5] == 48 and len(v["ties"]) <= 3  # ties stay rare: the prefixes never drift apart


def test_a_loaded_model_in_another_dtype_is_refused(tmp_path):
    """A loaded CausalLM is exported in its own dtype: one in another than `dtype` (float16 for the
    default float32, float32 for float16, bfloat16 weights) is an ExportError naming both, before
    anything is traced or written (the graph took the model's dtype and the verification fed
    `dtype`'s: onnxruntime's "Unexpected input data type"; without --verify batchgen_export.json
    named a dtype the graph does not have)."""
    src = NANOCHAT / "nanochat_2026jan_e85db6b"
    with pytest.raises(ExportError, match=r"dtype 'float32': the loaded NanochatGPT's KV cache is float16"):
        export(load_model(src, "cpu", torch.float16), tmp_path / "a", log=lambda *_: None)
    with pytest.raises(ExportError, match=r"dtype 'float16': .* KV cache is float32"):
        export(load_model(src, "cpu", torch.float32), tmp_path / "b", dtype="float16", verify=True,
               log=lambda *_: None)
    bf16 = load_model(src, "cpu", torch.float32)
    bf16.use_bfloat16_weights()
    with pytest.raises(ExportError, match=r"KV cache is bfloat16 on cpu \(bfloat16 weights\)"):
        export(bf16, tmp_path / "c", verify=True, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_genai_samples_when_asked(hf_checkpoint, tmp_path):
    """genai_config.json is greedy by do_sample alone: a caller's do_sample=True samples (genai
    took the config's top_k 1 as greedy whatever do_sample said: 4 seeds, one sequence), over
    the whole vocabulary as SamplingParams' defaults (top_k 0, top_p 1)."""
    og = pytest.importorskip("onnxruntime_genai")

    export(hf_checkpoint("qwen3"), tmp_path / "out", log=lambda *_: None)
    search = json.loads((tmp_path / "out" / "genai_config.json").read_text())["search"]
    assert not search["do_sample"] and search["top_k"] == 0 and search["top_p"] == 1.0
    model = og.Model(str(tmp_path / "out"))
    seqs = set()
    for seed in range(4):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=20, do_sample=True, random_seed=seed)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array([5, 17, 33, 2, 9], np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        seqs.add(tuple(gen.get_sequence(0)))
    assert len(seqs) > 1


def test_nanochat_tokenizer_beside_a_relative_checkpoint_path(tmp_path, monkeypatch):
    """nanochat's layout, <base>/chatsft_checkpoints/d1 beside <base>/tokenizer/tokenizer.pkl,
    exported as the relative path `d1`: tokenizer.pkl is copied, found where the engine finds it
    (and genai_config.json's end tokens come from it); it was looked for under ./tokenizer/."""
    import shutil

    staged = _nanochat_with_tokenizer(tmp_path / "staged")
    ckpt, tok_dir = tmp_path / "base" / "chatsft_checkpoints" / "d1", tmp_path / "base" / "tokenizer"
    ckpt.mkdir(parents=True)
    tok_dir.mkdir()
    for f in staged.iterdir():
        shutil.copy(f, (tok_dir if f.name == "tokenizer.pkl" else ckpt) / f.name)
    monkeypatch.chdir(ckpt.parent)
    record = export("d1", tmp_path / "out", log=lambda *_: None)
    assert record["tokenizer_files"] == ["tokenizer.pkl"] and record["genai_config"]
    assert (tmp_path / "out" / "tokenizer.pkl").read_bytes() == (tok_dir / "tokenizer.pkl").read_bytes()


def test_a_static_length_below_the_tracing_step_exports(tmp_path):
    """--static-max-len 1 to 6 (below the traced example's past 4 + seq 3) exports, and the graph
    generates the engine's tokens in buffers of that length (the trace indexed past the buffer:
    an IndexError traceback, exit 1, for a length check_options accepts)."""
    src = NANOCHAT / "nanochat_2026jan_e85db6b"
    model = load_model(src, "cpu", torch.float32)
    for n, prompts in ((1, [[5]]), (4, [[5], [7, 3]])):
        export(src, tmp_path / f"s{n}", static_max_len=n, log=lambda *_: None)
        run = onnx_runner(tmp_path / f"s{n}" / "model.onnx")
        result = check(verify(run, model, max_tokens=n - 1 if n > 1 else 1, static_max_len=n, prompts=prompts))
        assert result.tokens_identical and run.session.get_inputs()[4].shape[2] == n
