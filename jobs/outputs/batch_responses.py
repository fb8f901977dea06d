"""The response side of OpenAI Batch files (`input.format: openai_batch`, `batchgen run-batch`).

The request side (the line parser, units by byte range) is jobs/inputs/openai_batch.py.

Per output row (`sample_columns`, called by the worker that writes the unit, which has the
tokenizer for per-token text and bytes): the request's fields and the sample as an OpenAI
`choice` object, JSON text in the `choice` column (jobs.outputs.schema.BATCH_FIELDS).

The response file (`write_responses`): one line per request line, in input order, from the
job's Parquet dataset once every unit is in, in the layout vLLM's run-batch writes (its
pydantic models' keys in their order, serialized as pydantic does: compact JSON, UTF-8,
pydantic's float text), for the fields the OpenAI API defines plus vLLM's stop_reason:

    {"id":"batch_req_...","custom_id":"q1","response":{"status_code":200,"request_id":"req_...",
     "body":{"id":"chatcmpl-...","object":"chat.completion","created":...,"model":"m",
             "choices":[{"index":0,"message":{"role":"assistant","content":"4","refusal":null,
                         "annotations":null,"audio":null,"function_call":null},"logprobs":null,
                         "finish_reason":"stop","stop_reason":null}],
             "service_tier":null,"system_fingerprint":"batchgen-...",
             "usage":{"prompt_tokens":31,"total_tokens":33,"completion_tokens":2,"prompt_tokens_details":null}}},
     "error":null}
    {"id":"batch_req_...","custom_id":"bad","response":{"status_code":400,"request_id":"req_...","body":null},
     "error":{"error":{"message":"...","type":"BadRequestError","param":"temperature","code":400}}}

(one line each in the file). Ids are derived from the job's fingerprint and the line number,
and `created` is the job's start (its manifest), so the file written after a resumed run
equals the file of an uninterrupted one. usage.completion_tokens counts every generated
token, the kept stop token included (as vLLM counts them); a choice's logprobs cover the
tokens of its content and a stop string, not the stop token (vLLM's include it). An error's
`param` is the body field its message names (null for the line's envelope); an error of the
engine's, which knows no file or line (a prompt longer than the context window), is given the
"<file> line <n>: body.<field>: " the parser's errors start with. docs/formats.md
lists where batchgen's file differs from vLLM's.
"""
from __future__ import annotations

import calendar
import hashlib
import json
import os
import re
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

import pydantic_core

from engine.tokenizers.stop_strings import completion_text, token_bytes
from jobs import uri
from jobs.errors import JobError, OutputError
from jobs.outputs.commit import resolve_output
from jobs.outputs.output_dir import OutputDir
from jobs.outputs.schema import CHAT_URL


def sample_columns(req: Any, sample: Any, text: str | None, tokenizer: Any) -> dict[str, Any]:
    """The BATCH_FIELDS values of one output row: the request's fields (`req`, a
    cluster.unit.UnitRequest read by jobs/inputs/openai_batch.py), and the sample as an OpenAI
    choice object (JSON text, in vLLM's key order) unless the row is an error.

    `text` is the row's `text` column (special tokens kept); the choice's content skips special
    tokens unless the request set skip_special_tokens false. stop_reason is null for a stop on
    the model's EOS token, the token id for another stop token, the stop string for a string."""
    p = req.passthrough
    cols = {"custom_id": p.get("custom_id"), "batch_line": p.get("batch_line"), "endpoint": p.get("endpoint"),
            "request_model": p.get("request_model"), "choice": None}
    if sample.finish_reason == "error" or sample.error is not None:
        return cols
    chat = p.get("_kind") == "chat"
    if p.get("_skip_special", True):
        text = _without_special_tokens(sample, text, tokenizer)
    choice: dict[str, Any] = {"index": sample.sample_index}
    if chat:
        choice["message"] = {"role": "assistant", "content": text, **_MESSAGE_NULLS}
    else:
        choice["text"] = text
    choice["logprobs"] = _logprobs(sample, tokenizer, chat) if p.get("_logprobs") else None
    choice["finish_reason"] = sample.finish_reason
    choice["stop_reason"] = _stop_reason(sample.stop_reason, tokenizer, bool(p.get("_ignore_eos")))
    cols["choice"] = json.dumps(choice, ensure_ascii=False)
    return cols


# a ChatMessage's fields after role and content, null in a text answer (vLLM writes them so)
_MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
# vLLM's floor for a logprob (a -inf logprob is not JSON)
_MIN_LOGPROB = -9999.0


def eos_token_id(tokenizer: Any) -> int | None:
    """The model's end-of-sequence token, whose stop vLLM reports as stop_reason null: the
    tokenizer's eos_token_id (Hugging Face and GGUF tokenizers), else its first default stop
    token (GPT-2's <|endoftext|>, nanochat's <|assistant_end|>)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        stops = tuple(getattr(tokenizer, "default_stop_token_ids", ()) or ())
        eos = stops[0] if stops else None
    return eos


def _stop_reason(reason: int | str | None, tokenizer: Any, ignore_eos: bool) -> int | str | None:
    """A choice's stop_reason as vLLM reports it: None for the EOS token (unless the request
    ignored EOS and listed it as a stop token), the id of another stop token, the stop string."""
    is_id = isinstance(reason, int) and not isinstance(reason, bool)
    if is_id and not ignore_eos and reason == eos_token_id(tokenizer):
        return None
    return reason


def _without_special_tokens(sample: Any, text: str | None, tokenizer: Any) -> str | None:
    """The sample's text with its special tokens skipped (vLLM's skip_special_tokens, on by
    default): `text` itself when the sample has none (its stop token aside)."""
    specials = set((getattr(tokenizer, "special_tokens", None) or {}).values())
    toks, stop = list(sample.tokens), sample.stop_reason
    if isinstance(stop, int) and toks and toks[-1] == stop:
        toks.pop()  # the stop token, never in the text
    if not any(t in specials for t in toks):
        return text
    try:
        return completion_text(tokenizer, [t for t in toks if t not in specials], stop if isinstance(stop, str) else None)
    except Exception:  # noqa: BLE001 - decoding is best effort, as for the text column
        return text


def _logprobs(sample: Any, tokenizer: Any, chat: bool) -> dict[str, Any]:
    """OpenAI logprobs of a choice: every generated token but a terminal stop token, in vLLM's
    layout (ChatCompletionLogProbs / CompletionLogProbs), logprobs floored at -9999.0 as there."""
    toks, lps = list(sample.tokens), [lp if lp is None else max(lp, _MIN_LOGPROB) for lp in sample.logprobs]
    if isinstance(sample.stop_reason, int) and toks and toks[-1] == sample.stop_reason:
        toks, lps = toks[:-1], lps[:-1]
    strings = []
    for t in toks:
        try:
            strings.append(tokenizer.decode([t]))
        except Exception:  # noqa: BLE001 - an id the tokenizer lacks
            strings.append("")
    n = len(toks)
    tops = [None] * n if sample.top_logprob_ids is None else \
        [None if ids is None else list(zip(ids, vals)) for ids, vals in
         zip(sample.top_logprob_ids[:n], sample.top_logprobs[:n])]
    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(token_bytes(tokenizer, t)),
                             "top_logprobs": [{"token": _decoded(tokenizer, i), "logprob": max(v, _MIN_LOGPROB),
                                               "bytes": list(token_bytes(tokenizer, i))} for i, v in top or []]}
                            for t, s, lp, top in zip(toks, strings, lps, tops)]}
    offsets, pos = [], 0
    for s in strings:
        offsets.append(pos)
        pos += len(s)
    top_dicts = []
    for s, lp, top in zip(strings, lps, tops):
        d = {s: lp}  # vLLM's layout: the sampled token, then the top entries (a string kept once, first value)
        for i, v in top or []:
            d.setdefault(_decoded(tokenizer, i), max(v, _MIN_LOGPROB))
        top_dicts.append(d)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": strings, "top_logprobs": top_dicts}


def _decoded(tokenizer: Any, t: int) -> str:
    try:
        return tokenizer.decode([t])
    except Exception:  # noqa: BLE001 - an id the tokenizer lacks
        return ""


# ---------------------------------------------------------------- responses

_RESPONSE_COLUMNS = ["sample_index", "custom_id", "batch_line", "endpoint", "request_model", "choice",
                     "num_prompt_tokens", "num_tokens", "error"]


def write_responses(output_path: str, jsonl_path: str) -> int:
    """Write the response JSONL of a finished openai_batch job from its Parquet dataset: one
    line per request line, in input order (see the module docstring). Reads one unit file
    at a time; writes a temporary file and renames it. Returns the number of lines.

    Raises OutputError when output_path is not an openai_batch job's output or has units
    missing (the job has not finished), or the JSONL cannot be written.
    """
    od = OutputDir(output_path)
    m = od.read_manifest()
    if m is None:
        raise OutputError(f"{od.shown}: not a batchgen output directory (no manifest)")
    if (m.get("spec") or {}).get("input", {}).get("format") != "openai_batch":
        raise OutputError(f"{od.shown}: not the output of an openai_batch job")
    missing = sorted({u["index"] for u in m["units"]} - od.committed_units())
    if missing:
        raise JobError(f"{od.shown}: {len(missing)} of {len(m['units'])} units are not committed yet; rerun the job "
                       f"to finish it before writing responses")
    ctx = {"fingerprint": m["fingerprint"], "model": (m.get("spec") or {}).get("model", {}).get("path"),
           "created": calendar.timegm(time.strptime(m["created"], "%Y-%m-%dT%H:%M:%SZ")),
           "file": m["files"][0]["name"]}
    fs, target = resolve_output(jsonl_path)
    parent = target.rsplit("/", 1)[0] if "/" in target else ""
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{target.rsplit('/', 1)[-1]}" if parent else f".tmp-{uuid.uuid4().hex}"
    n = 0
    try:
        if parent:
            fs.create_dir(parent, recursive=True)
        with fs.open_output_stream(tmp) as f:
            for u in sorted(m["units"], key=lambda u: u["index"]):
                rows = od.read_part(u["index"], _RESPONSE_COLUMNS).to_pylist()
                i = 0
                while i < len(rows):
                    j = i
                    while j < len(rows) and rows[j]["batch_line"] == rows[i]["batch_line"]:
                        j += 1
                    f.write(pydantic_core.to_json(_response(rows[i:j], ctx)) + b"\n")
                    n += 1
                    i = j
        if isinstance(fs, pafs.LocalFileSystem):
            os.replace(tmp, target)
        else:
            fs.move(tmp, target)
    except (OSError, pa.ArrowException) as e:
        try:
            fs.delete_file(tmp)
        except Exception:  # noqa: BLE001
            pass
        raise OutputError(f"{uri.redact(jsonl_path)}: cannot write the responses: {e}") from None
    return n


# "<file> line <n>: body.<param>: ..." (jobs/inputs/openai_batch.py's messages): the body field
# an error names, the OpenAI error's `param`
_PARAM = re.compile(r" line \d+: body\.([A-Za-z_][A-Za-z0-9_]*)")
# the engine's refusals of a prompt (engine.Engine._check_prompt: "prompt has N tokens, more
# than the context window ...", "prompt token i is ...", "empty prompt ..."): the line's
# messages (chat) or prompt (completions) is the field they are about
_ENGINE_PROMPT_ERROR = re.compile(r"empty prompt|prompt ")


def _response(rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
    """One response line from the output rows of one request, with vLLM's keys in vLLM's order
    (BatchRequestOutput, BatchResponseData, ChatCompletionResponse / CompletionResponse,
    UsageInfo, ErrorResponse)."""
    r0 = rows[0]
    h = hashlib.sha256(f"{ctx['fingerprint']}:{r0['batch_line']}".encode()).hexdigest()[:24]
    rid, request_id = f"batch_req_{h}", f"req_{h}"
    error = next((r["error"] for r in rows if r["error"]), None)
    if error is not None or any(r["choice"] is None for r in rows):
        message = error or "no choice was generated"
        where = f"{ctx['file']} line {r0['batch_line']}: "
        if not message.startswith(where):  # the engine's: it knows no file, line nor field
            field = "messages" if r0["endpoint"] == CHAT_URL else "prompt"
            message = where + (f"body.{field}: " if _ENGINE_PROMPT_ERROR.match(message) else "") + message
        param = _PARAM.search(message)
        return {"id": rid, "custom_id": r0["custom_id"],
                "response": {"status_code": 400, "request_id": request_id, "body": None},
                "error": {"error": {"message": message, "type": "BadRequestError",
                                    "param": param.group(1) if param else None, "code": 400}}}
    chat = r0["endpoint"] == CHAT_URL
    choices = [json.loads(r["choice"]) for r in sorted(rows, key=lambda r: r["sample_index"])]
    prompt_tokens = int(r0["num_prompt_tokens"] or 0)
    completion_tokens = sum(int(r["num_tokens"] or 0) for r in rows)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else "text_completion",
            "created": ctx["created"], "model": r0["request_model"] or ctx["model"], "choices": choices,
            "service_tier": None, "system_fingerprint": f"batchgen-{ctx['fingerprint'][:16]}",
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                      "completion_tokens": completion_tokens, "prompt_tokens_details": None}}
    return {"id": rid, "custom_id": r0["custom_id"],
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
