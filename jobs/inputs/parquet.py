"""Input discovery, validation and work units: everything checked before any work starts.

`input.path` may be
- a local Parquet file, or a directory (every *.parquet below it, recursively, sorted by
  relative path; names starting with "." or "_" are skipped, like Spark/Hive do);
- a glob ("data/part-*.parquet", "data/**/*.parquet"); its root is the directory part
  before the first component holding a wildcard;
- a URI that pyarrow.fs understands (file://, s3://, gs://, hdfs://...): a file, a
  "directory" prefix or a glob, resolved the same way. Filesystem options follow `?`
  (`s3://bucket/prompts?endpoint_override=HOST:PORT&scheme=http`; see jobs/uri.py): `?`
  in a URI is never a wildcard;
- `package://NAME`: a file shipped in jobs/data/ (the demo's prompts).

Prompt ids: str(value of input.id_column) when it is set, else "<relative file>:<row>",
the file's path relative to the input root (the directory, the glob's base, or the file's
own directory for a single file), so ids survive moving the dataset.

Units: each file is cut along its Parquet row groups into units of at most
cluster.unit_rows consecutive rows (jobs/inputs/row_groups.py: a unit decodes at most 2x its rows; a file
with row groups larger than 2 x unit_rows is marked for staging, jobs/inputs/staging.py). Unit
indices count up across files in sorted order, so they are stable for a given input.

Planning reads footers in parallel and checks duplicate ids in bounded memory (jobs/ids.py),
so 10 million prompts in 100 files plan in seconds and well under a gigabyte.

Errors: jobs.errors.InputError (exit code 2) naming the file and the column for anything
that stops the job: no input, unreadable/corrupt Parquet, a missing or mistyped column,
files whose schemas disagree, a duplicate prompt id. Per-row problems (null or empty
prompts, malformed chat messages, bad token ids) are not errors here: they become error
rows (see jobs.task).
"""
from __future__ import annotations

import fnmatch
import glob as globlib
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cluster.unit import WorkUnit
from jobs import uri
from jobs.errors import InputError, SpecError
from jobs.ids import find_duplicate
from jobs.outputs.output_dir import type_str
from jobs.inputs.row_params import check_sampling_column_type, rows_per_unit
from jobs.spec import PACKAGE_PREFIX, JobSpec
from jobs.inputs.row_groups import cut_file
from jobs.plan.fingerprint import HashCache, content_identity

log = logging.getLogger("batchgen")

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
# 2: checkpoint content hashes, resolved device kind and dtype, row-group units; the stop
# token kept in `tokens`, the stop_reason column, per-row sampling parameters
FINGERPRINT_VERSION = 2
_GLOB_CHARS = "*?["
FOOTER_THREADS = 16  # parallel footer reads (object stores answer each in tens of ms)


@dataclass(frozen=True)
class InputFile:
    """One input Parquet file.

    path: how a worker opens it (absolute local path, URI, or package://NAME);
    name: its path relative to the input root (used in prompt ids and the fingerprint);
    size: bytes; num_rows: rows; schema: its Arrow schema;
    row_groups: rows of each Parquet row group; staged: read from a re-chunked copy
    (jobs/inputs/row_groups.py, jobs/inputs/staging.py).
    """

    path: str
    name: str
    size: int
    num_rows: int
    schema: pa.Schema
    row_groups: tuple[int, ...] = ()
    staged: bool = False


@dataclass
class JobPlan:
    """What a job will do: its files, its units, and the fingerprint that identifies its output.

    fingerprint: sha256 hex of the canonical JSON of `fingerprint_data` (spec fields that
    decide the rows + each input file's name, size and row count + the checkpoint's file
    hashes).
    passthrough_fields: the Arrow fields of input.passthrough, as the output will store them.
    rows_decoded: input rows the job's units (and staging) will decode, against
    num_prompts used.
    expected_rows: output rows per unit index where a unit's rows are not its prompts x
        sampling.num_samples (per-row num_samples: input.sampling_column, openai_batch).
    batch: for input.format openai_batch, where each unit's lines are (jobs.inputs.openai_batch.BatchPlan).
    """

    units: list[WorkUnit]
    files: list[InputFile]
    fingerprint: str
    num_prompts: int
    root: str = ""
    fingerprint_data: dict[str, Any] = field(default_factory=dict)
    passthrough_fields: list[pa.Field] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rows_decoded: int = 0
    expected_rows: dict[int, int] = field(default_factory=dict)
    batch: Any = None

    @property
    def staged_files(self) -> list[InputFile]:
        return [f for f in self.files if f.staged]

    def unit_rows(self, unit: WorkUnit, num_samples: int) -> int:
        """Output rows unit `unit` commits (a verify check and the progress bar's total)."""
        return self.expected_rows.get(unit.index, unit.num_rows * num_samples)

    def file_of(self, source: str) -> InputFile:
        for f in self.files:
            if f.path == source:
                return f
        raise KeyError(source)


# ---------------------------------------------------------------- filesystems

def _package(path: str) -> str:
    name = path[len(PACKAGE_PREFIX):]
    local = DATA_DIR / name
    if not name or not local.exists():
        avail = sorted(p.name for p in DATA_DIR.glob("*.parquet")) if DATA_DIR.exists() else []
        raise InputError(f"{path}: no such packaged file (available: {', '.join(avail) or 'none'})")
    return str(local)


def resolve(path: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path inside it, canonical source string) for an input path.

    Relative local paths resolve against the current working directory; a URI keeps its
    options (after `?`) in the canonical string, so workers open the same filesystem.
    Raises InputError for an unknown package:// name or a URI pyarrow cannot handle.
    """
    if path.startswith(PACKAGE_PREFIX):
        return pafs.LocalFileSystem(), _package(path), path
    try:
        fs, p = uri.filesystem_for(path)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise InputError(f"{uri.redact(path)}: cannot open this URI: {e}") from None
    return fs, p, (uri.uri_for(path, p) if uri.is_uri(path) and not uri.is_local(fs) else p)


def _source_for(canonical_root: str, fs_path: str) -> str:
    """The source string of a file found under a root (keeps the root's scheme and options)."""
    if canonical_root.startswith(PACKAGE_PREFIX):
        return PACKAGE_PREFIX + os.path.relpath(fs_path, DATA_DIR).replace(os.sep, "/")
    return uri.uri_for(canonical_root, fs_path)


def open_input(source: str) -> pa.NativeFile:
    """Open an input file (a WorkUnit.source / InputFile.path) for random access reads."""
    fs, p, _ = resolve(source)
    return fs.open_input_file(p)


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def discover(path: str) -> tuple[str, list[tuple[str, str, int]]]:
    """Find the input files of `input.path`: (root, [(source, relative name, size bytes)]), sorted.

    Raises InputError when the path does not exist or matches no Parquet file.
    """
    shown = uri.redact(path)
    fs, p, canonical = resolve(path)
    found: list[tuple[str, str, int]] = []
    local = uri.is_local(fs)
    if any(c in p for c in _GLOB_CHARS):  # p is a path inside the filesystem: a URI's options are not in it
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
            rel = os.path.relpath(fp, root) if local else fp[len(base):].lstrip("/")
            found.append((_source_for(canonical, fp), rel.replace(os.sep, "/"), int(size or 0)))
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
            found.append((_source_for(canonical, i.path), rel, int(i.size or 0)))
    if not found:
        raise InputError(f"input.path {shown}: directory holds no *.parquet files")
    return canonical if not local else p, sorted(found, key=lambda t: t[1])


# ---------------------------------------------------------------- schema checks

def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


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
    """Type text with string/large_string and list/large_list unified (for cross-file checks)."""
    return type_str(t).replace("large_string", "string").replace("large_list", "list")


def check_input_schema(spec: JobSpec, name: str, schema: pa.Schema) -> None:
    """Raise InputError naming `name` and the column unless `schema` has the columns the job
    reads (input.column of the format's type, id_column, passthrough, sampling_column)."""
    cols = schema.names
    inp = spec.input

    def missing(col: str, key: str) -> InputError:
        return InputError(f"{name}: column {col!r} ({key}) not found; the file has columns: {', '.join(cols)}")

    if inp.column not in cols:
        hint = ""
        if inp.format == "chat" and "prompt" in cols:
            hint = " (a text column? set input.format: text)"
        elif inp.format == "text" and "messages" in cols:
            hint = " (a chat column? set input.format: chat)"
        raise InputError(str(missing(inp.column, "input.column")) + hint)
    t = schema.field(inp.column).type
    if not check_prompt_type(inp.format, t):
        raise InputError(f"{name}: column {inp.column!r} has type {type_str(t)}, but input.format {inp.format} needs "
                         f"{_describe_expected(inp.format)}")
    if inp.id_column is not None:
        if inp.id_column not in cols:
            raise missing(inp.id_column, "input.id_column")
        it = schema.field(inp.id_column).type
        if not (_is_string(it) or pa.types.is_integer(it)):
            raise InputError(f"{name}: id column {inp.id_column!r} has type {type_str(it)}; expected a string or integer column")
    for col in inp.passthrough:
        if col not in cols:
            raise missing(col, "input.passthrough")
    if inp.sampling_column is not None:
        if inp.sampling_column not in cols:
            raise missing(inp.sampling_column, "input.sampling_column")
        check_sampling_column_type(name, inp.sampling_column, schema.field(inp.sampling_column).type)


def _read_footer(source: str, name: str) -> tuple[int, pa.Schema, tuple[int, ...]]:
    """(rows, Arrow schema, rows of each row group) from one file's Parquet footer."""
    try:
        with open_input(source) as f:
            md = pq.ParquetFile(f).metadata
            return md.num_rows, md.schema.to_arrow_schema(), tuple(md.row_group(i).num_rows
                                                                  for i in range(md.num_row_groups))
    except InputError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{name}: not a readable Parquet file ({uri.redact(source)}): {e}") from None


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


def _check_duplicate_ids(spec: JobSpec, files: list[InputFile]) -> None:
    col = spec.input.id_column
    files = [f for f in files if f.num_rows]

    def read(i: int):
        f = files[i]
        try:
            with open_input(f.path) as fh:
                for batch in pq.ParquetFile(fh).iter_batches(columns=[col], batch_size=65536):
                    yield batch.column(0)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{f.name}: cannot read column {col!r}: {e}") from None

    dup = find_duplicate(len(files), read, threads=FOOTER_THREADS)
    if dup is not None:
        key, (fa, ra), (fb, rb) = dup
        raise InputError(f"duplicate prompt id {key!r} (input.id_column {col!r}): {files[fa].name} row {ra} "
                         f"and {files[fb].name} row {rb}")


# ---------------------------------------------------------------- planning

def fingerprint_of(data: dict[str, Any]) -> str:
    """sha256 hex of the canonical JSON of `data` (sorted keys, no whitespace)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_model_path(spec: JobSpec) -> None:
    """Raise SpecError naming model.path (or model.tokenizer) when it does not exist on this
    machine (a built-in name resolves to its file first)."""
    from engine.builtin import BUILTIN_NAMES, TINY_RANDOM, resolve_builtin

    mp = spec.model.path
    if mp == "demo":
        raise SpecError(f"{spec.source}: model.path: 'demo' is not a model name any more: use 'smollm2' "
                        f"(SmolLM2-135M-Instruct, a real model) or 'tiny-random' (untrained, for tests)")
    try:
        resolved = str(resolve_builtin(mp))
    except FileNotFoundError as e:
        raise SpecError(f"{spec.source}: model.path: {e}") from None
    if mp != TINY_RANDOM and not os.path.exists(resolved):
        raise SpecError(f"{spec.source}: model.path: {mp!r} does not exist (expected a checkpoint directory, "
                        f"a .gguf file, or {' or '.join(map(repr, BUILTIN_NAMES))})")
    if spec.model.tokenizer is not None and not os.path.exists(spec.model.tokenizer):
        raise SpecError(f"{spec.source}: model.tokenizer: {spec.model.tokenizer!r} does not exist")


def plan_job(spec: JobSpec, hash_cache: HashCache | None = None) -> JobPlan:
    """Find and validate the job's inputs, cut them into units, and fingerprint the job.

    Reads only Parquet footers, in parallel (plus the id column, to reject duplicate ids)
    and hashes the checkpoint's files (`hash_cache`: see jobs/plan/fingerprint.py; None hashes them
    all). Raises InputError naming the file and column for anything that stops the job,
    SpecError for a model path that does not exist. Zero-row files are allowed (they yield
    no units and a warning in `plan.warnings` and the log).
    """
    check_model_path(spec)
    if spec.input.format == "openai_batch":
        from jobs.inputs.openai_batch import plan_batch

        return plan_batch(spec)
    root, found = discover(spec.input.path)
    with ThreadPoolExecutor(max_workers=max(1, min(FOOTER_THREADS, len(found)))) as ex:
        footers = list(ex.map(lambda t: _read_footer(t[0], t[1]), found))
    files: list[InputFile] = []
    warnings: list[str] = []
    first: tuple[str, dict[str, str]] | None = None
    needed = [spec.input.column] + ([spec.input.id_column] if spec.input.id_column else []) + list(spec.input.passthrough)
    if spec.input.sampling_column:
        needed.append(spec.input.sampling_column)
    units: list[WorkUnit] = []
    file_units: list[list[WorkUnit]] = []
    rows_decoded = 0
    for (source, name, size), (num_rows, schema, groups) in zip(found, footers):
        check_input_schema(spec, name, schema)
        types = {c: _normalize(schema.field(c).type) if c == spec.input.column else type_str(schema.field(c).type)
                 for c in dict.fromkeys(needed)}
        if first is None:
            first = (name, types)
        else:
            for c, t in types.items():
                if first[1][c] != t:
                    raise InputError(f"{name}: column {c!r} has type {t}, but {first[0]} has {first[1][c]} "
                                     f"(all input files must share the schema of the columns a job reads)")
        if num_rows == 0:
            msg = f"{name}: 0 rows (no units)"
            warnings.append(msg)
            log.warning("input file %s", msg)
        cut = cut_file(groups, spec.cluster.unit_rows)
        rows_decoded += cut.rows_decoded
        file_units.append([WorkUnit(index=len(units) + k, source=source, row_start=a, row_end=b)
                           for k, (a, b) in enumerate(cut.ranges)])
        units.extend(file_units[-1])
        files.append(InputFile(path=source, name=name, size=size, num_rows=num_rows, schema=schema,
                               row_groups=groups, staged=cut.staged))
    if spec.input.id_column:
        _check_duplicate_ids(spec, files)
    expected: dict[int, int] = {}
    if spec.input.sampling_column:
        for f, its in zip(files, file_units):
            if f.num_rows:
                expected.update(rows_per_unit(_num_samples_values(f, spec.input.sampling_column),
                                              [(u.index, u.row_start, u.row_end) for u in its],
                                              spec.sampling.num_samples))
    data = {"version": FINGERPRINT_VERSION, **spec.fingerprint_dict()}
    data["model"]["sha256"] = content_identity(spec.model.path, hash_cache)
    if spec.model.tokenizer is not None:
        data["model"]["tokenizer_sha256"] = content_identity(spec.model.tokenizer, hash_cache)
    data["input"] = {**data["input"], "files": [[f.name, f.size, f.num_rows] for f in files]}
    pt_schema = files[0].schema if files else pa.schema([])
    passthrough_fields = [pt_schema.field(c) for c in spec.input.passthrough]
    return JobPlan(units=units, files=files, fingerprint=fingerprint_of(data), num_prompts=sum(f.num_rows for f in files),
                   root=root, fingerprint_data=data, passthrough_fields=passthrough_fields, warnings=warnings,
                   rows_decoded=rows_decoded, expected_rows=expected)


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
