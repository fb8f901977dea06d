"""The response side of OpenAI Batch files (`input.format: openai_batch`, `batchgen run-batch`).

The request side (the line parser, units by byte range) is jobs/inputs/openai_batch.py.

Per output row (`sample_columns`, called by the worker that writes the unit, which has the
tokenizer for per-token text and bytes): the request's fields and the sample as an OpenAI
`choice` object, JSON text in the `choice` column (jobs.outputs.schema.BATCH_FIELDS).

The response file (`write_responses`): one line per request line, in input order, from the
job's Parquet dataset once every unit is in:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "req_...",
     "body": {"id": "chatcmpl-...", "object": "chat.completion", "created": ..., "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "logprobs": ...,
                           "finish_reason": "stop", "stop_reason": "<|im_end|>"}, ...],
              "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}}},
     "error": null}
    {"id": "batch_req_...", "custom_id": "bad", "response": {"status_code": 400, "request_id": "req_...",
     "body": null}, "error": {"object": "error", "message": "...", "type": "BadRequestError", "param": null,
     "code": 400}}

Ids are derived from the job's fingerprint and the line number, and `created` is the job's
start (its manifest), so the file written after a resumed run equals the file of an
uninterrupted one. usage.completion_tokens counts every generated token, the kept stop token
included (as vLLM counts them); a chat choice's logprobs cover the tokens of its content and
a stop string, not the stop token.
"""
from __future__ import annotations

import calendar
import hashlib
import json
import os
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from engine.tokenizers.stop_strings import token_bytes
from jobs.errors import JobError, OutputError
from jobs.outputs.commit import resolve_output
from jobs.outputs.output_dir import OutputDir
from jobs.outputs.schema import CHAT_URL


def sample_columns(req: Any, sample: Any, text: str | None, tokenizer: Any) -> dict[str, Any]:
    """The BATCH_FIELDS values of one output row: the request's fields (`req`, a
    cluster.unit.UnitRequest read by jobs/inputs/openai_batch.py), and the sample as an OpenAI
    choice object (JSON text) unless the row is an error."""
    p = req.passthrough
    cols = {"custom_id": p.get("custom_id"), "batch_line": p.get("batch_line"), "endpoint": p.get("endpoint"),
            "request_model": p.get("request_model"), "choice": None}
    if sample.finish_reason == "error" or sample.error is not None:
        return cols
    chat = p.get("_kind") == "chat"
    choice: dict[str, Any] = {"index": sample.sample_index}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = _logprobs(sample, tokenizer, chat) if p.get("_logprobs") else None
    choice["finish_reason"] = sample.finish_reason
    reason = sample.stop_reason
    if isinstance(reason, int) and tokenizer is not None:
        try:
            reason = tokenizer.decode([reason])
        except Exception:  # noqa: BLE001 - keep the id
            pass
    choice["stop_reason"] = reason
    cols["choice"] = json.dumps(choice, ensure_ascii=False)
    return cols


def _logprobs(sample: Any, tokenizer: Any, chat: bool) -> dict[str, Any]:
    """OpenAI logprobs of a choice: every generated token but a terminal stop token."""
    toks, lps = list(sample.tokens), list(sample.logprobs)
    if isinstance(sample.stop_reason, int) and toks and toks[-1] == sample.stop_reason:
        toks, lps = toks[:-1], lps[:-1]
    strings = []
    for t in toks:
        try:
            strings.append(tokenizer.decode([t]))
        except Exception:  # noqa: BLE001 - an id the tokenizer lacks
            strings.append("")
    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(token_bytes(tokenizer, t)), "top_logprobs": []}
                            for t, s, lp in zip(toks, strings, lps)]}
    offsets, pos = [], 0
    for s in strings:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": [{s: lp} for s, lp in zip(strings, lps)],
            "text_offset": offsets}


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
        raise OutputError(f"{od.path}: not a batchgen output directory (no manifest)")
    if (m.get("spec") or {}).get("input", {}).get("format") != "openai_batch":
        raise OutputError(f"{od.path}: not the output of an openai_batch job")
    missing = sorted({u["index"] for u in m["units"]} - od.committed_units())
    if missing:
        raise JobError(f"{od.path}: {len(missing)} of {len(m['units'])} units are not committed yet; rerun the job "
                       f"to finish it before writing responses")
    ctx = {"fingerprint": m["fingerprint"], "model": (m.get("spec") or {}).get("model", {}).get("path"),
           "created": calendar.timegm(time.strptime(m["created"], "%Y-%m-%dT%H:%M:%SZ"))}
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
                    f.write((json.dumps(_response(rows[i:j], ctx), ensure_ascii=False) + "\n").encode("utf-8"))
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
        raise OutputError(f"{jsonl_path}: cannot write the responses: {e}") from None
    return n


def _response(rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
    """One response line from the output rows of one request."""
    r0 = rows[0]
    h = hashlib.sha256(f"{ctx['fingerprint']}:{r0['batch_line']}".encode()).hexdigest()[:24]
    rid, request_id = f"batch_req_{h}", f"req_{h}"
    error = next((r["error"] for r in rows if r["error"]), None)
    if error is not None or any(r["choice"] is None for r in rows):
        return {"id": rid, "custom_id": r0["custom_id"],
                "response": {"status_code": 400, "request_id": request_id, "body": None},
                "error": {"object": "error", "message": error or "no choice was generated", "type": "BadRequestError",
                          "param": None, "code": 400}}
    chat = r0["endpoint"] == CHAT_URL
    choices = [json.loads(r["choice"]) for r in sorted(rows, key=lambda r: r["sample_index"])]
    prompt_tokens = int(r0["num_prompt_tokens"] or 0)
    completion_tokens = sum(int(r["num_tokens"] or 0) for r in rows)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else "text_completion",
            "created": ctx["created"], "model": r0["request_model"] or ctx["model"], "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": f"batchgen-{ctx['fingerprint'][:16]}"}
    return {"id": rid, "custom_id": r0["custom_id"],
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
