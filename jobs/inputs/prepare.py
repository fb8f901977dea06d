"""`batchgen prepare`: a JSONL file into a prompts Parquet file.

    batchgen prepare INPUT.jsonl OUTPUT.parquet [--column question] [--id-column NAME]
                     [--format text|chat] [--row-group-rows 256]

The prompt field becomes `prompt` (text) or `messages` = [{role: "user", content}] (chat);
the other scalar fields (str, int, float, bool, null; non-finite floats become null) are
kept as columns (e.g. GSM8K's `answer`, for input.passthrough); lists and objects are
dropped. A field named as the prompt's column (`prompt` / `messages`) beside the --column
field is an InputError naming the line (the prompt would replace it). Ids (--id-column) must be strings or integers, all of one kind (a float with an
integral value, 3.0, is taken as the integer 3); a missing, null, bool or fractional id is an
InputError naming the line. The input is UTF-8 (a leading byte order mark is skipped), and a
line that is not is an InputError naming it too. Blank lines are skipped. The file is written
with `row_group_rows`-row groups (match the job's cluster.unit_rows, so that no file needs
staging, jobs/inputs/staging.py), through a temporary file and a rename.
"""
from __future__ import annotations

import codecs
import json
import math
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.errors import InputError, OutputError

# a row's line number: a key no JSON field can be (a field named "_line" is kept, and can be the id)
LINE = object()


def prepare_jsonl(input_path: str, output_path: str, column: str = "prompt", id_column: str | None = None,
                  fmt: str = "text", row_group_rows: int = 256) -> int:
    """Convert JSONL to a prompts Parquet file with `row_group_rows`-row groups (see the
    module docstring); returns the number of rows written.

    Raises InputError (exit code 2) for a missing file, a line that is not a JSON object
    (naming the line number), a line without the prompt field, a prompt that is not a
    string, an id that is missing, duplicate, not a string or an integer, or of another kind
    than the others, or a field whose type changes between lines, and for row_group_rows < 1;
    OutputError when the file cannot be written.
    """
    if row_group_rows < 1:
        raise InputError(f"--row-group-rows must be >= 1, got {row_group_rows}")
    target = "messages" if fmt == "chat" else "prompt"
    rows, extra = _read_rows(input_path, column, target, fmt)
    if id_column is not None:
        _add_ids(rows, extra, id_column, input_path)
    table = _table(rows, extra, target, input_path)
    parent = os.path.dirname(os.path.abspath(output_path))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = f"{output_path}.tmp-{os.getpid()}"
        pq.write_table(table, tmp, row_group_size=row_group_rows)
        os.replace(tmp, output_path)
    except OSError as e:
        raise OutputError(f"{output_path}: cannot write: {e}") from None
    return table.num_rows


def _read_rows(input_path: str, column: str, target: str, fmt: str) -> tuple[list[dict[str, Any]], dict[str, None]]:
    """The file's lines as rows ({LINE: n, target: prompt, other scalar fields}) and the
    other fields' names, in first-seen order. A field named as the target column (`prompt` or
    `messages`) beside another prompt field is an InputError naming the line: the prompt
    would replace it, and it was lost."""
    rows: list[dict[str, Any]] = []
    extra: dict[str, None] = {}
    try:
        fh = open(input_path, "rb")  # lines end at b"\n" (a "\r" before it is JSON whitespace)
    except OSError as e:
        raise InputError(f"{input_path}: cannot open: {e.strerror or e}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # a UTF-8 byte order mark (Windows tools write one)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{input_path}:{lineno}: not UTF-8 text: {e}") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"{input_path}:{lineno}: invalid JSON: {e}") from None
            except RecursionError:  # json's decoder recurses once per nested array or object
                raise InputError(f"{input_path}:{lineno}: invalid JSON: nested too deeply") from None
            if not isinstance(obj, dict):
                raise InputError(f"{input_path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            if column not in obj:
                raise InputError(f"{input_path}:{lineno}: no field {column!r} (fields: {', '.join(obj) or 'none'})")
            text = obj[column]
            if text is not None and not isinstance(text, str):
                raise InputError(f"{input_path}:{lineno}: field {column!r} must be a string, got {type(text).__name__}")
            if target != column and target in obj:
                raise InputError(f"{input_path}:{lineno}: field {target!r} is also the column the prompt field "
                                 f"{column!r} becomes; rename it (or use --column {target})")
            row: dict[str, Any] = {LINE: lineno}
            row[target] = text if fmt == "text" else (None if text is None else [{"role": "user", "content": text}])
            for k, v in obj.items():
                if k == column:
                    continue
                if v is None or isinstance(v, (str, int, float, bool)):
                    if isinstance(v, float) and not math.isfinite(v):
                        v = None
                    row[k] = v
                    extra.setdefault(k)
            rows.append(row)
    return rows, extra


def _add_ids(rows: list[dict[str, Any]], extra: dict[str, None], id_column: str, input_path: str) -> None:
    """Check the id field (present, a string or an integer, one kind on every line, unique), or
    create it from line numbers (1-based) when no line has it. A float with an integral value
    (3.0, as tools that write every number as a float do) becomes the integer; `run` takes
    string and integer id columns only, so anything else is refused here, naming the line."""
    have = [r for r in rows if id_column in r]
    if not have:
        for r in rows:
            r[id_column] = r[LINE]
        extra.setdefault(id_column)
        return
    seen: dict[Any, int] = {}
    kind: tuple[type, int] | None = None  # (str or int, the first line with an id)
    for r in rows:
        v = r.get(id_column)
        where = f"{input_path}:{r[LINE]}"
        if v is None:
            # (_read_rows made NaN and infinities null, and dropped lists and objects)
            raise InputError(f"{where}: id field {id_column!r} is missing, null, not finite, a list or an object; "
                             f"ids must be strings or integers")
        if isinstance(v, float) and v.is_integer() and abs(v) <= 2 ** 53:
            v = r[id_column] = int(v)  # 3.0 -> 3; above 2**53 a float no longer holds the integer written
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            # bools: True == 1 as a key, and `run` refuses a bool id column; floats: ids must be exact
            raise InputError(f"{where}: id field {id_column!r} is {json.dumps(v)} ({type(v).__name__}); "
                             f"ids must be strings or integers")
        if not isinstance(v, str) and not -2 ** 63 <= v < 2 ** 64:
            raise InputError(f"{where}: id field {id_column!r} is {v}, outside the 64-bit integer range")
        if kind is None:
            kind = (type(v), r[LINE])
        elif type(v) is not kind[0]:
            raise InputError(f"{where}: id field {id_column!r} is {json.dumps(v)} ({type(v).__name__}), but line "
                             f"{kind[1]} has a {kind[0].__name__} id; ids must all be strings or all integers")
        if v in seen:
            raise InputError(f"{where}: duplicate id {v!r} (also on line {seen[v]})")
        seen[v] = r[LINE]


def _table(rows: list[dict[str, Any]], extra: dict[str, None], target: str, input_path: str) -> pa.Table:
    names = [target] + [k for k in extra if k != target]
    arrays = {}
    for name in names:
        values = [r.get(name) for r in rows]
        try:
            if name == "messages":
                arrays[name] = pa.array(values, type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
            elif name == "prompt":
                arrays[name] = pa.array(values, type=pa.string())
            else:
                arrays[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            raise InputError(f"{input_path}: field {name!r} has values of different types: {e}") from None
    return pa.table(arrays) if arrays else pa.table({target: pa.array([], type=pa.string())})
