"""Prompt rules: how an input row becomes a request (token ids, prompt id, parameters).

Per prompt format (a row that breaks a rule becomes an error row, never an exception; the
error names the file, the row and the column):
- text: `tokenizer.encode(text)`. A tokenizer with nanochat's "<|bos|>" special token gets
  it prepended (nanochat trains every document with a leading <|bos|>); GPT-2-style
  tokenizers (whose bos_token_id is <|endoftext|>) get no BOS, as GPT-2 was used. A fake
  tokenizer may say explicitly with a boolean `prepend_bos` attribute.
  Errors: null, empty string, encodes to nothing.
- chat: `tokenizer.render_chat(messages, date=...)` after checking the structure here (a non-empty
  list of {role, content} with string values). A table's message (a Parquet struct, a
  GenerationPool dict) reaches the template with all its fields, as transformers'
  apply_chat_template gets them (name, tool_calls, tool_call_id, reasoning_content, ...:
  templates render earlier tool calls from them), but for a null field, which is an absent
  key (a Parquet struct has every field on every message, and templates test `'tool_calls'
  in message`); as for an OpenAI batch line, an assistant's null content beside tool calls
  is "" and a tool call's JSON-text arguments become an object (`table_messages`).
  Roles and their order are the model's rule:
  render_chat raises for what its format refuses (nanochat's alternation, an exception
  raised by a Hugging Face chat template) and the row's error carries its message. A
  template that prints the date sees the job's one date (`model.chat_template_date`, carried
  by the RowLayout), never the worker's clock.
- tokens: the ids as-is; null/empty lists, null elements, negative ids and ids >=
  tokenizer.vocab_size are errors.
Columns (`requests_from_columns`, for a table's rows):
- id_column (if set): a null id is an error row (its prompt_id falls back to "<file>:<row>");
- a value that is text but not valid UTF-8 (an Undecodable, from the Parquet reader) makes its
  row an error row naming the column (an id: as a null one; a passthrough value: null);
- sampling_column (if set): the row's struct overrides the job's sampling
  (jobs/inputs/row_params.py); a bad value is an error row naming the field.
The Parquet reader (jobs/inputs/parquet.py) and GenerationPool calls (jobs/pool_task.py) read
rows by these rules; an OpenAI batch line is parsed by jobs/inputs/openai_batch.py and its
prompt tokenized by `tokenize`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.unit import UnitRequest
from jobs.errors import shown, shown_key
from jobs.inputs.row_params import row_params


@dataclass(frozen=True, slots=True)
class RowLayout:
    """How a table's rows are read: the prompt format (text, chat, tokens), the job's column
    roles (input.column, id_column, sampling_column, passthrough), and the day chat templates
    render at (model.chat_template_date, "YYYY-MM-DD"; None: today in UTC)."""

    format: str
    column: str
    id_column: str | None = None
    sampling_column: str | None = None
    passthrough: tuple[str, ...] = ()
    chat_template_date: str | None = None
    tools: Any = None  # engine.tool_runner.ToolBox: chat prompts list its tools (None: none)

    @classmethod
    def of(cls, spec: Any) -> "RowLayout":
        """The layout of a spec's `input` section, at its model.chat_template_date, with its
        function tools."""
        inp = spec.input
        return cls(format=inp.format, column=inp.column, id_column=inp.id_column,
                   sampling_column=inp.sampling_column, passthrough=tuple(inp.passthrough),
                   chat_template_date=spec.model.chat_template_date, tools=spec.tool_box())

    def columns(self) -> list[str]:
        """The columns a row is read from, each once: the prompt, the id, the sampling struct,
        the passthrough columns."""
        cols = [self.column]
        if self.id_column:
            cols.append(self.id_column)
        if self.sampling_column:
            cols.append(self.sampling_column)
        cols.extend(self.passthrough)
        return list(dict.fromkeys(cols))


class Undecodable:
    """An input value pyarrow cannot convert to Python: text that is not valid UTF-8 (a string
    column of a file whose writer did not validate it). Its row becomes an error row naming the
    column (a struct holds it in place of its field)."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"<{self.why}>"


def undecodable(value: Any) -> Undecodable | None:
    """The Undecodable that `value` is or holds in a struct field, or None."""
    if isinstance(value, Undecodable):
        return value
    if isinstance(value, dict):
        return next((u for u in map(undecodable, value.values()) if u is not None), None)
    return None


def text_bos(tokenizer: Any) -> int | None:
    """The BOS id to prepend to text prompts for this tokenizer, or None (see module docstring)."""
    flag = getattr(tokenizer, "prepend_bos", None)
    if isinstance(flag, bool):
        return getattr(tokenizer, "bos_token_id", None) if flag else None
    special = getattr(tokenizer, "special", None)
    if callable(special):
        return special("<|bos|>")
    return None


def check_messages(messages: Any) -> str | None:
    """Why a chat prompt is malformed in structure (None if it is fine); names the message index.

    Only the structure is checked here: a non-empty list of {role, content} with string
    values. Which roles exist and in which order they may come is the model's own rule, so
    the tokenizer's render_chat judges it (nanochat's layout wants user/assistant
    alternation; a Hugging Face chat template may accept tool messages or raise its own
    error), and its message becomes the row's error.
    """
    if messages is None:
        return "messages is null"
    if not isinstance(messages, (list, tuple)):
        return f"messages must be a list of {{role, content}}, got {type(messages).__name__}"
    if len(messages) == 0:
        return "messages is empty (a conversation needs at least one user message)"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is not a {{role, content}} struct (got {shown(m)})"
        role, content = m.get("role"), m.get("content")
        if role is None:
            return f"message {i} has no role"
        if not isinstance(role, str) or not role:
            return f"message {i} role must be a non-empty string, got {shown(role)}"
        role = shown_key(role)  # named in the messages below: bounded
        if content is None:
            return f"message {i} ({role}) has no content (null)"
        if not isinstance(content, str):
            return f"message {i} ({role}) content must be a string, got {type(content).__name__}"
    return None


def table_messages(value: Any) -> tuple[Any, str | None]:
    """A table's chat prompt as its template gets it (module docstring): every field of each
    message but the null ones, an assistant's null content beside tool calls as "", and tool
    calls' JSON-text arguments as objects; or (None, why) for tool calls batchgen cannot hand
    to a template. Everything else about the structure is check_messages' to judge."""
    if not isinstance(value, (list, tuple)):
        return value, None
    out: list[Any] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            out.append(m)
            continue
        msg = {k: v for k, v in m.items() if v is not None or k in ("role", "content")}
        if msg.get("content") is None and msg.get("role") == "assistant" and msg.get("tool_calls"):
            msg["content"] = ""
        if "tool_calls" in msg:
            calls, why = template_tool_calls(msg["tool_calls"])
            if why is not None:
                return None, f"message {i} {why}"
            msg["tool_calls"] = calls
        out.append(msg)
    return out, None


def template_tool_calls(value: Any) -> tuple[list[dict] | None, str | None]:
    """An assistant message's tool calls as a chat template reads them, [{id, type, function:
    {name, arguments}}] with each function's arguments as an object (OpenAI's API, and a
    Parquet file whose struct cannot hold every tool's arguments, give them as JSON text;
    transformers' templates print them with `tojson` and would print the text quoted; null
    arguments are {}); or (None, why) for a call that is not one. Shared by table chat rows
    and OpenAI batch lines (jobs/inputs/openai_batch.py)."""
    if not isinstance(value, (list, tuple)):
        return None, f"tool_calls: must be a list, got {type(value).__name__}"
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return None, f"tool call {j}: must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                return None, f"tool call {j}: function.arguments is not valid JSON: {e}"
        elif args is None:
            args = {}
        calls.append({**call, "function": {**fn, "arguments": args}})
    return calls, None


def tokenize(value: Any, fmt: str, tokenizer: Any, bos: int | None, vocab: int | None,
             chat_date: str | None = None,
             message_keys: tuple[str, ...] | None = (),
             tools: list[dict] | None = None) -> tuple[list[int] | None, str | None]:
    """(token ids, None) or (None, why) for one prompt of format `fmt` (text, chat or tokens);
    `bos`: text_bos(tokenizer) for text prompts, `vocab`: the tokenizer's vocab_size,
    `chat_date`: the day a chat template renders at. A chat message reaches the template as
    its role and content, and the `message_keys` it has (an OpenAI batch line's name,
    tool_calls, tool_call_id; None: all its keys, a table's messages after table_messages).
    `tools`: JSON schemas a chat template lists (the job's function tools;
    engine/tokenizers/hf_tokenizer.py `render_chat`)."""
    if fmt == "text":
        if value is None:
            return None, "prompt is null"
        if value == "":
            return None, "prompt is an empty string"
        try:
            ids = list(tokenizer.encode(value))
        except (ValueError, TypeError) as e:
            return None, f"cannot tokenize the prompt: {e}"
        if not ids:
            return None, "prompt encodes to no tokens"
        return ([bos] + ids if bos is not None else ids), None
    if fmt == "chat":
        msgs = value if value is None or message_keys is None else [
            {"role": m.get("role"), "content": m.get("content"), **{k: m[k] for k in message_keys if k in m}}
            if isinstance(m, dict) else m for m in value]
        why = check_messages(msgs)
        if why is not None:
            return None, why
        try:
            ids = list(tokenizer.render_chat(msgs, date=chat_date, **({"tools": tools} if tools else {})))
        except (ValueError, TypeError, KeyError) as e:
            return None, f"cannot render the conversation: {e}"
        if not ids:
            return None, "conversation renders to no tokens"
        return ids, None
    # tokens
    if value is None:
        return None, "token list is null"
    if len(value) == 0:
        return None, "token list is empty"
    for j, t in enumerate(value):
        if t is None:
            return None, f"token {j} is null"
        if t < 0:
            return None, f"token {j} is {t}: token ids must be >= 0"
        if vocab is not None and t >= vocab:
            return None, f"token {j} is {t}: outside the tokenizer's vocabulary (size {vocab})"
    return [int(t) for t in value], None


def requests_from_columns(layout: RowLayout, params: Any, columns: dict[str, list[Any]], name: str,
                          row_start: int, tokenizer: Any) -> list[UnitRequest]:
    """One UnitRequest per row of `columns` (the layout's columns as Python lists), by the
    rules of the module docstring; `params` is the job's SamplingParams (a sampling column
    overrides it per row); `name` and `row_start` (the first row's index) name a row in
    errors and make its default prompt id "<name>:<row>"."""
    prompts = columns[layout.column]
    ids = columns[layout.id_column] if layout.id_column else None
    passthrough = {c: columns[c] for c in layout.passthrough}
    sampling = columns[layout.sampling_column] if layout.sampling_column else None
    bos = text_bos(tokenizer) if layout.format == "text" else None
    tools = layout.tools.schemas() if layout.tools is not None and layout.format == "chat" else None
    vocab = getattr(tokenizer, "vocab_size", None)
    out: list[UnitRequest] = []
    for i, value in enumerate(prompts):
        row = row_start + i
        where = f"{name} row {row}"
        pid = f"{name}:{row}"
        error = None
        if ids is not None:
            if ids[i] is None:
                error = f"{where} column {layout.id_column!r}: prompt id is null"
            elif (bad := undecodable(ids[i])) is not None:
                error = f"{where} column {layout.id_column!r}: prompt id is {bad.why}"
            else:
                pid = str(ids[i])
        row_sampling = None
        if sampling is not None:
            row_sampling, why = row_params(params, sampling[i], f"{where} column {layout.sampling_column!r} ")
            error = error or why
        row_passthrough = {c: passthrough[c][i] for c in layout.passthrough}
        for c in (layout.column, *layout.passthrough):
            if (bad := undecodable(columns[c][i])) is not None:
                error = error or f"{where} column {c!r}: {bad.why}"
                if c in row_passthrough:
                    row_passthrough[c] = None  # (the output cannot hold it)
        tokens = None
        if error is None:
            why = None
            if layout.format == "chat":
                value, why = table_messages(value)
            if why is None:
                tokens, why = tokenize(value, layout.format, tokenizer, bos, vocab, layout.chat_template_date,
                                       message_keys=None, tools=tools)
            if why is not None:
                error = f"{where} column {layout.column!r}: {why}"
                tokens = None
        out.append(UnitRequest(prompt_id=pid, prompt_tokens=tokens, error=error, passthrough=row_passthrough,
                               params=row_sampling))
    return out
