"""The input reader interface: what the planner and the workers ask of an input format.

    from jobs.inputs import reader_for
    scan = reader_for(spec).scan(spec)          # the planner: files found, checked, cut into units
    reader = reader_for(spec, names, state)     # a worker's task: the same reader, with what the scan left
    requests, rows_decoded = reader.read_unit(unit, tokenizer, params)

Each input.format is one reader behind this interface: jobs/inputs/parquet.py (text, chat,
tokens: Parquet files) and jobs/inputs/openai_batch.py (openai_batch: an OpenAI Batch JSONL
file). The planner (jobs/plan/) and the task (jobs/task.py) import neither.

Sources (`resolve`, `open_input`): a local path (relative paths resolve against the current
directory), a URI pyarrow understands (file://, s3://, gs://, hdfs://...; filesystem options
after `?`, jobs/uri.py), or `package://NAME`, a file shipped in jobs/data/ (the demo's
prompts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.fs as pafs

from cluster.unit import UnitRequest, WorkUnit
from jobs import uri
from jobs.errors import InputError

PACKAGE_PREFIX = "package://"
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True)
class InputFile:
    """One input file.

    path: how a worker opens it (absolute local path, URI, or package://NAME);
    name: its path relative to the input root (used in prompt ids and the fingerprint);
    size: bytes; num_rows: rows (request lines of a batch file); schema: its Arrow schema
    (empty for a batch file); row_groups: rows of each Parquet row group; staged: read from
    a re-chunked copy (jobs/inputs/row_groups.py, jobs/inputs/staging.py); content: what
    identifies its bytes beyond size and rows, for the fingerprint (a Parquet file: its
    footer's sha256 and modification time; see jobs/inputs/parquet.py).
    """

    path: str
    name: str
    size: int
    num_rows: int
    schema: pa.Schema
    row_groups: tuple[int, ...] = ()
    staged: bool = False
    content: dict = field(default_factory=dict)  # what identifies its bytes beyond size and rows


@dataclass
class InputScan:
    """What a reader's scan found: the planner's material for the JobPlan (jobs/plan/planner.py).

    root: the input root; files; units (indices from 0, in file order); fingerprint_files:
    one identity per file for the fingerprint ([name, size, rows] or more); passthrough_fields:
    the output columns the input adds to every row; rows_decoded: input rows the units (and
    staging) will decode; expected_rows: output rows per unit index where they are not its
    prompts x sampling.num_samples; warnings: for the log (files with no rows); reader_state:
    what the workers' reader needs besides the units (openai_batch: each unit's byte range);
    hash_checkpoint: whether the fingerprint holds the checkpoint's content hashes
    (openai_batch plans never did; see jobs/inputs/openai_batch.py).
    """

    root: str
    files: list[InputFile]
    units: list[WorkUnit]
    fingerprint_files: list[list[Any]]
    passthrough_fields: list[pa.Field]
    rows_decoded: int = 0
    expected_rows: dict[int, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    reader_state: Any = None
    hash_checkpoint: bool = True


class InputReader(Protocol):
    """One input format (input.format), for the planner and the workers; pickled to every
    worker inside its task, so it holds plain data only.

    scan(spec): open the input: find its files, check them against the spec and cut them
        into units of at most cluster.unit_rows rows. Raises InputError naming the file
        and column (exit code 2) for anything that stops the job.
    read_unit(unit, tokenizer, params): one UnitRequest per row of `unit`, in row order,
        tokenized with the worker's tokenizer; `params` is the job's SamplingParams. A bad
        row becomes a request with an error, never an exception; raises only when the unit
        cannot be read. Returns the requests and how many input rows were decoded.
    """

    def scan(self, spec: Any) -> InputScan: ...

    def read_unit(self, unit: WorkUnit, tokenizer: Any, params: Any) -> tuple[list[UnitRequest], int]: ...


# ---------------------------------------------------------------- sources

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


def source_for(canonical_root: str, fs_path: str) -> str:
    """The source string of a file found under a root (keeps the root's scheme and options)."""
    if canonical_root.startswith(PACKAGE_PREFIX):
        return PACKAGE_PREFIX + os.path.relpath(fs_path, DATA_DIR).replace(os.sep, "/")
    return uri.uri_for(canonical_root, fs_path)


def open_input(source: str) -> pa.NativeFile:
    """Open an input file (a WorkUnit.source / InputFile.path) for random access reads."""
    fs, p, _ = resolve(source)
    return fs.open_input_file(p)


def modified_ns(source: str) -> int | None:
    """The file's modification time in nanoseconds where its filesystem gives one (local
    files, S3's LastModified), None elsewhere and for package:// files, whose time is the
    install's, not the content's. Raises OSError / ArrowException as the filesystem does."""
    if source.startswith(PACKAGE_PREFIX):
        return None
    fs, p, _ = resolve(source)
    return fs.get_file_info(p).mtime_ns
