"""The OpenAI batch input reader (`input.format: openai_batch`, `batchgen run-batch`), as
vLLM's run-batch reads request files.

Input: a JSONL file, one request per line (blank lines are skipped):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "max_completion_tokens": 64,
              "temperature": 0.7, "n": 2, "stop": ["\\n\\n"], "logprobs": true}}

`url` is /v1/chat/completions (`messages`, rendered with the model's chat template) or
/v1/completions (`prompt`: a string, or token ids). The body's sampling parameters
override the job's `sampling` for that line: max_completion_tokens / max_tokens, temperature,
top_p, n, seed, stop, and vLLM's extras top_k (-1 or 0: off), min_p, stop_token_ids and
ignore_eos. A line without max_tokens gets the job's sampling.max_tokens if the job sets one,
else (the default for this format) a chat line generates until the context window ends it and
a completions line gets 16 tokens, as the OpenAI API and vLLM do. logprobs (chat: true;
completions: 0) asks for the sampled tokens' logprobs in the response, chat top_logprobs k
(with logprobs true) or completions logprobs k (1..20) for the k most likely tokens at each
position too (SamplingParams.top_logprobs); skip_special_tokens
false keeps special tokens in its content. A chat message reaches the chat template with its
role, content, name, tool_calls (arguments parsed into objects) and tool_call_id, as vLLM
passes them. Everything else that would change the answer (penalties, logit_bias, tools, response_format, stream, echo, best_of, ...:
_DEFAULT_ONLY and _FEATURES) is refused, for that line only: a malformed line (a string
holding a lone UTF-16 surrogate included), a bad value or an unsupported parameter becomes an
error line (status_code 400) naming the line and the field, and the others run. Keys batchgen
does not know, in the body or in a message, are ignored with a warning naming them (as vLLM
does), not refused.
`custom_id` is the request's prompt_id (it keys the sampling noise, so a request's samples do
not depend on its position in the file); a custom_id used twice makes the later line an error.
A line without a usable custom_id, and such a repeat, has the prompt id "<file>:<line>", or
"<file>:<line>#1" (#2, ...) where another line's custom_id already is that text, so that no
two rows share a prompt id (BatchPlan.fallback_ids).

Durable store: the job is an ordinary batchgen job over the JSONL file. The scan reads the
file once (line offsets, the expected rows of each unit, a sha256 for the fingerprint);
each unit is a run of consecutive lines that its worker reads by byte range. The Parquet
dataset in output.path is what survives a crash; reruns resume it. Its rows carry the
request's custom_id, line, endpoint and model, and each sample's OpenAI `choice` object
(jobs.outputs.schema.BATCH_FIELDS); the response file is written from it by
jobs/outputs/batch_responses.py.

The fingerprint of an openai_batch job covers the file's sha256 but, unlike a Parquet job's,
not the checkpoint's content hashes (only its file names and sizes, as JobSpec's
model_identity): so it was planned from the start (InputScan.hash_checkpoint), and kept so
that existing outputs resume. The manifest keeps the hashes instead (JobPlan.checkpoint_sha256),
so a resume with retrained weights is refused all the same. The fingerprint also names the
layout of the stored choices (CHOICE_FORMAT).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

try:  # pydantic's JSON parser (a dependency of batchgen through pydantic): json.loads's values, twice as fast
    from pydantic_core import from_json as _from_json
except ImportError:  # pragma: no cover - pydantic 2 always has it
    _from_json = None

from cluster.unit import UnitRequest, WorkUnit
from engine.params import SamplingParams, check_sampling_value
from jobs import uri
from jobs.errors import InputError, shown
from jobs.inputs.prompts import check_messages, template_tool_calls, text_bos, tokenize
from jobs.inputs.reader import InputFile, InputScan, open_input, resolve
from jobs.outputs.schema import BATCH_FIELDS, CHAT_URL, COMPLETIONS_URL

log = logging.getLogger("batchgen")

URLS = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
# in the fingerprint: the layout of the `choice` objects the units store (2: vLLM's keys,
# stop_reason null for EOS, content without special tokens; 3: stop strings matched on that
# content, special tokens left out, as vLLM's skip_special_tokens does; 4: lines asking for top
# logprobs run and their choices carry them, where they were refused), so that a job begun
# by an earlier batchgen is not resumed into a mix of layouts
CHOICE_FORMAT = "choices-v4"
# max_tokens of a /v1/completions line that sets none, when the job sets no sampling.max_tokens
# (OpenAI's legacy completions default, which vLLM's CompletionRequest keeps); a chat line
# without one generates until the context window ends it.
COMPLETIONS_MAX_TOKENS = 16

# body parameter -> SamplingParams field
_PARAMS = {"n": "num_samples", "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
           "top_k": "top_k", "min_p": "min_p", "stop_token_ids": "stop_token_ids"}
# what batchgen reads from a body besides _PARAMS
_USED = {"chat": {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "ignore_eos",
                  "skip_special_tokens"},
         "completion": {"prompt", "max_tokens", "max_completion_tokens", "logprobs", "ignore_eos", "best_of",
                        "skip_special_tokens"}}
# accepted and not used: they do not change the answer
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "request_id", "priority",
            "cache_salt", "parallel_tool_calls", "spaces_between_special_tokens", "session_id"}


def _off(v: Any) -> bool:
    return not v


def _none(v: Any) -> bool:
    return v is None


# parameters of the OpenAI API or vLLM that change the answer in a way batchgen does not
# compute: accepted only at their default (this test), else the line is refused
_DEFAULT_ONLY_ANY = {
    "stream": lambda v: v is None or v is False,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "repetition_penalty": lambda v: v is None or v == 1,
    "length_penalty": lambda v: v is None or v == 1,
    "logit_bias": _off, "use_beam_search": _off, "include_stop_str_in_output": _off, "bad_words": _off,
    "return_tokens_as_token_ids": _off,
    "min_tokens": lambda v: v is None or v == 0,
    "echo": lambda v: v is None or v is False,
    "truncate_prompt_tokens": _none, "prompt_logprobs": _none, "allowed_token_ids": _none, "logprob_token_ids": _none,
    "thinking_token_budget": _none,
}
_DEFAULT_ONLY = {
    "chat": {**_DEFAULT_ONLY_ANY,
             "tool_choice": lambda v: v in (None, "none", "auto"),  # without tools: a text answer
             "function_call": lambda v: v in (None, "none", "auto"),
             "add_generation_prompt": lambda v: v is None or v is True,
             "continue_final_message": _off, "add_special_tokens": _off, "reasoning_effort": _none},
    "completion": {**_DEFAULT_ONLY_ANY,
                   "suffix": _none,
                   "add_special_tokens": lambda v: v is None or v is True},
}
# features batchgen does not have: refused when set (the test says which values are "unset")
_FEATURES = {
    "tools": _off, "functions": _off,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "structured_outputs": _none, "guided_json": _none, "guided_regex": _none, "guided_choice": _none,
    "guided_grammar": _none, "chat_template": _none, "chat_template_kwargs": _off, "documents": _none,
    "logits_processors": _off, "prompt_embeds": _none, "audio": _none, "prediction": _none,
    "web_search_options": _none, "modalities": lambda v: v is None or v == ["text"],
}
# message keys handed to the chat template (with role and content), as vLLM passes them
_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id")


@dataclass(slots=True)
class ParsedLine:
    """One request line, checked without a tokenizer. error: why the line gets a 400 (None if
    it runs); params: its SamplingParams (None with an error); prompt: the messages (chat)
    or the prompt text / token ids (completion); ignored: the keys it has that batchgen does
    not know ("body.x", "messages[].y"), ignored with a warning (BatchReader.scan)."""

    line: int
    custom_id: str | None = None
    url: str | None = None
    kind: str | None = None
    model: str | None = None
    prompt: Any = None
    params: SamplingParams | None = None
    logprobs: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    error: str | None = None
    ignored: list[str] = field(default_factory=list)
    num_samples: int = 0  # the line's n once the job's defaults apply (its output rows), 0 with an error


def parse_line(raw: bytes, lineno: int, base: SamplingParams, where: str, *, shapes: "LineShapes | None" = None,
               params: bool = True) -> ParsedLine:
    """Check one JSONL line against the batch format; `base` holds the job's sampling values
    for what the body leaves out. Never raises: a problem is ParsedLine.error, which names
    `where`, the line and the field. shapes: what the checks gave for earlier lines of the
    same shape (LineShapes(base), one per file read: the same answers, faster); params False:
    leave ParsedLine.params None (the scan needs num_samples only)."""
    out = ParsedLine(line=lineno)
    try:
        obj, clean = _decode(raw)
    except (ValueError, UnicodeDecodeError) as e:
        why: str | None = f"not valid JSON: {e}"
    except RecursionError:  # json's decoder recurses once per nested array or object
        why = "not valid JSON: nested too deeply"
    else:
        # json.loads decodes a line's surrogate bytes (surrogatepass), not only their escapes
        suspect = _SURROGATE_ESCAPE.search(raw) is not None or not (clean or raw.isascii())
        why = _lone_surrogate(obj) if suspect else None
        if why is not None:  # echo a custom_id that is text, so the error line can be matched
            cid = obj.get("custom_id") if isinstance(obj, dict) else None
            out.custom_id = cid if isinstance(cid, str) and cid and _is_text(cid) else None
        else:
            why = _parse_request(obj, out, base, shapes if shapes is not None and shapes.base is base else None,
                                 params)
    if why is not None:
        out.error, out.params, out.num_samples = f"{where} line {lineno}: {why}", None, 0
    return out


# json.loads(raw) for a line, by pydantic_core's parser (jiter) where it parses the line and by
# json otherwise. jiter refuses all that json refuses, and more (NaN and Infinity, a lone
# surrogate's escape, a UTF-8 BOM, UTF-16 text, nesting past 200, integers of over 4,300
# digits, encoded surrogates): json then decodes the line, or gives the error and its message,
# as before. Where both parse a line they give the same value (tests/test_openai_batch_plan.py).
# Only while Python's limit on integer digits is its default or above (jiter's is 4,300).
_JITER_DIGITS = 4300
_int_digits = getattr(sys, "get_int_max_str_digits", lambda: 0)  # Python before 3.10.7: no limit
_jiter = None
if _from_json is not None:
    try:  # strings but keys not cached (faster here); pydantic-core before 2.17 caches all
        _from_json(b"{}", cache_strings="keys")
        _jiter = functools.partial(_from_json, allow_inf_nan=False, cache_strings="keys")
    except TypeError:  # pragma: no cover
        _jiter = functools.partial(_from_json, allow_inf_nan=False)


def _decode(raw: bytes) -> tuple[Any, bool]:
    """(json.loads(raw), whether pydantic_core decoded it: then it holds no lone surrogate)."""
    if _jiter is not None:
        limit = _int_digits()
        if limit == 0 or limit >= _JITER_DIGITS:
            try:
                return _jiter(raw), True
            except Exception:  # noqa: BLE001 - json's verdict and message decide
                pass
    return json.loads(raw), False


# a \u escape of a UTF-16 surrogate (D800-DFFF): how a line of ASCII text decodes to a lone one.
# json.loads also decodes one from the bytes of a line that is not ASCII (it decodes them with
# surrogatepass: UTF-8's ED A0-BF xx, UTF-16's or UTF-32's surrogate code units), which
# pydantic_core refuses: such a line, decoded by json, is searched too (_decode)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(path: str) -> str:
    return path if len(path) <= 200 else path[:200] + "..."  # a field nested 900 deep


def _surrogate_in(s: str) -> str:
    ch = next(c for c in s if 0xD800 <= ord(c) <= 0xDFFF)
    return f"holds a lone UTF-16 surrogate (\\u{ord(ch):04x}), which is not Unicode text"


def _lone_surrogate(obj: Any) -> str | None:
    """Why a decoded line is refused for a string (a key or a value) holding a lone UTF-16
    surrogate, naming the first such field in the line's order; None if it has none. JSON's
    \\u escapes can spell one ("\\udc80"), but it is no Unicode text: pydantic (vLLM's reader)
    refuses the line, and here it could not be written as UTF-8 (a custom_id or model into the
    dataset ended the unit, a stop string's bytes the engine's step), so one line cost the job.
    Iterative: a line nests as deep as json's decoder allowed."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            key = next((k for k in value if not _is_text(k)), None)
            if key is not None:
                return f"{_shown(path) or 'the line'}: a key {_surrogate_in(key)}"
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, str) and not _is_text(value):
            return f"{_shown(path) or 'the line'}: {_surrogate_in(value)}"
    return None


def _parse_request(obj: Any, out: ParsedLine, base: SamplingParams, shapes: "LineShapes | None" = None,
                   params: bool = True) -> str | None:
    """Fill `out` from a decoded line; returns why the line is refused (None if it runs).
    `shapes`: the outcomes of the envelope's and the body's checks for earlier lines of the
    same shape (see LineShapes), used and filled; params False: out.params stays None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object with custom_id, method, url and body, got {type(obj).__name__}"
    cid = obj.get("custom_id")
    out.custom_id = cid if isinstance(cid, str) and cid else None
    url = obj.get("url")
    out.url = url if isinstance(url, str) else None
    body = obj.get("body")
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        out.model = body["model"]
    key = shapes.key(obj, out.custom_id, url, body) if shapes is not None else None
    shape = shapes.shapes.get(key) if key is not None else None
    if shape is None:
        why = _check_envelope(obj, out, cid, url, body)
        if key is not None:
            shape = shapes.put(key, _Shape(why, out.kind, tuple(out.ignored), seeded=_ANY_SEED in key))
    else:
        why, out.kind = shape.why, shape.kind
        out.ignored.extend(shape.ignored)
    if why is not None:
        return why
    kind = out.kind
    if kind == "chat":
        messages, why = _messages(body.get("messages"), out.ignored)
        if why:
            return f"body.messages: {why}"
        out.prompt = messages
    else:
        prompt, why = _completion_prompt(body.get("prompt"))
        if why:
            return f"body.prompt: {why}"
        out.prompt = prompt
    if shape is None:
        why, changes = _sampling_part(body, kind, base, out)
        if why is None:
            out.num_samples = changes.get("num_samples", base.num_samples)
            if params:
                out.params = dataclasses.replace(base, **changes) if changes else base
        return why
    if shape.sampling is None:  # the first line of this shape to get here
        why, changes = _sampling_part(body, kind, base, out)
        shape.sampling = (why, out.logprobs, out.skip_special_tokens, out.ignore_eos, changes)
    why, out.logprobs, out.skip_special_tokens, out.ignore_eos, changes = shape.sampling
    if why is None:
        out.num_samples = changes.get("num_samples", base.num_samples)
        if shape.seeded:  # the seed check_sampling_value gave back for this line: its own
            if params:
                out.params = dataclasses.replace(base, **{**changes, "seed": body["seed"]})
        elif params:
            if shape.params is None:
                shape.params = dataclasses.replace(base, **changes) if changes else base
            out.params = shape.params
    return why


def _sampling_part(body: dict, kind: str, base: SamplingParams, out: ParsedLine) -> tuple[str | None, dict]:
    """The checks of a body after its prompt (logprobs, sampling parameters, best_of,
    skip_special_tokens), setting out.logprobs, skip_special_tokens and ignore_eos as far as
    they get: (why the line is refused or None, the SamplingParams fields it sets). Reads the
    body only by body.get of a key in _RELEVANT (LineShapes' rule)."""
    out.logprobs, why = _logprobs_flag(kind, body.get("logprobs"))
    if why is not None:
        return why, {}
    changes, why = _sampling_changes(body, kind, base)
    if why is not None:
        return why, {}
    # top logprobs: chat's top_logprobs (with logprobs true), completions' logprobs k
    k = body.get("top_logprobs") if kind == "chat" else body.get("logprobs")
    if k is not None:
        if kind == "chat" and k == 0 and not isinstance(k, bool):
            k = 0  # chat's 0: none, with or without logprobs true
        else:
            key = "top_logprobs" if kind == "chat" else "logprobs"
            try:
                k = check_sampling_value("top_logprobs", k)
            except ValueError as e:
                return f"body.{key}: {e}", {}
            if kind == "chat" and not out.logprobs:
                return "body.top_logprobs: needs logprobs true (as the OpenAI API)", {}
        if k != base.top_logprobs:  # the line's own k, 0 included, over the job's sampling.top_logprobs
            changes["top_logprobs"] = k
    # best_of = n is plain sampling; compared with the line's n after its defaults (a null or
    # absent n is the job's sampling.num_samples), so "n": null, "best_of": 1 runs
    best_of, n = body.get("best_of"), changes.get("num_samples", base.num_samples)
    if kind == "completion" and best_of is not None and (isinstance(best_of, bool) or best_of != n):
        return f"body.best_of: {shown(best_of)} is not supported (only best_of = n, here {n})", {}
    skip = body.get("skip_special_tokens")
    if skip is not None and not isinstance(skip, bool):
        return f"body.skip_special_tokens: must be true or false, got {shown(skip)}", {}
    out.skip_special_tokens, out.ignore_eos = skip is not False, body.get("ignore_eos") is True
    if out.skip_special_tokens and changes.get("stop", base.stop):
        changes["skip_special_tokens"] = True  # stop strings matched on the content, as vLLM does
    return None, changes



# the body keys whose values the checks read, per kind (_check_envelope's tests, _sampling_part's
# body.get); of any other body key they read only the name and whether the value is null
_RELEVANT = {kind: frozenset(_FEATURES) | frozenset(_DEFAULT_ONLY[kind]) | frozenset(_PARAMS) | _USED[kind]
             for kind in _USED}
_PROMPT_KEY = {"chat": "messages", "completion": "prompt"}
_ENVELOPE = frozenset(("custom_id", "method", "url", "body"))
_UNKNOWN = object()  # a LineShapes key's mark of a key whose value is not read
_BIG = 1 << 64  # integers beyond: no shape (a key holds no 4,300-digit number)
# a seed check_sampling_value takes as it is (a 64-bit integer): lines that differ only there
# (a seed per line) share a shape, and each gets its own seed back (_Shape.seeded)
_ANY_SEED = object()
_SEED_MIN, _SEED_END = -(1 << 63), 1 << 63


@dataclass(slots=True, eq=False)
class _Shape:
    """What the checks gave for lines of one shape (LineShapes): the envelope's and body's
    verdict (why, kind, ignored keys) and, once a line of the shape got past its prompt,
    _sampling_part's (why, logprobs, skip_special_tokens, ignore_eos, changes) and the
    SamplingParams the changes make."""

    why: str | None
    kind: str | None
    ignored: tuple[str, ...]
    sampling: tuple | None = None
    params: SamplingParams | None = None
    seeded: bool = False  # the shape holds any valid seed: the changes' "seed" is the line's own


class LineShapes:
    """The outcomes of a line's checks but for its custom_id and prompt, kept for the lines of
    a file that share them: in a batch file most lines differ only there, and checking each
    line's body parameters again (and building its SamplingParams) was most of the scan.

    A line's shape is its url and its body without the prompt (messages or prompt): the value
    of each key the checks read (_RELEVANT: exact, its type included, a zero float by its hex
    so that -0.0 is not 0.0, a list as a tuple of strings and integers; of a seed only that it
    is a valid one, each line getting its own back), the name and nullness of every other key,
    in the body's order. Only lines with a usable custom_id, method
    "POST", no key but custom_id, method, url and body, a url batchgen answers and short
    values have one (LineShapes.key None: checked in full, every time); at most LIMIT shapes
    are kept (then forgotten all at once), each bounded by MAX_CHARS characters of text.
    `base`: the job's SamplingParams, the only base the outcomes hold for (parse_line ignores
    shapes made for another)."""

    LIMIT = 1024
    MAX_ITEMS = 64
    MAX_CHARS = 2048
    MAX_LIST = 32

    def __init__(self, base: SamplingParams) -> None:
        self.base = base
        self.shapes: dict[tuple, _Shape] = {}

    def put(self, key: tuple, shape: _Shape) -> _Shape:
        if len(self.shapes) >= self.LIMIT:
            self.shapes.clear()
        self.shapes[key] = shape
        return shape

    def key(self, obj: dict, custom_id: str | None, url: Any, body: Any) -> tuple | None:
        """The shape of a decoded line (see the class docstring), or None when it has none."""
        kind = URLS.get(url) if url.__class__ is str else None
        if (kind is None or custom_id is None or body.__class__ is not dict or len(body) > self.MAX_ITEMS
                or obj.get("method") != "POST" or not _ENVELOPE.issuperset(obj)):
            return None
        relevant, skip = _RELEVANT[kind], _PROMPT_KEY[kind]
        parts: list[Any] = [url]
        chars = 0
        for k, v in body.items():
            if k not in relevant:
                chars += len(k)
                parts += (k, _UNKNOWN, v is None)
                continue
            if k == skip:  # _check_envelope passes it by; _sampling_part does not read it
                continue
            t = v.__class__
            if t is int:
                if k == "seed" and _SEED_MIN <= v < _SEED_END:  # any valid seed: the line's own is put back
                    parts += (k, _ANY_SEED, None)
                    continue
                if not -_BIG <= v <= _BIG:
                    return None
            elif t is float:
                if not v:  # -0.0 == 0.0: told apart by their hex (other floats compare exactly)
                    v = v.hex()
            elif t is str:
                chars += len(v)
            elif t is list:
                if len(v) > self.MAX_LIST:
                    return None
                for x in v:
                    if x.__class__ is str:
                        chars += len(x)
                    elif x.__class__ is not int or not -_BIG <= x <= _BIG:
                        return None
                v = tuple(v)
            elif not (v is None or t is bool):
                return None  # objects: checked in full
            parts += (k, t, v)
        if chars > self.MAX_CHARS:
            return None
        return tuple(parts)


def _check_envelope(obj: dict, out: ParsedLine, cid: Any, url: Any, body: Any) -> str | None:
    """The line's keys, custom_id, method, url (sets out.kind) and the body's keys; returns
    why the line is refused, or None."""
    for key in obj:
        if key not in ("custom_id", "method", "url", "body"):
            return f"unknown key {shown(key)} (a request line has custom_id, method, url and body)"
    if out.custom_id is None:
        return f"custom_id: must be a non-empty string, got {shown(cid)}"
    if obj.get("method") != "POST":
        return f"method: must be \"POST\", got {shown(obj.get('method'))}"
    kind = URLS.get(url) if isinstance(url, str) else None
    if kind is None:
        return f"url: {shown(url)} is not supported (batchgen answers {CHAT_URL} and {COMPLETIONS_URL})"
    out.kind = kind
    if not isinstance(body, dict):
        return f"body: must be a JSON object, got {type(body).__name__}"
    default_only = _DEFAULT_ONLY[kind]
    for key, value in body.items():
        if value is None:  # null is the parameter's default, as in the OpenAI API and vLLM
            continue
        if key in _FEATURES:
            if not _FEATURES[key](value):
                return f"body.{key}: not supported by batchgen for {url}"
        elif key in default_only:
            if not default_only[key](value):
                return f"body.{key}: {shown(value)} is not supported (batchgen does not compute it)"
        elif key not in _PARAMS and key not in _USED[kind] and key not in _IGNORED:
            out.ignored.append(f"body.{key}")
    return None


def _logprobs_flag(kind: str, lp: Any) -> tuple[bool, str | None]:
    """Whether the line asks for the sampled tokens' logprobs, or (False, why refused)."""
    if kind == "chat":
        if lp is not None and not isinstance(lp, bool):
            return False, f"body.logprobs: must be true or false, got {shown(lp)}"
        return bool(lp), None
    if lp is None:
        return False, None
    if isinstance(lp, bool) or not isinstance(lp, int) or lp < 0:
        return False, f"body.logprobs: must be an integer >= 0, got {shown(lp)}"
    return True, None  # k > 0: also the k most likely tokens per position (_sampling_part)


def _sampling_changes(body: dict, kind: str, base: SamplingParams) -> tuple[dict[str, Any], str | None]:
    """The SamplingParams fields the body sets (checked by the engine's rules), or ({}, why).

    A line without max_tokens keeps the job's sampling.max_tokens when the job sets one; else
    (base.max_tokens None) a chat line generates until the context window ends it and a
    completions line gets COMPLETIONS_MAX_TOKENS, the defaults of the OpenAI API and vLLM."""
    changes: dict[str, Any] = {}
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(max_key) is None and base.max_tokens is None and kind == "completion":
        changes["max_tokens"] = COMPLETIONS_MAX_TOKENS
    items = [(max_key, "max_tokens", body.get(max_key))] + [(k, f, body.get(k)) for k, f in _PARAMS.items()]
    for key, name, value in items:
        if value is None:
            continue
        if name == "top_k" and value == -1:  # vLLM's "off"
            value = 0
        try:
            changes[name] = check_sampling_value(name, value)
        except ValueError as e:
            return {}, f"body.{key}: {e}"
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        return {}, f"body.ignore_eos: must be true or false, got {shown(ignore_eos)}"
    if ignore_eos and "stop_token_ids" not in changes:
        changes["stop_token_ids"] = ()
    return changes, None


def _messages(value: Any, ignored: list[str]) -> tuple[list[dict] | None, str | None]:
    """OpenAI messages -> the messages the chat template gets, or (None, why) for a structure
    batchgen cannot render. As vLLM hands them to a template: role and content (text parts
    joined by newlines; null content of an assistant message that calls tools as ""), a
    message's name, an assistant's tool_calls (each function's JSON arguments parsed into an
    object, as transformers' templates expect) and a tool message's tool_call_id. Other
    message keys are ignored (appended to `ignored` as "messages[].key")."""
    if not isinstance(value, list) or not value:
        return None, f"must be a non-empty list of messages, got {value!r}"[:200]
    out = []
    plain = True  # every message only a non-empty role and a text content: check_messages passes them
    for i, m in enumerate(value):
        if m.__class__ is dict and len(m) == 2:  # the common message, as the loop below makes it
            role, content = m.get("role"), m.get("content")
            if role.__class__ is str and role and content.__class__ is str:
                out.append({"role": role, "content": content})
                continue
        plain = False
        if not isinstance(m, dict):
            return None, f"message {i} is not an object"
        role, content = m.get("role"), m.get("content")
        msg: dict[str, Any] = {"role": role}
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    return None, f"message {i} content part {j}: type {shown(kind)} is not supported (text only)"
                texts.append(part["text"])
            content = "\n".join(texts)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        msg["content"] = content
        for key, v in m.items():
            # null is an absent key (vLLM drops a null name or tool_calls), as a message copied
            # from an API response has ("tool_calls": null, "refusal": null, ...)
            if key in ("role", "content") or v is None:
                continue
            if key == "name" or (key == "tool_call_id" and role == "tool"):
                if not isinstance(v, str):
                    return None, f"message {i}: {key} must be a string, got {v!r}"[:200]
                msg[key] = v
            elif key == "tool_calls" and role == "assistant":
                calls, why = template_tool_calls(v)
                if why:
                    return None, f"message {i} {why}"
                msg[key] = calls
            else:
                ignored.append(f"messages[].{key}")
        out.append(msg)
    if plain:
        return out, None
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


# ---------------------------------------------------------------- units by byte range

@dataclass
class BatchPlan:
    """Where each unit's lines are: ranges[unit index] = (first byte, end byte, first line
    number); duplicates[line] = the earlier line that holds the same custom_id;
    fallback_ids[line] = the prompt id of a line that has none of its own (no usable
    custom_id, or a repeat) where the default "<file>:<line>" is another line's custom_id."""

    name: str
    ranges: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    duplicates: dict[int, int] = field(default_factory=dict)
    fallback_ids: dict[int, str] = field(default_factory=dict)

    def prompt_id(self, custom_id: str | None, line: int) -> str:
        """The prompt id of `line`: its custom_id if it is the first line to use it, else its
        fallback id (see fallback_ids)."""
        if custom_id is not None and line not in self.duplicates:
            return custom_id
        return self.fallback_ids.get(line, f"{self.name}:{line}")


def _iter_lines(stream: Any, first_line: int = 1, offset: int = 0, hasher: Any = None,
                chunk: int = 1 << 20) -> Iterator[tuple[int, int, int, bytes]]:
    """(start byte, end byte, line number, line without its newline) for every line of a
    binary stream, read in chunks. A line longer than a chunk is kept as its chunks and joined
    once, at its newline: adding each chunk to it and splitting it again was quadratic in its
    length (a 128 MiB line took 14 s)."""
    pending: list[bytes] = []  # the current line's bytes so far, one piece per chunk
    lineno = first_line
    while True:
        data = stream.read(chunk)
        if hasher is not None and data:
            hasher.update(data)
        if not data:
            break
        parts = data.split(b"\n")
        if len(parts) == 1:
            pending.append(data)
            continue
        parts[0] = b"".join(pending) + parts[0] if pending else parts[0]
        tail = parts.pop()
        pending = [tail] if tail else []
        for part in parts:
            end = offset + len(part) + 1
            yield offset, end, lineno, part.rstrip(b"\r")
            offset, lineno = end, lineno + 1
    buf = b"".join(pending)
    if buf:
        yield offset, offset + len(buf), lineno, buf.rstrip(b"\r")


class BatchReader:
    """The InputReader of OpenAI batch files (jobs/inputs/reader.py). state: the scan's
    BatchPlan (None before the scan: then it can only scan); chat_date: the day chat
    templates render at (model.chat_template_date)."""

    def __init__(self, state: BatchPlan | None = None, chat_date: str | None = None) -> None:
        self.state = state
        self.chat_date = chat_date

    def scan(self, spec: Any) -> InputScan:
        """Read the file once: its request lines, cut into units of cluster.unit_rows lines
        (by byte range), the output rows of each unit, and a sha256 for the fingerprint.
        Raises InputError for a file that is missing, not a file, or holds no request line."""
        path = spec.input.path
        fs, p, source = resolve(path)
        shown = uri.redact(path)  # no credentials written into the URI in messages
        try:
            info = fs.get_file_info(p)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input.path {shown}: cannot access: {e}") from None
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"input.path {shown}: no such file")
        if info.type != pafs.FileType.File:
            raise InputError(f"input.path {shown}: input.format openai_batch needs one JSONL file, not a directory")
        name = p.rsplit("/", 1)[-1]
        sha = hashlib.sha256()
        try:
            with fs.open_input_stream(p) as f:
                bp, units, expected, count, ignored = _cut_lines(f, sha, name, source, spec.sampling_params(),
                                                                 spec.cluster.unit_rows)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input.path {shown}: cannot read: {e}") from None
        if not units:
            raise InputError(f"input.path {shown}: no request lines (an OpenAI batch file has one JSON request a line)")
        files = [InputFile(path=source, name=name, size=int(info.size or 0), num_rows=count, schema=pa.schema([]))]
        warnings = []
        for key, (n, first) in ignored.items():
            where = f"line {first}" if n == 1 else f"{n} lines, first line {first}"
            warnings.append(f"{name}: {key} is not a parameter batchgen knows; ignored ({where})")
            log.warning("input file %s", warnings[-1])
        return InputScan(root=p.rsplit("/", 1)[0] if "/" in p else "", files=files, units=units,
                         fingerprint_files=[[name, int(info.size or 0), count, sha.hexdigest(), CHOICE_FORMAT]],
                         passthrough_fields=list(BATCH_FIELDS), expected_rows=expected, reader_state=bp,
                         hash_checkpoint=False, warnings=warnings)

    def read_unit(self, unit: WorkUnit, tokenizer: Any, params: Any) -> tuple[list[UnitRequest], int]:
        """The unit's request lines as UnitRequests (a bad line: an error request with one
        sample); no Parquet rows are decoded."""
        bp = self.state
        start, end, first_line = bp.ranges[unit.index]
        with open_input(unit.source) as f:
            f.seek(start)
            data = f.read(end - start)
        if len(data) != end - start:
            raise RuntimeError(f"{bp.name}: bytes {start}..{end} of unit {unit.index} could not be read (was the "
                               f"input file changed after the job started?)")
        bos = text_bos(tokenizer)
        vocab = getattr(tokenizer, "vocab_size", None)
        out: list[UnitRequest] = []
        shapes = LineShapes(params)
        for _, _, lineno, raw in _iter_lines(io.BytesIO(data), first_line=first_line, offset=start):
            if raw and not raw.isspace():  # raw.strip(): not only ASCII whitespace
                out.append(self._request(raw, lineno, params, tokenizer, bos, vocab, shapes))
        if len(out) != unit.num_rows:
            raise RuntimeError(f"{bp.name}: unit {unit.index} holds {len(out)} request lines, expected "
                               f"{unit.num_rows} (was the input file changed after the job started?)")
        return out, 0

    def _request(self, raw: bytes, lineno: int, params: Any, tokenizer: Any, bos: int | None,
                 vocab: int | None, shapes: LineShapes | None = None) -> UnitRequest:
        bp = self.state
        parsed = parse_line(raw, lineno, params, bp.name, shapes=shapes)
        error = parsed.error
        if error is None and lineno in bp.duplicates:
            error = (f"{bp.name} line {lineno}: custom_id: {shown(parsed.custom_id)} is also the custom_id of line "
                     f"{bp.duplicates[lineno]} (custom_ids must be unique)")
        pid = bp.prompt_id(parsed.custom_id, lineno)
        line_params = parsed.params if error is None else dataclasses.replace(params, num_samples=1)
        tokens = None
        if error is None:
            if parsed.kind == "chat":
                tokens, why = tokenize(parsed.prompt, "chat", tokenizer, None, vocab, self.chat_date,
                                       message_keys=_MESSAGE_KEYS)
            elif isinstance(parsed.prompt, str):
                tokens, why = tokenize(parsed.prompt, "text", tokenizer, bos, vocab)
            else:
                tokens, why = tokenize(parsed.prompt, "tokens", tokenizer, None, vocab)
            if why is not None:
                error = f"{bp.name} line {lineno}: body.{'messages' if parsed.kind == 'chat' else 'prompt'}: {why}"
                tokens = None
        return UnitRequest(prompt_id=pid, prompt_tokens=tokens, error=error, params=line_params, passthrough={
            "custom_id": parsed.custom_id, "batch_line": lineno, "endpoint": parsed.url,
            "request_model": parsed.model, "_kind": parsed.kind, "_logprobs": parsed.logprobs,
            "_skip_special": parsed.skip_special_tokens, "_ignore_eos": parsed.ignore_eos})


def _cut_lines(stream: Any, sha: Any, name: str, source: str, base: SamplingParams, step: int
               ) -> tuple[BatchPlan, list[WorkUnit], dict[int, int], int, dict[str, list[int]]]:
    """Every request line of `stream` (hashed into `sha`), in units of `step` lines: (the
    BatchPlan, the units, output rows per unit, request lines, {ignored key: [lines that have
    it, the first of them]})."""
    bp = BatchPlan(name=name)
    ignored: dict[str, list[int]] = {}
    owners: dict[str, int] = {}
    fallback: list[int] = []  # lines whose prompt id is not their custom_id
    units: list[WorkUnit] = []
    expected: dict[int, int] = {}
    count = 0
    cur: list[Any] | None = None  # [first byte, end byte, first line, rows, output rows]

    def close() -> None:
        if cur is not None:
            index = len(units)
            units.append(WorkUnit(index=index, source=source, row_start=count - cur[3], row_end=count))
            bp.ranges[index] = (cur[0], cur[1], cur[2])
            expected[index] = cur[4]

    shapes = LineShapes(base)
    for start, end, lineno, raw in _iter_lines(stream, hasher=sha):
        if not raw or raw.isspace():  # not raw.strip(): empty or only ASCII whitespace
            continue
        parsed = parse_line(raw, lineno, base, name, shapes=shapes, params=False)
        if parsed.ignored:
            for key in dict.fromkeys(parsed.ignored):
                ignored.setdefault(key, [0, lineno])[0] += 1
        if parsed.custom_id is None:
            fallback.append(lineno)
        elif parsed.custom_id in owners:
            bp.duplicates[lineno] = owners[parsed.custom_id]
            fallback.append(lineno)
        else:
            owners[parsed.custom_id] = lineno
        rows = 1 if parsed.error or lineno in bp.duplicates else parsed.num_samples
        if cur is None or cur[3] == step:
            close()
            cur = [start, end, lineno, 0, 0]
        cur[1] = end
        cur[3] += 1
        cur[4] += rows
        count += 1
    close()
    # "<file>:<line>" may be a custom_id of the file: then that line would share its prompt id
    # (and sampling noise) with this one and the output two rows of one (prompt_id, sample);
    # a suffix no other line uses instead. A fallback id is "<file>:", the line number, then
    # nothing or "#k", so two lines' fallback ids differ; the file's sha256 is in the
    # fingerprint, so every run of the job gives a line the same one.
    for lineno in fallback:
        pid, k = f"{name}:{lineno}", 0
        while pid in owners:
            k += 1
            pid = f"{name}:{lineno}#{k}"
        if k:
            bp.fallback_ids[lineno] = pid
    return bp, units, expected, count, ignored
