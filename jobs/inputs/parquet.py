"""The Parquet input reader (input.format text, chat, tokens): discovery, schema checks,
units along row groups, reading a unit's rows.

`input.path` may be
- a local Parquet file, or a directory (every *.parquet below it, recursively, sorted by
  relative path; names starting with "." or "_" are skipped, like Spark/Hive do);
- a glob ("data/part-*.parquet", "data/**/*.parquet"); its root is the directory part
  before the first component holding a wildcard; files below a `_batchgen` directory
  (an output's staged copies) are skipped;
- a URI that pyarrow.fs understands (file://, s3://, gs://, hdfs://...): a file, a
  "directory" prefix or a glob, resolved the same way. Filesystem options follow `?`
  (`s3://bucket/prompts?endpoint_override=HOST:PORT&scheme=http`; see jobs/uri.py): `?`
  in a URI is never a wildcard;
- `package://NAME`: a file shipped in jobs/data/ (the demo's prompts).

The job's own output: an output.path below the input directory (or the glob's root) is
skipped, files and all, so that a rerun (resume, plan, status) sees the input the first run
saw, not its part files. An output.path that is the input directory (or the glob's root)
itself is refused (InputError naming both keys): its part files would sit among the inputs.

Prompt ids: str(value of input.id_column) when it is set, else "<relative file>:<row>",
the file's path relative to the input root (the directory, the glob's base, or the file's
own directory for a single file), so ids survive moving the dataset.

Units: each file is cut along its Parquet row groups into units of at most
cluster.unit_rows consecutive rows (jobs/inputs/row_groups.py: a unit decodes at most 2x its
rows; a file with row groups larger than 2 x unit_rows is marked for staging,
jobs/inputs/staging.py). Unit indices count up across files in sorted order, so they are
stable for a given input.

The scan reads footers in parallel and checks duplicate ids in bounded memory (jobs/ids.py),
so 10 million prompts in 100 files plan in seconds and well under a gigabyte.

A file's identity in the fingerprint is its name, size, rows, the sha256 of its footer (the
schema, every row group's and column chunk's offsets, sizes, encodings and statistics) and
its modification time where the filesystem gives one (local files, S3): a file replaced by
another of the same size and rows changes its footer or its time, and a resume of the
output is refused naming the file, rather than mixing rows of two inputs.

Errors: jobs.errors.InputError (exit code 2) naming the file and the column for anything
that stops the job: no input, unreadable/corrupt Parquet, a missing or mistyped column,
files whose schemas disagree, a duplicate prompt id. Per-row problems (null or empty
prompts, malformed chat messages, bad token ids) are not errors here: they become error
rows (jobs/inputs/prompts.py).
"""
from __future__ import annotations

import fnmatch
import glob as globlib
import hashlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.unit import UnitRequest, WorkUnit
from jobs import uri
from jobs.errors import InputError, shown
from jobs.ids import find_duplicate
from jobs.inputs.prompts import RowLayout, Undecodable, requests_from_columns
from jobs.inputs.reader import PACKAGE_PREFIX, InputFile, InputScan, modified_ns, open_input, resolve, source_for
from jobs.inputs.row_groups import cut_file
from jobs.inputs.row_params import check_sampling_column_type, rows_per_unit
from jobs.outputs.schema import type_str

log = logging.getLogger("batchgen")

_GLOB_CHARS = "*?["
FOOTER_THREADS = 16  # parallel footer reads (object stores answer each in tens of ms)


class ParquetReader:
    """The InputReader of Parquet files (jobs/inputs/reader.py).

    layout: how rows become requests (the spec's input columns); names: {unit source: input
    file name}, for messages and default prompt ids (the task's, staged copies included).
    """

    def __init__(self, layout: RowLayout, names: Mapping[str, str] | None = None) -> None:
        self.layout = layout
        self.names = names if names is not None else {}

    def scan(self, spec: Any) -> InputScan:
        """Find and check the input files, cut them into units (see the module docstring).
        Reads only Parquet footers, in parallel (plus the id column, to reject duplicate
        ids, and the sampling column's num_samples for the expected rows). Zero-row files
        are allowed: no units, and a warning in `warnings` and the log."""
        root, found = discover(spec.input.path, spec.output.path)
        with ThreadPoolExecutor(max_workers=max(1, min(FOOTER_THREADS, len(found)))) as ex:
            footers = list(ex.map(lambda t: _read_footer(t[0], t[1]), found))
        files, file_units, rows_decoded, warnings = _cut_files(spec, found, footers)
        if spec.input.id_column:
            _check_duplicate_ids(spec, files)
        expected: dict[int, int] = {}
        if spec.input.sampling_column:
            for f, its in zip(files, file_units):
                if f.num_rows:
                    expected.update(rows_per_unit(_num_samples_values(f, spec.input.sampling_column),
                                                  [(u.index, u.row_start, u.row_end) for u in its],
                                                  spec.sampling.num_samples))
        # (a file with no rows may leave a column untyped: see check_input_schema)
        pt_schema = next((f.schema for f in files if f.num_rows), files[0].schema) if files else pa.schema([])
        return InputScan(root=root, files=files, units=[u for its in file_units for u in its],
                         fingerprint_files=[[f.name, f.size, f.num_rows, f.content] for f in files],
                         # nullable whatever the first file declares: the files only agree on the
                         # columns' types (type_str has no top-level nullability), and a later
                         # file's null in a column declared non-nullable would make every write
                         # of its units fail. The manifest's output_schema (type_str) is the same.
                         passthrough_fields=[pt_schema.field(c).with_nullable(True)
                                             for c in spec.input.passthrough],
                         rows_decoded=rows_decoded, expected_rows=expected, warnings=warnings)

    def read_unit(self, unit: WorkUnit, tokenizer: Any, params: Any) -> tuple[list[UnitRequest], int]:
        """The unit's rows as requests (jobs/inputs/prompts.py; a row is named by its file and
        its 0-based row within the file), and the rows decoded to read them."""
        name = self.names.get(unit.source, unit.source)
        columns = self.layout.columns()
        table, decoded = read_rows_counted(unit.source, unit.row_start, unit.row_end, columns)
        if table.num_rows != unit.num_rows:
            raise RuntimeError(f"{name}: rows {unit.row_start}..{unit.row_end} of unit {unit.index} could not be read "
                               f"(got {table.num_rows} rows; was the input file changed after the job started?)")
        return requests_from_columns(self.layout, params, {c: column_pylist(table.column(c)) for c in columns}, name,
                                     unit.row_start, tokenizer), decoded


def column_pylist(column: pa.ChunkedArray) -> list[Any]:
    """The column's values as Python values; text that is not valid UTF-8 (a file whose writer
    did not check it) is an Undecodable in place of the row's value or struct field, so that
    its row, not its unit, fails (jobs/inputs/prompts.py)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return [_py(v) for v in column]


def _py(scalar: pa.Scalar) -> Any:
    try:
        return scalar.as_py()
    except UnicodeDecodeError as e:
        if isinstance(scalar, pa.StructScalar):  # field by field: a sampling struct keeps its num_samples
            return {f.name: _py(scalar[f.name]) for f in scalar.type}
        return Undecodable(f"text that is not valid UTF-8 ({e})")


def _cut_files(spec: Any, found: list[tuple[str, str, int]],
               footers: list[tuple[int, pa.Schema, tuple[int, ...], dict]]
               ) -> tuple[list[InputFile], list[list[WorkUnit]], int, list[str]]:
    """Each file checked against the spec and against the first file (the columns the job
    reads must have the same types in all), and cut into units: (files, units per file,
    rows the units decode, warnings)."""
    files: list[InputFile] = []
    warnings: list[str] = []
    first: dict[str, tuple[str, str]] = {}  # column -> (the first file that types it, its type)
    needed = [spec.input.column] + ([spec.input.id_column] if spec.input.id_column else []) + list(spec.input.passthrough)
    if spec.input.sampling_column:
        needed.append(spec.input.sampling_column)
    file_units: list[list[WorkUnit]] = []
    count = rows_decoded = 0
    for (source, name, size), (num_rows, schema, groups, content) in zip(found, footers):
        check_input_schema(spec, name, schema, empty=num_rows == 0)
        for c in dict.fromkeys(needed):
            ft = schema.field(c).type
            if num_rows == 0 and pa.types.is_null(ft):
                continue  # no rows, no type (see check_input_schema): it agrees with every file
            t = _normalize(ft) if c in (spec.input.column, spec.input.id_column) else type_str(ft)
            if c not in first:
                first[c] = (name, t)
            elif first[c][1] != t:
                raise InputError(f"{name}: column {c!r} has type {t}, but {first[c][0]} has {first[c][1]} "
                                 f"(all input files must share the schema of the columns a job reads)")
        if num_rows == 0:
            msg = f"{name}: 0 rows (no units)"
            warnings.append(msg)
            log.warning("input file %s", msg)
        cut = cut_file(groups, spec.cluster.unit_rows)
        rows_decoded += cut.rows_decoded
        file_units.append([WorkUnit(index=count + k, source=source, row_start=a, row_end=b)
                           for k, (a, b) in enumerate(cut.ranges)])
        count += len(cut.ranges)
        files.append(InputFile(path=source, name=name, size=size, num_rows=num_rows, schema=schema,
                               row_groups=groups, staged=cut.staged, content=content))
    return files, file_units, rows_decoded, warnings


# ---------------------------------------------------------------- discovery

def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def _output_below(fs: pafs.FileSystem, root: str, local: bool, output: str | None) -> str | None:
    """Where output.path is relative to the input root `root` (a path inside `fs`): "." for
    the root itself, "a/b" below it, None elsewhere (or on another filesystem)."""
    if not output:
        return None
    try:
        ofs, op = uri.filesystem_for(output)
    except (pa.ArrowException, ValueError, OSError):
        return None  # the output's own checks report a URI they cannot open
    if local:
        if not uri.is_local(ofs):
            return None
        # real paths: a symlinked input or output directory is still the same directory
        rel = os.path.relpath(os.path.realpath(op), os.path.realpath(root or os.sep))
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return None
        return rel.replace(os.sep, "/")
    if ofs.type_name != fs.type_name:
        return None
    op, root = op.rstrip("/"), root.rstrip("/")
    if op == root:
        return "."
    return op[len(root):].lstrip("/") if not root or op.startswith(root + "/") else None


def _skip_output(found: list[tuple[str, str, int]], below: str | None, path: str, output: str | None,
                 glob: bool) -> list[tuple[str, str, int]]:
    """`found` without the files of the job's own output directory (`below`, from
    _output_below): its part files are not input, so that a rerun plans what the first run
    planned. An output that is the input root itself is refused: skipping it would skip the
    input, and reading it would read the part files."""
    if below is None:
        return found
    shown, out_shown = uri.redact(path), uri.redact(str(output))
    if below == ".":
        what = f"the directory input.path {shown} searches" if glob else f"the input directory (input.path {shown})"
        raise InputError(f"output.path {out_shown} is {what}: the job's part files would sit among its input files "
                         f"and be read as input when it is rerun. Use an output.path outside the input directory "
                         f"(a subdirectory of it is fine: the input scan skips it)")
    kept = [t for t in found if not (t[1] == below or t[1].startswith(below + "/"))]
    if len(kept) < len(found):
        log.info("input.path %s: skipped %d file(s) under output.path %s (this job's own output)", shown,
                 len(found) - len(kept), out_shown)
    return kept


def _exists(fs: pafs.FileSystem, p: str) -> bool:
    """Whether `p` names a file or directory as it is (not as a pattern)."""
    try:
        return fs.get_file_info(p).type != pafs.FileType.NotFound
    except (OSError, pa.ArrowException):
        return False


def discover(path: str, output: str | None = None) -> tuple[str, list[tuple[str, str, int]]]:
    """Find the input files of `input.path`: (root, [(source, relative name, size bytes)]), sorted.
    A path holding glob characters (`*?[`) is a pattern unless it names a file or directory as
    it is: `data/a?b.parquet` (an S3 key written `a%3Fb.parquet`) is that file, not also
    `data/axb.parquet`.

    output: the job's output.path; its files are not input (see the module docstring).
    Raises InputError when the path does not exist or matches no Parquet file, or when
    output.path is the input directory itself.
    """
    shown = uri.redact(path)
    fs, p, canonical = resolve(path)
    found: list[tuple[str, str, int]] = []
    local = uri.is_local(fs)
    if path.startswith(PACKAGE_PREFIX):
        output = None  # a file shipped with batchgen, never an output's
    if any(c in p for c in _GLOB_CHARS) and not _exists(fs, p):  # a path inside the filesystem: no URI options
        cut = min(p.find(c) for c in _GLOB_CHARS if c in p)
        base = p[:cut].rsplit("/", 1)[0] if "/" in p[:cut] else ""
        try:
            if local:
                matches = [m for m in globlib.glob(p, recursive=True) if os.path.isfile(m)]
                infos = [(os.path.abspath(m), os.path.getsize(m)) for m in matches]
            else:
                sel = pafs.FileSelector(base, recursive=True, allow_not_found=True)
                infos = [(i.path, i.size) for i in fs.get_file_info(sel)
                         if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, p)]
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input.path {shown}: cannot list files: {e}") from None
        root = os.path.abspath(base) if local else base
        for fp, size in infos:
            rel = (os.path.relpath(fp, root) if local else fp[len(base):].lstrip("/")).replace(os.sep, "/")
            if "_batchgen" not in rel.split("/"):  # an output's staged copies and state, never input
                found.append((source_for(canonical, fp), rel, int(size or 0)))
        found = _skip_output(found, _output_below(fs, root, local, output), path, output, glob=True)
        if not found:
            raise InputError(f"input.path {shown}: the pattern matches no files")
        return uri.uri_for(canonical, root) if not local else root, sorted(found, key=lambda t: t[1])
    try:
        info = fs.get_file_info(p)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input.path {shown}: cannot access: {e}") from None
    if info.type == pafs.FileType.NotFound:
        raise InputError(f"input.path {shown}: no such file or directory"
                         + (f" (resolved to {p}; relative paths are relative to the current directory)"
                            if not os.path.isabs(path) and "://" not in path else ""))
    if info.type == pafs.FileType.File:
        root = p.rsplit("/", 1)[0] if "/" in p else ""
        name = p.rsplit("/", 1)[-1]
        return (root if local else uri.uri_for(canonical, root)), [(canonical, name, int(info.size or 0))]
    try:
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input.path {shown}: cannot list directory: {e}") from None
    for i in infos:
        rel = i.path[len(p):].lstrip("/")
        if i.type == pafs.FileType.File and rel.endswith(".parquet") and not _hidden(rel):
            found.append((source_for(canonical, i.path), rel, int(i.size or 0)))
    found = _skip_output(found, _output_below(fs, p, local, output), path, output, glob=False)
    if not found:
        raise InputError(f"input.path {shown}: directory holds no *.parquet files")
    return canonical if not local else p, sorted(found, key=lambda t: t[1])


# ---------------------------------------------------------------- schema checks

def _is_string(t: pa.DataType) -> bool:
    """A column whose values read as str: string, large_string, string_view, or one of them
    dictionary-encoded (a pandas category column)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _describe_expected(fmt: str) -> str:
    return {"text": "string", "tokens": "list<integer>",
            "chat": "list<struct<role: string, content: string>>"}[fmt]


def check_prompt_type(fmt: str, t: pa.DataType) -> bool:
    """Whether an Arrow type can hold prompts of input.format `fmt`."""
    if fmt == "text":
        return _is_string(t)
    if fmt == "tokens":
        return _is_list(t) and pa.types.is_integer(t.value_type)
    if _is_list(t) and pa.types.is_struct(t.value_type):
        st = t.value_type
        names = [st.field(i).name for i in range(st.num_fields)]
        return ("role" in names and "content" in names and _is_string(st.field("role").type)
                and _is_string(st.field("content").type))
    return False


def _normalize(t: pa.DataType) -> str:
    """Type text with the string encodings (large, view, dictionary-encoded) and list/large_list
    unified (for cross-file checks of the columns read as Python values: prompts and ids)."""
    text = re.sub(r"dictionary<values=(large_string|string_view|string), indices=\w+, ordered=\d>", r"\1",
                  type_str(t))
    return text.replace("large_string", "string").replace("string_view", "string").replace("large_list", "list")


def check_input_schema(spec: Any, name: str, schema: pa.Schema, empty: bool = False) -> None:
    """Raise InputError naming `name` and the column unless `schema` has the columns the job
    reads (input.column of the format's type, id_column, passthrough, sampling_column).
    empty: the file has no rows; then a column of type null passes (pandas writes an empty
    object column, such as chat messages, so: it holds nothing to read)."""
    cols = schema.names
    inp = spec.input

    def untyped(col: str) -> bool:
        return empty and pa.types.is_null(schema.field(col).type)

    def missing(col: str, key: str) -> InputError:
        return InputError(f"{name}: column {shown(col)} ({key}) not found; the file has columns: {', '.join(cols)}")

    if inp.column not in cols:
        hint = ""
        if inp.format == "chat" and "prompt" in cols:
            hint = " (a text column? set input.format: text)"
        elif inp.format == "text" and "messages" in cols:
            hint = " (a chat column? set input.format: chat)"
        raise InputError(str(missing(inp.column, "input.column")) + hint)
    t = schema.field(inp.column).type
    if not check_prompt_type(inp.format, t) and not untyped(inp.column):
        raise InputError(f"{name}: column {inp.column!r} has type {type_str(t)}, but input.format {inp.format} needs "
                         f"{_describe_expected(inp.format)}")
    if inp.id_column is not None:
        if inp.id_column not in cols:
            raise missing(inp.id_column, "input.id_column")
        it = schema.field(inp.id_column).type
        if not (_is_string(it) or pa.types.is_integer(it) or untyped(inp.id_column)):
            raise InputError(f"{name}: id column {inp.id_column!r} has type {type_str(it)}; expected a string or integer column")
    for col in inp.passthrough:
        if col not in cols:
            raise missing(col, "input.passthrough")
    if inp.sampling_column is not None:
        if inp.sampling_column not in cols:
            raise missing(inp.sampling_column, "input.sampling_column")
        if not untyped(inp.sampling_column):
            check_sampling_column_type(name, inp.sampling_column, schema.field(inp.sampling_column).type)


def _read_footer(source: str, name: str) -> tuple[int, pa.Schema, tuple[int, ...], dict]:
    """(rows, Arrow schema, rows of each row group, content identity) from one file's Parquet
    footer; the identity is {"footer_sha256", "mtime_ns"} (see the module docstring)."""
    try:
        with open_input(source) as f:
            content = {"footer_sha256": _footer_sha256(f), "mtime_ns": modified_ns(source)}
            md = pq.ParquetFile(f).metadata
            return md.num_rows, md.schema.to_arrow_schema(), tuple(md.row_group(i).num_rows
                                                                  for i in range(md.num_row_groups)), content
    except InputError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{name}: not a readable Parquet file ({uri.redact(source)}): {e}") from None


def _footer_sha256(f: pa.NativeFile) -> str:
    """sha256 of a Parquet file's footer: its last 8 + n bytes (the thrift metadata of length
    n, then n as 4 little-endian bytes and the magic "PAR1"). Raises ValueError for a file
    too short or without the magic."""
    size = f.size()
    if size < 12:
        raise ValueError(f"{size} bytes, too short for a Parquet file")
    f.seek(size - 8)
    tail = f.read(8)
    n = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or n > size - 12:
        raise ValueError("no Parquet footer at its end (truncated, or another format)")
    f.seek(size - 8 - n)
    return hashlib.sha256(f.read(n) + tail).hexdigest()


# ---------------------------------------------------------------- reading

def read_rows_counted(source: str, row_start: int, row_end: int, columns: list[str]) -> tuple[pa.Table, int]:
    """Rows [row_start, row_end) of one input file, only `columns`, and how many rows were
    decoded to get them (the row groups that overlap the range; see jobs/inputs/row_groups.py).

    Raises pyarrow/OS errors for a file that cannot be read (the caller's unit then fails
    and is retried).
    """
    with open_input(source) as f:
        pf = pq.ParquetFile(f)
        md = pf.metadata
        groups, first_row, pos, decoded = [], None, 0, 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if pos + n > row_start and pos < row_end:
                groups.append(g)
                decoded += n
                if first_row is None:
                    first_row = pos
            pos += n
        if not groups:
            return pf.schema_arrow.empty_table().select(columns), 0
        table = pf.read_row_groups(groups, columns=columns)
    return table.slice(row_start - first_row, row_end - row_start), decoded


def read_rows(source: str, row_start: int, row_end: int, columns: list[str]) -> pa.Table:
    """Rows [row_start, row_end) of one input file, only `columns` (see read_rows_counted)."""
    return read_rows_counted(source, row_start, row_end, columns)[0]


def _check_duplicate_ids(spec: Any, files: list[InputFile]) -> None:
    """Raise InputError naming both rows for a prompt id used twice, or for a string id equal
    to the prompt id "<file>:<row>" that a row with a null id gets (jobs/inputs/prompts.py):
    that row's error rows and the other row's samples would share prompt ids."""
    col = spec.input.id_column
    files = [f for f in files if f.num_rows]
    nulls: dict[int, set[int]] = {}  # file -> rows whose id is null (filled by the reads)

    def read(i: int):
        f = files[i]
        row = 0
        try:
            with open_input(f.path) as fh:
                for batch in pq.ParquetFile(fh).iter_batches(columns=[col], batch_size=65536):
                    arr = batch.column(0)
                    if pa.types.is_dictionary(arr.type) or pa.types.is_string_view(arr.type):
                        arr = arr.cast(pa.large_string())  # (take and filter have no string_view kernels)
                    if _is_string(arr.type):
                        arr = _invalid_text_as_null(arr)
                    if arr.null_count:
                        null_rows = np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)) + row
                        nulls.setdefault(i, set()).update(null_rows.tolist())
                    row += len(arr)
                    yield arr
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{f.name}: cannot read column {col!r}: {e}") from None

    dup = find_duplicate(len(files), read, threads=FOOTER_THREADS)
    if dup is not None:
        key, (fa, ra), (fb, rb) = dup
        raise InputError(f"duplicate prompt id {shown(key)} (input.id_column {col!r}): {files[fa].name} row {ra} "
                         f"and {files[fb].name} row {rb}")
    if not nulls or pa.types.is_integer(files[0].schema.field(col).type):
        return  # an integer id's text never holds the ":" of "<file>:<row>"
    fallback = {f"{files[i].name}:{r}": (i, r) for i, rows in nulls.items() for r in rows}
    values = pa.array(list(fallback), type=pa.string())
    for i in range(len(files)):
        row = 0
        for arr in read(i):
            hit = np.flatnonzero(pc.is_in(arr.cast(pa.string()), value_set=values).to_numpy(zero_copy_only=False))
            if hit.size:
                key = arr[int(hit[0])].as_py()
                fi, fr = fallback[key]
                raise InputError(f"{files[fi].name} row {fr}: prompt id is null (input.id_column {col!r}), and the "
                                 f"prompt id its error rows would get, {key!r}, is the id of {files[i].name} row "
                                 f"{row + int(hit[0])}: give row {fr} an id")
            row += len(arr)


def _invalid_text_as_null(arr: pa.Array) -> pa.Array:
    """`arr` (strings) with its values that are not valid UTF-8 made null: such an id makes its
    row an error row as a null id does (jobs/inputs/prompts.py), and is no key."""
    try:
        arr.validate(full=True)
        return arr
    except pa.ArrowInvalid:
        pass

    def valid(b: bytes | None) -> bool:
        try:
            b is None or b.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    raw = arr.cast(pa.large_binary())
    return pc.if_else(pa.array([valid(b) for b in raw.to_pylist()]), raw, None).cast(arr.type)


def _num_samples_values(f: InputFile, column: str) -> list[Any] | None:
    """The num_samples field of a file's sampling struct column, one value per row (None when
    the struct has no such field)."""
    t = f.schema.field(column).type
    if t.get_field_index("num_samples") < 0:
        return None
    try:
        table = read_rows(f.path, 0, f.num_rows, [column])
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{f.name}: cannot read column {column!r}: {e}") from None
    return pc.struct_field(table.column(0), "num_samples").to_pylist()
