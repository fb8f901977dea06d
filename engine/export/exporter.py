"""`export`: a checkpoint batchgen loads -> a directory another runtime runs (`batchgen export`).

    DIR/model.onnx               (--format onnx; model.pt2 for --format pt2)
    DIR/genai_config.json        onnxruntime-genai's config (architectures it runs, dynamic ONNX)
    DIR/tokenizer files          as the checkpoint has them (engine/export/artifacts.py)
    DIR/batchgen_export.json     source SHA-256, interface, options, verification result

Everything is written to a temporary directory beside DIR and renamed to DIR at the end, so a
failed export (bad input, failed verification) leaves no partial directory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.export.errors import ExportError, VerificationError

if TYPE_CHECKING:
    from engine.models.base import CausalLM

FORMATS = ("onnx", "pt2")
DTYPES = {"float32": torch.float32, "float16": torch.float16}
DEFAULT_MAX_TOKENS = 32  # the verification's tokens per prompt when max_tokens is not given
# the fewest a verification generates: the first token comes from the prefill (past of length
# 0), the second from the first decode step, the only one that feeds the KV cache back in
MIN_VERIFY_TOKENS = 2


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {str(out)!r} already exists and is not an empty directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"--out {str(out)!r}: its parent directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out {str(out)!r}: cannot write in {str(parent)!r} (permission denied)")


def verify_tokens(max_tokens: int | None, context_len: int, longest_prompt: int) -> int:
    """The tokens per prompt the verification generates: `max_tokens` as given, or without it
    DEFAULT_MAX_TOKENS clamped to what the model's context leaves after the longest prompt (a
    default is not a request: a tiny-context model just verifies fewer tokens). Raises
    ExportError naming --max-tokens and the context for a given value the context cannot hold,
    and for a context that cannot hold the longest prompt and MIN_VERIFY_TOKENS tokens (a
    prefill and a decode step)."""
    # the engine generates min(max_tokens, context - prompt) tokens and the artifact's position
    # table ends at the context (onnxruntime: "Gather ... out of bounds"): prompt + tokens must fit
    room = context_len - longest_prompt
    if max_tokens is None:
        if room < MIN_VERIFY_TOKENS:
            raise ExportError(f"--verify: the model's context of {context_len} tokens cannot hold the verification's "
                              f"longest prompt ({longest_prompt} tokens) and {MIN_VERIFY_TOKENS} generated tokens "
                              f"(the prefill's and a decode step's)")
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise ExportError(f"--max-tokens {max_tokens}: the verification's longest prompt ({longest_prompt} tokens) "
                          f"plus {max_tokens} generated tokens exceeds the model's context of {context_len} tokens "
                          f"(at most {max(room, 0)})")
    return max_tokens


def check_options(out: Path, format: str, dtype: str, static_max_len: int | None, verify: bool,
                  max_tokens: int | None, context_len: int | None = None, longest_prompt: int | None = None) -> None:
    """Raise ExportError naming the option for an unknown format or dtype, a pt2 export without a
    static length, a --max-tokens below MIN_VERIFY_TOKENS, a static length below the verification's prompt +
    tokens or above the model's context, or an output that cannot be written. (The
    verification's prompt + tokens against the context: verify_tokens.)"""
    if format not in FORMATS:
        raise ExportError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if format == "pt2" and static_max_len is None:
        raise ExportError("--format pt2 is the static-shape variant: give --static-max-len N")
    if format == "pt2" and dtype != "float32":
        raise ExportError("--format pt2: only --dtype float32 (the CPU AOTInductor build)")
    # torch.onnx.export (the dynamo exporter) needs onnx and onnxscript, verifying onnxruntime:
    # pyproject.toml's `export` extra, which `make demo` does not install
    needed = ("onnx", "onnxscript") + (("onnxruntime",) if verify else ()) if format == "onnx" else ()
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"--format onnx{' --verify' if verify else ''} needs {', '.join(missing)}, not installed: "
                          f"pip install -e '.[export]' (or pip install {' '.join(missing)})")
    if verify and max_tokens is not None and max_tokens < MIN_VERIFY_TOKENS:
        raise ExportError(f"--max-tokens {max_tokens}: must be at least {MIN_VERIFY_TOKENS} (the first token comes "
                          f"from the prefill alone; the second is the first decode step, the only one that "
                          f"reads the KV cache back in)")
    if static_max_len is not None:
        if static_max_len < 1:
            raise ExportError(f"--static-max-len {static_max_len}: must be at least 1")
        if context_len is not None and static_max_len > context_len:
            raise ExportError(f"--static-max-len {static_max_len} exceeds the model's context of {context_len} "
                              f"tokens")
        if verify and longest_prompt is not None and static_max_len < longest_prompt + (max_tokens or 0):
            raise ExportError(f"--static-max-len {static_max_len} is below the verification's longest prompt "
                              f"({longest_prompt} tokens) plus {max_tokens} generated tokens")
    _check_out(out)


def export(model: "str | Path | CausalLM", out: str | Path, *, format: str = "onnx", dtype: str = "float32",
           static_max_len: int | None = None, verify: bool = False, max_tokens: int | None = None,
           step: int | None = None, log=print) -> dict:
    """Export checkpoint `model` (any `model.path` batchgen loads, or a loaded CausalLM on CPU in
    the export's dtype, e.g. after `Engine.load_weights`; another dtype or device is an
    ExportError) to directory `out`.

    format: "onnx" (onnxruntime, onnxruntime-genai) or "pt2" (torch.export + AOTInductor,
        static shapes; needs static_max_len). dtype: "float32" or "float16" (weights, KV).
    static_max_len: fixed KV buffers of N positions instead of growing past/present.
    verify: run engine/export/verify.py's greedy loop (4 prompts, `max_tokens` tokens) in the
        artifact against the engine before the directory is renamed into place. max_tokens:
        None: 32, or fewer where the model's context cannot hold the longest prompt (21) + 32;
        below 2 (no decode step) or a number the context cannot hold is an ExportError
        (check_options, verify_tokens).
    step: nanochat only, the checkpoint step (default: the highest). log: progress lines.
    Returns batchgen_export.json's contents. Raises ExportError (bad options, unwritable out,
    an unsupported model; nothing written), VerificationError (nothing written), and what
    loading raises (FileNotFoundError, CheckpointError).
    """
    from engine.export.kv_forward import KVExplicitForward
    from engine.export.verify import PROMPT_LENGTHS, check, verify as run_verify

    out = Path(out)
    check_options(out, format, dtype, static_max_len, verify, max_tokens)
    t0 = time.perf_counter()
    source, fmt, m = _load(model, dtype, step)
    if verify:  # before tracing: a verification the context cannot hold fails in onnxruntime's Gather
        wanted, max_tokens = max_tokens, verify_tokens(max_tokens, m.info.context_len, max(PROMPT_LENGTHS))
        if wanted is None and max_tokens < DEFAULT_MAX_TOKENS:
            log(f"export: verifying {max_tokens} tokens per prompt, not {DEFAULT_MAX_TOKENS}: the model's context "
                f"is {m.info.context_len} tokens and the longest verification prompt {max(PROMPT_LENGTHS)}")
    check_options(out, format, dtype, static_max_len, verify, max_tokens, m.info.context_len, max(PROMPT_LENGTHS))
    fwd = KVExplicitForward(m, static_max_len)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent if str(out.parent) else "."))
    except OSError as e:
        raise ExportError(f"--out {str(out)!r}: cannot create a directory beside it ({e})") from None
    try:
        filename, runner = _write_model(fwd, tmp, format, verify)
        export_s = time.perf_counter() - t0
        log(f"export: {filename} written in {export_s:.1f} s")
        result = None
        if verify:
            result = run_verify(runner, m, max_tokens=max_tokens, static_max_len=static_max_len,
                                kv_dtype=DTYPES[dtype])
            log(result.summary())
        record = _write_beside(tmp, fwd, source, fmt, filename, format, dtype, log)
        record.update(export_seconds=round(export_s, 2),
                      verification=None if result is None else result.as_dict())
        (tmp / "batchgen_export.json").write_text(json.dumps(record, indent=2))
        if result is not None:
            check(result)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 -> what a plain mkdir would give
        if out.exists():
            out.rmdir()  # an empty directory (checked): replaced by the finished one
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _load(model, dtype: str, step: int | None):
    """(source path or None, detected format, the model on CPU in `dtype`)."""
    from engine.loading.builtin import resolve_builtin
    from engine.loading.checkpoint import detect_format, load_model
    from engine.models.base import CausalLM

    if isinstance(model, CausalLM):
        # the graph takes the model's own dtype and the verification feeds `dtype`'s: a model in
        # another (a float16 one exported as float32, bfloat16 weights) failed in onnxruntime
        # after the graph was traced ("Unexpected input data type"), and without --verify wrote
        # a batchgen_export.json naming a dtype the graph does not have
        p = next(model.parameters(), None)
        if p is not None and (p.device.type != "cpu" or model.kv_dtype != DTYPES[dtype] or model.act_dtype
                              not in (None, DTYPES[dtype])):
            kv = str(model.kv_dtype).replace("torch.", "")
            raise ExportError(f"dtype {dtype!r}: the loaded {type(model).__name__}'s KV cache is {kv} on "
                              f"{p.device.type}"
                              f"{' (bfloat16 weights)' if model.act_dtype not in (None, model.kv_dtype) else ''}; "
                              f"export a model loaded on CPU in {dtype} (load_model(path, 'cpu', torch.{dtype})), "
                              f"or its path")
        return None, "in-memory", model
    source = Path(resolve_builtin(model))
    fmt = detect_format(model)
    return (source if source.exists() else None), fmt, load_model(model, "cpu", DTYPES[dtype], step=step)


def _write_model(fwd, tmp: Path, format: str, verify: bool):
    """The graph file in `tmp`: (its name, a verify runner on it or None)."""
    if format == "onnx":
        from engine.export.onnx_writer import onnx_runner, write_onnx

        write_onnx(fwd, tmp / "model.onnx")
        return "model.onnx", (onnx_runner(tmp / "model.onnx") if verify else None)
    from engine.export.pt2 import pt2_runner, write_pt2

    write_pt2(fwd, tmp / "model.pt2")
    return "model.pt2", (pt2_runner(tmp / "model.pt2", fwd=fwd) if verify else None)


def _write_beside(tmp: Path, fwd, source: Path | None, fmt: str, filename: str, format: str, dtype: str,
                  log=print) -> dict:
    """Tokenizer files and genai_config.json into `tmp`; returns the record's other fields."""
    from engine.export.artifacts import checkpoint_sha256, genai_config, genai_interface, interface, write_tokenizer

    m = fwd.model
    tok_files = write_tokenizer(source, fmt, tmp) if source is not None else []
    genai = skipped = None
    if format == "onnx" and fwd.static_max_len is None and genai_interface(m):
        end_ids, bos_id, why = _end_tokens(m, source, fmt)
        if end_ids:
            genai = genai_config(m, filename, end_ids, bos_id)
            (tmp / "genai_config.json").write_text(json.dumps(genai, indent=2))
        else:
            skipped = f"genai_config.json not written: no end token is known ({why}); onnxruntime-genai would never stop"
            log(f"export: {skipped}")
    return {"source": {"path": None if source is None else str(source), "format": fmt,
                       **(checkpoint_sha256(source) if source is not None else {"sha256": None})},
            "model": {"arch": m.info.arch, "description": m.info.description, "architecture": _plain(m.architecture())},
            "format": format, "file": filename, "dtype": dtype, "interface": interface(fwd),
            "tokenizer_files": tok_files, "genai_config": genai is not None,
            **({"genai_config_skipped": skipped} if skipped else {}), "torch": torch.__version__}


def _end_tokens(m, source: Path | None, fmt: str) -> tuple[list[int], int | None, str]:
    """(the end tokens the engine stops on by default, in the vocabulary; the tokenizer's BOS
    or None; why there are none, when there are none). The same source as
    `Engine.default_stop_ids`: the checkpoint's own (ModelInfo.stop_token_ids), else the
    tokenizer's default_stop_token_ids, the tokenizer found as load_checkpoint finds it."""
    from engine.loading.checkpoint import TINY_RANDOM, checkpoint_tokenizer

    tok, why = None, "no tokenizer: an in-memory model"
    if source is not None or fmt == TINY_RANDOM:
        try:
            tok = checkpoint_tokenizer(source, fmt)
        except (OSError, ValueError) as e:  # a checkpoint without a readable tokenizer: ids only
            why = f"the checkpoint's tokenizer cannot be read: {e}"
    ids = list(m.info.stop_token_ids) or (list(tok.default_stop_token_ids) if tok is not None else [])
    vocab = m.info.vocab_size
    # an id beyond the logits can never be generated, and genai feeds pad_token_id to the graph
    inside = list(dict.fromkeys(i for i in ids if 0 <= i < vocab))
    if ids and not inside:
        why = f"the end tokens {ids} lie outside the vocabulary of {vocab}"
    elif tok is not None and not ids:
        why = "neither the checkpoint nor its tokenizer names one"
    return inside, (tok.bos_token_id if tok is not None else None), why


def _plain(d):
    """A dict of dataclass values as JSON-able plain values."""
    return json.loads(json.dumps(d, default=str))


__all__ = ["export", "ExportError", "VerificationError", "check_options", "verify_tokens"]
