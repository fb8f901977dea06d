"""OpenAI Batch files (`input.format: openai_batch`, `batchgen run-batch`), as vLLM's run-batch
reads and writes them.

Input: a JSONL file, one request per line (blank lines are skipped):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "max_completion_tokens": 64,
              "temperature": 0.7, "n": 2, "stop": ["\\n\\n"], "logprobs": true}}

`url` is /v1/chat/completions (`messages`, rendered with the model's chat template) or
/v1/completions (`prompt`: a string, or token ids). The body's sampling parameters
override the job's `sampling` for that line: max_completion_tokens / max_tokens, temperature,
top_p, n, seed, stop, and vLLM's extras top_k (-1 or 0: off), min_p, stop_token_ids and
ignore_eos. logprobs (chat: true; completions: 0) asks for the sampled tokens' logprobs in
the response. Everything else that would change the answer (top_logprobs > 0, completions
logprobs > 0, penalties, logit_bias, tools, response_format, stream, echo, best_of, ...) is
refused, for that line only: a malformed line, a bad value or an unsupported parameter
becomes an error line (status_code 400) naming the line and the field, and the others run.
`custom_id` is the request's prompt_id (it keys the sampling noise, so a request's samples do
not depend on its position in the file); a custom_id used twice makes the later line an error.

Durable store: the job is an ordinary batchgen job over the JSONL file. The planner reads
the file once (line offsets, the expected rows of each unit, a sha256 for the fingerprint);
each unit is a run of consecutive lines that its worker reads by byte range. The Parquet
dataset in output.path is what survives a crash; reruns resume it. Its rows carry the
request's custom_id, line, endpoint and model, and each sample's OpenAI `choice` object
(rendered by the worker, which has the tokenizer for per-token text and bytes).

Output (`write_responses`): one line per request line, in input order, from the dataset:

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
import dataclasses
import hashlib
import io
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from cluster.unit import UnitRequest, WorkUnit
from engine.params import SamplingParams, check_sampling_value
from engine.stop_strings import token_bytes
from jobs.errors import InputError, JobError, OutputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}

BATCH_FIELDS = [
    pa.field("custom_id", pa.string()),
    pa.field("batch_line", pa.int64()),
    pa.field("endpoint", pa.string()),
    pa.field("request_model", pa.string()),
    pa.field("choice", pa.string()),
]
"""The columns an openai_batch job adds to every output row: the request's custom_id, its
1-based line in the JSONL file, its url, the body's model, and the sample as an OpenAI
choice object (JSON text; null for error rows)."""

# body parameter -> SamplingParams field
_PARAMS = {"n": "num_samples", "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
           "top_k": "top_k", "min_p": "min_p", "stop_token_ids": "stop_token_ids"}
# accepted and not used: they do not change the answer
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options"}
# accepted only at their default (value, or a test); anything else is refused
_DEFAULT_ONLY = {
    "stream": lambda v: v is None or v is False,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "repetition_penalty": lambda v: v is None or v == 1,
    "logit_bias": lambda v: not v,
    "top_logprobs": lambda v: v is None or v == 0,
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None,
}
_KEYS = {
    "chat": set(_PARAMS) | _IGNORED | set(_DEFAULT_ONLY) - {"echo", "suffix"}
    | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "ignore_eos"},
    "completion": set(_PARAMS) | _IGNORED | set(_DEFAULT_ONLY) - {"top_logprobs"}
    | {"prompt", "max_tokens", "logprobs", "ignore_eos", "best_of"},
}


@dataclass(slots=True)
class ParsedLine:
    """One request line, checked without a tokenizer. error: why the line gets a 400 (None if
    it runs); params: its SamplingParams (None with an error); prompt: the messages (chat)
    or the prompt text / token ids (completion)."""

    line: int
    custom_id: str | None = None
    url: str | None = None
    kind: str | None = None
    model: str | None = None
    prompt: Any = None
    params: SamplingParams | None = None
    logprobs: bool = False
    error: str | None = None


def parse_line(raw: bytes, lineno: int, base: SamplingParams, where: str) -> ParsedLine:
    """Check one JSONL line against the batch format; `base` holds the job's sampling values
    for what the body leaves out. Never raises: a problem is ParsedLine.error, which names
    `where`, the line and the field."""
    out = ParsedLine(line=lineno)

    def fail(msg: str) -> ParsedLine:
        out.error, out.params = f"{where} line {lineno}: {msg}", None
        return out

    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return fail(f"not valid JSON: {e}")
    if not isinstance(obj, dict):
        return fail(f"expected a JSON object with custom_id, method, url and body, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    out.custom_id = cid if isinstance(cid, str) and cid else None
    url = obj.get("url")
    out.url = url if isinstance(url, str) else None
    body = obj.get("body")
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        out.model = body["model"]
    for key in obj:
        if key not in ("custom_id", "method", "url", "body"):
            return fail(f"unknown key {key!r} (a request line has custom_id, method, url and body)")
    if out.custom_id is None:
        return fail(f"custom_id: must be a non-empty string, got {cid!r}")
    if obj.get("method") != "POST":
        return fail(f"method: must be \"POST\", got {obj.get('method')!r}")
    kind = URLS.get(url) if isinstance(url, str) else None
    if kind is None:
        return fail(f"url: {url!r} is not supported (batchgen answers {CHAT_URL} and {COMPLETIONS_URL})")
    out.kind = kind
    if not isinstance(body, dict):
        return fail(f"body: must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key not in _KEYS[kind]:
            return fail(f"body.{key}: not supported by batchgen for {url}")
        if key in _DEFAULT_ONLY and not _DEFAULT_ONLY[key](value):
            return fail(f"body.{key}: {value!r} is not supported (batchgen does not compute it)")
    if kind == "completion" and body.get("best_of") not in (None, body.get("n", 1)):
        return fail(f"body.best_of: {body['best_of']!r} is not supported (only best_of = n)")
    # the prompt
    if kind == "chat":
        messages, why = _messages(body.get("messages"))
        if why:
            return fail(f"body.messages: {why}")
        out.prompt = messages
    else:
        prompt, why = _completion_prompt(body.get("prompt"))
        if why:
            return fail(f"body.prompt: {why}")
        out.prompt = prompt
    # logprobs
    lp = body.get("logprobs")
    if kind == "chat":
        if lp is not None and not isinstance(lp, bool):
            return fail(f"body.logprobs: must be true or false, got {lp!r}")
        out.logprobs = bool(lp)
    elif lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, int) or lp < 0:
            return fail(f"body.logprobs: must be an integer >= 0, got {lp!r}")
        if lp > 0:
            return fail(f"body.logprobs: {lp} asks for the {lp} most likely alternatives per token, which batchgen "
                        f"does not compute; 0 returns the sampled tokens' logprobs")
        out.logprobs = True
    # sampling parameters
    changes: dict[str, Any] = {}
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    items = [(max_key, "max_tokens", body.get(max_key))] + [(k, f, body.get(k)) for k, f in _PARAMS.items()]
    for key, name, value in items:
        if value is None:
            continue
        if name == "top_k" and value == -1:  # vLLM's "off"
            value = 0
        try:
            changes[name] = check_sampling_value(name, value)
        except ValueError as e:
            return fail(f"body.{key}: {e}")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        return fail(f"body.ignore_eos: must be true or false, got {ignore_eos!r}")
    if ignore_eos and "stop_token_ids" not in changes:
        changes["stop_token_ids"] = ()
    out.params = dataclasses.replace(base, **changes) if changes else base
    return out


def _messages(value: Any) -> tuple[list[dict] | None, str | None]:
    """OpenAI messages -> [{role, content}] with string contents (text parts joined by newlines,
    as vLLM joins them); (None, why) for a structure batchgen cannot render."""
    if not isinstance(value, list) or not value:
        return None, f"must be a non-empty list of messages, got {value!r}"[:200]
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return None, f"message {i} is not an object"
        for key in m:
            if key not in ("role", "content"):
                return None, f"message {i}: {key!r} is not supported (role and text content only)"
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    return None, f"message {i} content part {j}: type {kind!r} is not supported (text only)"
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append({"role": m.get("role"), "content": content})
    from jobs.task import check_messages

    why = check_messages(out)
    return (None, why) if why else (out, None)


def _completion_prompt(value: Any) -> tuple[Any, str | None]:
    """A completions prompt -> a string or a list of token ids; one prompt per line."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return (value, None) if value else (None, "is an empty string")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            return None, "token ids must be >= 0"
        return value, None
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        return None, f"holds {len(value)} prompts; batchgen takes one prompt per request line"
    return None, f"must be a non-empty string or a list of token ids, got {value!r}"[:200]


# ---------------------------------------------------------------- planning

@dataclass
class BatchPlan:
    """Where each unit's lines are: ranges[unit index] = (first byte, end byte, first line
    number); duplicates[line] = the earlier line that holds the same custom_id."""

    name: str
    ranges: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    duplicates: dict[int, int] = field(default_factory=dict)


def _iter_lines(stream: Any, first_line: int = 1, offset: int = 0, hasher: Any = None,
                chunk: int = 1 << 20) -> Iterator[tuple[int, int, int, bytes]]:
    """(start byte, end byte, line number, line without its newline) for every line of a
    binary stream, read in chunks."""
    buf, lineno = b"", first_line
    while True:
        data = stream.read(chunk)
        if hasher is not None and data:
            hasher.update(data)
        if not data:
            break
        buf += data
        parts = buf.split(b"\n")
        buf = parts.pop()
        for part in parts:
            end = offset + len(part) + 1
            yield offset, end, lineno, part.rstrip(b"\r")
            offset, lineno = end, lineno + 1
    if buf:
        yield offset, offset + len(buf), lineno, buf.rstrip(b"\r")


def plan_batch(spec: Any) -> Any:
    """The JobPlan of an openai_batch job: reads the JSONL file once. Raises InputError for a
    file that is missing, not a file, or holds no request line."""
    from jobs.inputs.parquet import FINGERPRINT_VERSION, InputFile, JobPlan, fingerprint_of, resolve

    path = spec.input.path
    fs, p, source = resolve(path)
    try:
        info = fs.get_file_info(p)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input.path {path}: cannot access: {e}") from None
    if info.type == pafs.FileType.NotFound:
        raise InputError(f"input.path {path}: no such file")
    if info.type != pafs.FileType.File:
        raise InputError(f"input.path {path}: input.format openai_batch needs one JSONL file, not a directory")
    name = p.rsplit("/", 1)[-1]
    base = spec.sampling_params()
    bp = BatchPlan(name=name)
    owners: dict[str, int] = {}
    units: list[WorkUnit] = []
    expected: dict[int, int] = {}
    step = spec.cluster.unit_rows
    sha = hashlib.sha256()
    count = 0
    cur: list[Any] | None = None  # [first byte, end byte, first line, rows, output rows]

    def close() -> None:
        if cur is not None:
            index = len(units)
            units.append(WorkUnit(index=index, source=source, row_start=count - cur[3], row_end=count))
            bp.ranges[index] = (cur[0], cur[1], cur[2])
            expected[index] = cur[4]

    try:
        with fs.open_input_stream(p) as f:
            for start, end, lineno, raw in _iter_lines(f, hasher=sha):
                if not raw.strip():
                    continue
                parsed = parse_line(raw, lineno, base, name)
                if parsed.custom_id is not None:
                    if parsed.custom_id in owners:
                        bp.duplicates[lineno] = owners[parsed.custom_id]
                    else:
                        owners[parsed.custom_id] = lineno
                rows = 1 if parsed.error or lineno in bp.duplicates else parsed.params.num_samples
                if cur is None or cur[3] == step:
                    close()
                    cur = [start, end, lineno, 0, 0]
                cur[1] = end
                cur[3] += 1
                cur[4] += rows
                count += 1
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input.path {path}: cannot read: {e}") from None
    close()
    if not units:
        raise InputError(f"input.path {path}: no request lines (an OpenAI batch file has one JSON request a line)")
    data = {"version": FINGERPRINT_VERSION, **spec.fingerprint_dict()}
    data["input"] = {**data["input"], "files": [[name, int(info.size or 0), count, sha.hexdigest()]]}
    files = [InputFile(path=source, name=name, size=int(info.size or 0), num_rows=count, schema=pa.schema([]))]
    root = p.rsplit("/", 1)[0] if "/" in p else ""
    return JobPlan(units=units, files=files, fingerprint=fingerprint_of(data), num_prompts=count, root=root,
                   fingerprint_data=data, passthrough_fields=list(BATCH_FIELDS), expected_rows=expected, batch=bp)


# ---------------------------------------------------------------- workers

def read_unit(task: Any, unit: WorkUnit, tokenizer: Any) -> list[UnitRequest]:
    """The unit's request lines as UnitRequests (JobTask.read_unit for openai_batch)."""
    from jobs.inputs.parquet import open_input
    from jobs.task import text_bos

    bp: BatchPlan = task.batch
    start, end, first_line = bp.ranges[unit.index]
    with open_input(unit.source) as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise RuntimeError(f"{bp.name}: bytes {start}..{end} of unit {unit.index} could not be read (was the input "
                           f"file changed after the job started?)")
    bos = text_bos(tokenizer)
    vocab = getattr(tokenizer, "vocab_size", None)
    out: list[UnitRequest] = []
    for _, _, lineno, raw in _iter_lines(io.BytesIO(data), first_line=first_line, offset=start):
        if not raw.strip():
            continue
        parsed = parse_line(raw, lineno, task.params, bp.name)
        error = parsed.error
        if error is None and lineno in bp.duplicates:
            error = (f"{bp.name} line {lineno}: custom_id: {parsed.custom_id!r} is also the custom_id of line "
                     f"{bp.duplicates[lineno]} (custom_ids must be unique)")
        owner = parsed.custom_id is not None and lineno not in bp.duplicates
        pid = parsed.custom_id if owner else f"{bp.name}:{lineno}"
        params = parsed.params if error is None else dataclasses.replace(task.params, num_samples=1)
        tokens = None
        if error is None:
            if parsed.kind == "chat":
                tokens, why = task._tokenize(parsed.prompt, tokenizer, None, vocab, fmt="chat")
            elif isinstance(parsed.prompt, str):
                tokens, why = task._tokenize(parsed.prompt, tokenizer, bos, vocab, fmt="text")
            else:
                tokens, why = task._tokenize(parsed.prompt, tokenizer, None, vocab, fmt="tokens")
            if why is not None:
                error = f"{bp.name} line {lineno}: body.{'messages' if parsed.kind == 'chat' else 'prompt'}: {why}"
                tokens = None
        out.append(UnitRequest(prompt_id=pid, prompt_tokens=tokens, error=error, params=params, passthrough={
            "custom_id": parsed.custom_id, "batch_line": lineno, "endpoint": parsed.url,
            "request_model": parsed.model, "_kind": parsed.kind, "_logprobs": parsed.logprobs}))
    if len(out) != unit.num_rows:
        raise RuntimeError(f"{bp.name}: unit {unit.index} holds {len(out)} request lines, expected {unit.num_rows} "
                           f"(was the input file changed after the job started?)")
    return out


def sample_columns(req: UnitRequest, sample: Any, text: str | None, tokenizer: Any) -> dict[str, Any]:
    """The BATCH_FIELDS values of one output row: the request's fields, and the sample as an
    OpenAI choice object (JSON text) unless the row is an error."""
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
    from jobs.outputs.output_dir import OutputDir, resolve_output

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
