"""What lies beside the exported model: the tokenizer files and chat template, onnxruntime-genai's
`genai_config.json`, and `batchgen_export.json` (the source checkpoint's SHA-256, the interface,
the verification result).

genai_config.json follows onnxruntime-genai's schema (its builder.py writes the same keys):
model.type, the decoder's file, shape and input/output names with `%d` templates, and the
search defaults (greedy). It is written wherever the graph has exactly genai's decoder
interface: the dynamic-shape ONNX (the static variant's `cache_position` input is batchgen's
own) of every model but nanochat with a smear gate (its past_smear pair). The type is the
model's own for llama, mistral, qwen2 and qwen3; GPT-2 and nanochat get genai's generic
"decoder" (genai 0.18's "gpt2" type refused this graph: "Model input was not found"). The graph applies
sliding windows itself, so genai needs no window setting.

Its end tokens (eos_token_id) are the ones the engine stops on by default (`Engine.default_stop_ids`:
the checkpoint's own, ModelInfo.stop_token_ids, else its tokenizer's default_stop_token_ids), those
within the vocabulary; pad_token_id is the first of them. Without an end token the file is not
written (exporter.py says why in the log and in batchgen_export.json): genai stops on eos_token_id
alone, and a made-up one (token 0 was once written: a byte in nanochat's vocabulary) makes it stop
on a real token and never on the model's end.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from engine.models.base import CausalLM

GENAI_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "decoder",
               "nanochat": "decoder"}  # batchgen's arch -> genai's model.type
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json", "generation_config.json")


def checkpoint_sha256(path: Path) -> dict:
    """{"sha256": hex, "files": {name: hex}}: a file's SHA-256, or for a directory the SHA-256 of
    its files' names and hashes in name order (each file read in 1 MiB chunks)."""
    def digest(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    if path.is_file():
        return {"sha256": digest(path), "files": {path.name: digest(path)}}
    files = {p.name: digest(p) for p in sorted(path.iterdir()) if p.is_file()}
    h = hashlib.sha256()
    for name, d in files.items():
        h.update(f"{name}\0{d}\n".encode())
    return {"sha256": h.hexdigest(), "files": files}


def write_tokenizer(source: Path, fmt: str, out: Path) -> list[str]:
    """Copy or write the tokenizer beside the model; returns the file names written.

    Hugging Face directories: their tokenizer files as they are. GGUF: tokenizer.json and
    tokenizer_config.json (special tokens, chat template) from the file's metadata, as
    batchgen's own GGUF tokenizer reads them. nanochat: tokenizer.pkl where the loader finds
    it. A checkpoint without a (readable) tokenizer gets none: nothing is written."""
    written = []
    if fmt == "gguf":
        from engine.tokenizers.hf_tokenizer import HFTokenizer

        try:
            tok = HFTokenizer.from_gguf(source)
        except ValueError:  # a vocabulary batchgen cannot build a tokenizer from: ids only
            return []
        (out / "tokenizer.json").write_text(tok.backend.to_str())
        cfg = {"tokenizer_class": "GPT2Tokenizer" if tok._byte_level else "LlamaTokenizerFast",
               "add_bos_token": tok.prepend_bos, "clean_up_tokenization_spaces": False,
               **tok.special_tokens_map}
        if tok.chat_template is not None:
            cfg["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        return ["tokenizer.json", "tokenizer_config.json"]
    if fmt == "nanochat":
        # where Tokenizer.find_nanochat looks (the end tokens come from there): the directory
        # resolved, or a relative `d20` (its parent.parent is ".") missed <base>/tokenizer/
        for cand in (source / "tokenizer.pkl", source.resolve().parent.parent / "tokenizer" / "tokenizer.pkl"):
            if cand.is_file():
                shutil.copy2(cand, out / "tokenizer.pkl")
                return ["tokenizer.pkl"]
        return []
    if fmt not in ("gpt2", "llama"):  # tiny-random: the demo tokenizer is built in, not a file
        return []
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            written.append(name)
    return written


def genai_interface(model: CausalLM) -> bool:
    """True where the graph has onnxruntime-genai's decoder interface (the dynamic ONNX of an
    architecture in GENAI_TYPES without carried state: not nanochat's smear gate)."""
    return model.info.arch in GENAI_TYPES and not model.info.state_dims


def genai_config(model: CausalLM, filename: str, end_ids: list[int], bos_id: int | None) -> dict | None:
    """onnxruntime-genai's genai_config.json for the model, or None where the graph's interface
    is not genai's (nanochat's smear state). end_ids: the engine's default stop tokens in the
    vocabulary, at least one (ValueError without: exporter.py skips the file instead); bos_id:
    the tokenizer's BOS token where it has one."""
    info = model.info
    if not genai_interface(model):
        return None
    eos = list(end_ids)
    if not eos or any(not 0 <= i < info.vocab_size for i in eos):
        raise ValueError(f"genai_config needs end tokens within the vocabulary of {info.vocab_size}, got {eos}")
    heads = (getattr(getattr(model, "cfg", None), "num_heads", None) or getattr(model, "n_head", None)
             or getattr(getattr(model, "config", None), "n_head", info.n_kv_head))
    # the residual stream's width: not heads x head_dim where a config gives its own head_dim
    # (Qwen3: 16 heads of 128 in a 1024-wide model)
    hidden = (getattr(getattr(model, "cfg", None), "hidden_size", None) or getattr(model, "n_embd", None)
              or getattr(getattr(model, "config", None), "n_embd", None) or heads * info.head_dim)
    return {
        "model": {
            # genai only reports it (Tokenizer.bos_token_id); GPT-2's own convention without one
            "bos_token_id": bos_id if bos_id is not None else eos[0],
            "context_length": info.context_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": info.head_dim,
                "hidden_size": hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads,
                "num_hidden_layers": info.n_layer,
                "num_key_value_heads": info.n_kv_head,
            },
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            # genai fills a finished row's later tokens with pad_token_id and pads a batch's shorter
            # prompts with it (its id goes through the graph's embedding Gather: in the vocabulary),
            # counting trailing pads as padding: an end token reads as "ended" in either place and
            # ends no prompt, where a byte like token 0 would read as generated text
            "pad_token_id": eos[0],
            "type": GENAI_TYPES[info.arch],
            "vocab_size": info.vocab_size,
        },
        # greedy by do_sample alone: genai takes top_k 1 as greedy even with do_sample set
        # (Generator::GenerateNextToken), so a caller's do_sample=True sampled nothing; top_k 0 and
        # top_p 1 sample the whole vocabulary, as SamplingParams' defaults do
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": info.context_len, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 0, "top_p": 1.0},
    }


def interface(fwd) -> dict:
    """The graph's inputs and outputs with their axes, for batchgen_export.json."""
    info = fwd.model.info
    static = fwd.static_max_len
    kv = ["batch", info.n_kv_head, static or "past", info.head_dim]
    present = ["batch", info.n_kv_head, static or "past + seq", info.head_dim]
    inputs = {"input_ids": ["batch", "seq", "int64"],
              "attention_mask": ["batch", static or "past + seq", "int64"],
              "position_ids": ["batch", "seq", "int64"]}
    if static:
        inputs["cache_position"] = ["seq", "int64"]
    inputs["past_key_values.%d.key"] = inputs["past_key_values.%d.value"] = kv
    outputs = {"logits": ["batch", "seq", info.vocab_size, "float32"],
               "present.%d.key": present, "present.%d.value": present}
    if fwd.has_smear:
        inputs["past_smear"] = outputs["present_smear"] = ["batch", info.state_dims["smear"]]
    return {"inputs": inputs, "outputs": outputs, "num_layers": info.n_layer,
            "static_max_len": static, "kv_dtype": str(fwd.model.kv_dtype).replace("torch.", "")}
