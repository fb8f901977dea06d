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

The file is read twice and never held whole. The first pass checks every line and the ids,
and decides the columns (every scalar field of any line, in first-seen order) and their
types, as pyarrow would infer each type from the whole column: it keeps, per column, the
first value of each kind that inference and conversion treat differently (`_kind`) and has
pyarrow convert those few values, which gives the whole column's type, or its error. The
second pass writes batches of whole row groups. Memory: one batch (BATCH_ROWS rows or
BATCH_BYTES of lines, in whole row groups), the Parquet footer the writer keeps until it
closes the file (a few KB a row group), and with --id-column the ids (8 bytes an integer or
the string's bytes, plus 8 for its line), sorted once at the end to find a duplicate.
"""
from __future__ import annotations

import codecs
import json
import math
import os
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.errors import InputError, OutputError

# a row's line number: a key no JSON field can be (a field named "_line" is kept, and can be the id)
LINE = object()
# a batch of the second pass: whole row groups, up to BATCH_ROWS rows (rounded down to whole
# groups, at least one), ended early at the end of a group once its lines hold BATCH_BYTES
BATCH_ROWS = 4096
BATCH_BYTES = 16 << 20
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def prepare_jsonl(input_path: str, output_path: str, column: str = "prompt", id_column: str | None = None,
                  fmt: str = "text", row_group_rows: int = 256, batch_rows: int = BATCH_ROWS) -> int:
    """Convert JSONL to a prompts Parquet file with `row_group_rows`-row groups (see the
    module docstring); returns the number of rows written. `batch_rows`: about how many rows
    the second pass holds at once (whole row groups, at least one).

    Raises InputError (exit code 2) for a missing file, a line that is not a JSON object
    (naming the line number), a line without the prompt field, a prompt that is not a
    string, an id that is missing, duplicate, not a string or an integer, or of another kind
    than the others, or a field whose type changes between lines, and for row_group_rows < 1;
    OutputError when the file cannot be written. Every check is made, reading the whole file,
    before the output file or its temporary file is created (a file changed between the two
    reads is an InputError too, and its temporary file is removed).
    """
    if row_group_rows < 1:
        raise InputError(f"--row-group-rows must be >= 1, got {row_group_rows}")
    target = "messages" if fmt == "chat" else "prompt"
    scan = _Scan(input_path, target, id_column, batch_rows)
    for row, _ in _rows(input_path, column, target, fmt):
        scan.add(row)
    schema = scan.finish()  # the id errors, then the columns' types, as the whole file gives them
    batch = max(1, batch_rows // row_group_rows) * row_group_rows
    parent = os.path.dirname(os.path.abspath(output_path))
    tmp = f"{output_path}.tmp-{os.getpid()}"
    try:
        try:
            os.makedirs(parent, exist_ok=True)
            n = _write(input_path, column, target, fmt, scan, schema, tmp, batch, row_group_rows)
            os.replace(tmp, output_path)
        except OSError as e:
            raise OutputError(f"{output_path}: cannot write: {e}") from None
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return n


def _rows(input_path: str, column: str, target: str, fmt: str) -> Iterator[tuple[dict[Any, Any], int]]:
    """The file's lines as rows ({LINE: n, target: prompt, other scalar fields}), one at a
    time, each with the line's length in bytes. A field named as the target column (`prompt`
    or `messages`) beside another prompt field is an InputError naming the line: the prompt
    would replace it, and it was lost."""
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
            row: dict[Any, Any] = {LINE: lineno}
            row[target] = text if fmt == "text" else (None if text is None else [{"role": "user", "content": text}])
            for k, v in obj.items():
                if k == column:
                    continue
                if v is None or isinstance(v, (str, int, float, bool)):
                    if isinstance(v, float) and not math.isfinite(v):
                        v = None
                    row[k] = v
            yield row, len(raw)


# the kinds of value pyarrow's type inference and conversion treat differently (see _kind)
_NONE, _BOOL, _INT, _INT_WIDE, _INT_HUGE, _FLOAT, _STR, _STR_SURROGATE = range(8)


def _kind(v: Any) -> int:
    """What pa.array makes of a value, for a column's type and error: inference stops at the
    first bool or str and takes double over int64 over bool over string; converting an int to
    double fails beyond 2**53 ("outside of the range exactly representable"), and with another
    message beyond int64, where converting it to int64 fails too (OverflowError); a string
    with a lone surrogate (JSON's "\\ud800") fails as it is encoded."""
    t = type(v)
    if t is str:
        if v.isascii():
            return _STR
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return _STR_SURROGATE
        return _STR
    if t is int:
        if -2 ** 53 <= v <= 2 ** 53:
            return _INT
        return _INT_WIDE if -2 ** 63 <= v < 2 ** 63 else _INT_HUGE
    if t is float:
        return _FLOAT
    return _BOOL if t is bool else _NONE


def _kind_text(v: Any) -> int:
    """_kind for a prompt (a string or None), or the message list a chat prompt becomes."""
    if v is None:
        return _NONE
    return _kind(v if isinstance(v, str) else v[0]["content"])


class _Scan:
    """The first pass: the columns in first-seen order, the first value of each _kind in each
    column (in the order they first appear, which is what pa.array's inference and first
    failing value depend on), the row count, and the id checks of _add_ids, row by row."""

    def __init__(self, input_path: str, target: str, id_column: str | None, batch_rows: int):
        self.input_path, self.target = input_path, target
        self.rows = 0
        self.first_line: int | None = None
        self.values: dict[str, dict[int, Any]] = {target: {}}  # column -> {kind: its first value}
        self.ids = _Ids(input_path, id_column, max(1, batch_rows)) if id_column is not None else None

    def add(self, row: dict[Any, Any]) -> None:
        if self.first_line is None:
            self.first_line = row[LINE]
        self.rows += 1
        if self.ids is not None:
            self.ids.add(row)  # (an integral float id becomes the int in row)
        values, target = self.values, self.target
        for k, v in row.items():
            if k is LINE:
                continue
            t = type(v)  # (the common kinds first, inline: this runs for every field of every line)
            if t is str and v.isascii():
                kind = _STR
            elif t is int and -2 ** 53 <= v <= 2 ** 53:
                kind = _INT
            else:
                kind = _kind_text(v) if k == target else _kind(v)
            seen = values.get(k)
            if seen is None:
                seen = values[k] = {}
            if kind not in seen:
                seen[kind] = v

    def finish(self) -> pa.Schema:
        """Raise the first id error, then the first column's type error, as the whole file in
        memory raised them; the output's schema."""
        ids = self.ids
        if ids is not None:
            ids.finish()
            if not ids.have:  # no line has the field: ids are the line numbers
                self.values.setdefault(ids.id_column, {} if self.first_line is None else {_INT: self.first_line})
        fields = []
        for name, seen in self.values.items():
            # (a line without the field is a null: that makes no difference, a null being in no
            # place different from another, and a column with only nulls having one)
            sample = list(seen.values())
            try:
                if name == "messages":  # (the prompt's column, or a field of that name beside a text prompt)
                    t = pa.array(sample, type=MESSAGES).type
                elif name == "prompt":
                    t = pa.array(sample, type=pa.string()).type
                else:
                    t = pa.array(sample).type
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
                raise InputError(f"{self.input_path}: field {name!r} has values of different types: {e}") from None
            fields.append((name, t))
        return pa.schema(fields)  # (a field name with a lone surrogate fails here, after every column's type)


class _Ids:
    """The id checks (present, a string or an integer, one kind, unique) a row at a time: the
    first row that fails them (the error is raised by finish, after every line was read, as
    before); the ids of the rows before it, kept as Arrow arrays beside their line numbers and
    sorted once to find the first duplicate."""

    def __init__(self, input_path: str, id_column: str, chunk: int):
        self.input_path, self.id_column, self.chunk = input_path, id_column, chunk
        self.have = False  # a line has the field
        self.first_absent: int | None = None  # the first line without it, before any line with it
        self.error: InputError | None = None  # the first row's error other than a duplicate
        self.kind: tuple[type, int] | None = None  # (str or int, the first line with an id)
        # (values, lines) for each array: str ids (as UTF-8 bytes, lone surrogates kept),
        # int ids below 2**63 (int64), int ids from 2**63 (uint64)
        self.pending: dict[str, tuple[list[Any], list[int]]] = {"str": ([], []), "int": ([], []), "uint": ([], [])}
        self.chunks: dict[str, tuple[list[pa.Array], list[pa.Array]]] = {k: ([], []) for k in self.pending}

    def add(self, r: dict[Any, Any]) -> None:
        if self.error is not None:
            return
        id_column = self.id_column
        where = f"{self.input_path}:{r[LINE]}"
        missing = (f"id field {id_column!r} is missing, null, not finite, a list or an object; "
                   f"ids must be strings or integers")
        if id_column not in r:
            if self.have:
                self.error = InputError(f"{where}: {missing}")
            elif self.first_absent is None:
                self.first_absent = r[LINE]
            return
        if not self.have:
            self.have = True
            if self.first_absent is not None:
                self.error = InputError(f"{self.input_path}:{self.first_absent}: {missing}")
                return
        v = r[id_column]
        if v is None:
            # (_rows made NaN and infinities null, and dropped lists and objects)
            self.error = InputError(f"{where}: {missing}")
            return
        if isinstance(v, float) and v.is_integer() and abs(v) <= 2 ** 53:
            v = r[id_column] = int(v)  # 3.0 -> 3; above 2**53 a float no longer holds the integer written
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            # bools: True == 1 as a key, and `run` refuses a bool id column; floats: ids must be exact
            self.error = InputError(f"{where}: id field {id_column!r} is {json.dumps(v)} ({type(v).__name__}); "
                                    f"ids must be strings or integers")
            return
        if not isinstance(v, str) and not -2 ** 63 <= v < 2 ** 64:
            self.error = InputError(f"{where}: id field {id_column!r} is {v}, outside the 64-bit integer range")
            return
        if self.kind is None:
            self.kind = (type(v), r[LINE])
        elif type(v) is not self.kind[0]:
            self.error = InputError(
                f"{where}: id field {id_column!r} is {json.dumps(v)} ({type(v).__name__}), but line "
                f"{self.kind[1]} has a {self.kind[0].__name__} id; ids must all be strings or all integers")
            return
        if isinstance(v, str):
            key, v = "str", v.encode("utf-8", "surrogatepass")  # one bytes value per str, as equal as the strs
        else:
            key = "int" if v < 2 ** 63 else "uint"
        values, lines = self.pending[key]
        values.append(v)
        lines.append(r[LINE])
        if len(values) >= self.chunk:
            self._flush(key)

    def _flush(self, key: str) -> None:
        values, lines = self.pending[key]
        if values:
            t = {"str": pa.large_binary(), "int": pa.int64(), "uint": pa.uint64()}[key]
            self.chunks[key][0].append(pa.array(values, type=t))
            self.chunks[key][1].append(pa.array(lines, type=pa.int64()))
            self.pending[key] = ([], [])

    def finish(self) -> None:
        """Raise the first row's error: a duplicate (it can only be before `error`'s row, as
        ids were kept up to that row) or `error`."""
        first: tuple[int, int, Any] | None = None  # (line, the line of its first occurrence, id)
        for key in self.pending:
            self._flush(key)
            dup = _first_duplicate(*self.chunks[key])
            if dup is not None and (first is None or dup[0] < first[0]):
                first = dup
            self.chunks[key] = ([], [])
        if first is not None:
            line, also, v = first
            if isinstance(v, bytes):
                v = v.decode("utf-8", "surrogatepass")
            raise InputError(f"{self.input_path}:{line}: duplicate id {v!r} (also on line {also})")
        if self.error is not None and self.have:
            raise self.error


def _first_duplicate(values: list[pa.Array], lines: list[pa.Array]) -> tuple[int, int, Any] | None:
    """The first line whose id an earlier line has: (its line, the earlier line, the id), or None.
    A stable sort puts equal ids together in line order, so the first repeat of each id
    follows its first occurrence, and the first line among the repeats is the answer."""
    if sum(len(a) for a in values) < 2:
        return None
    ids = pa.chunked_array(values)
    order = pc.sort_indices(ids)  # stable
    ids = ids.take(order)
    line = pa.chunked_array(lines).take(order)
    del order
    n = len(ids)
    same = pc.equal(ids.slice(1), ids.slice(0, n - 1))
    if not pc.any(same).as_py():
        return None
    repeats = line.slice(1).filter(same)
    j = pc.index(repeats, pc.min(repeats)).as_py()
    return (repeats[j].as_py(), line.slice(0, n - 1).filter(same)[j].as_py(), ids.slice(1).filter(same)[j].as_py())


def _write(input_path: str, column: str, target: str, fmt: str, scan: _Scan, schema: pa.Schema, tmp: str,
           batch: int, row_group_rows: int) -> int:
    """The second pass: the rows again, `batch` (whole row groups) at a time, into `tmp`."""
    ids = scan.ids
    made_ids = ids is not None and not ids.have  # ids from line numbers
    id_column = ids.id_column if ids is not None else None
    n = size = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        rows: list[dict[Any, Any]] = []

        def flush() -> None:
            arrays = []
            for field in schema:
                values = [r.get(field.name) for r in rows]
                try:
                    arrays.append(pa.array(values, type=field.type))
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
                    raise InputError(f"{input_path}: changed while it was read: field {field.name!r}: {e}") from None
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=row_group_rows)
            rows.clear()

        for row, length in _rows(input_path, column, target, fmt):
            if made_ids:
                row[id_column] = row[LINE]
            elif id_column is not None:
                v = row.get(id_column)
                if type(v) is float:
                    row[id_column] = int(v)  # (checked by the first pass: integral, within 2**53)
            rows.append(row)
            n += 1
            size += length
            if len(rows) == batch or (size >= BATCH_BYTES and len(rows) % row_group_rows == 0):
                flush()
                size = 0
        if rows or n == 0:
            flush()  # (an empty file: one empty table, as pq.write_table wrote it)
    if n != scan.rows:
        raise InputError(f"{input_path}: changed while it was read ({scan.rows} rows, then {n})")
    return n
