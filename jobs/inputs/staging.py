"""Staging: re-chunking input files whose row groups are too large for their units.

A file with a row group of more than 2 x unit_rows rows (pyarrow writes 1,048,576-row
groups by default) would make each of its units decode that whole group
(jobs/inputs/row_groups.py). Before the job runs, the driver rewrites the columns the job reads from such a file into
`output.path/_batchgen/staged/`, with `unit_rows`-row groups, reading the original once as
a stream (bounded memory, files in parallel); the units then read the copy. Rows decoded:
the file once here, then once by its units.

A staged copy carries its origin (file name, size, rows, unit_rows, columns) in its Parquet
metadata; a resumed job reuses a copy whose metadata and row count match and rewrites any
other (a copy cut short by a crash has fewer rows).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.unit import WorkUnit
from jobs import uri
from jobs.inputs.reader import InputFile, open_input

log = logging.getLogger("batchgen")

STAGED_DIR = "_batchgen/staged"
META_STAGED = b"batchgen.staged"
THREADS = 4
READ_BATCH = 65536


def staged_name(f: InputFile, unit_rows: int, columns: list[str]) -> str:
    key = json.dumps([f.name, f.size, f.num_rows, unit_rows, columns]).encode()
    return f"{STAGED_DIR}/{hashlib.sha256(key).hexdigest()[:16]}.parquet"


def _origin(f: InputFile, unit_rows: int, columns: list[str]) -> dict[str, Any]:
    return {"name": f.name, "size": f.size, "num_rows": f.num_rows, "unit_rows": unit_rows, "columns": columns}


def _is_valid(out: Any, rel: str, origin: dict[str, Any]) -> bool:
    try:
        with out.fs.open_input_file(out.fs_path(rel)) as fh:
            md = pq.ParquetFile(fh).metadata
    except (OSError, pa.ArrowException):
        return False
    meta = (md.metadata or {}).get(META_STAGED)
    return md.num_rows == origin["num_rows"] and meta is not None and json.loads(meta) == origin


def _stage_one(out: Any, f: InputFile, unit_rows: int, columns: list[str]) -> tuple[str, int]:
    """Write the staged copy of `f` unless a valid one exists; (its relative name, rows decoded).

    Locally through a temporary file and a rename; on an object store straight to the
    final object (a copy cut short by a failure is caught by _is_valid and rewritten).
    """
    rel = staged_name(f, unit_rows, columns)
    origin = _origin(f, unit_rows, columns)
    if _is_valid(out, rel, origin):
        return rel, 0
    schema = pa.schema([f.schema.field(c) for c in columns]).with_metadata({META_STAGED: json.dumps(origin).encode()})
    final = out.fs_path(rel)
    out.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    local = uri.is_local(out.fs)
    # a uuid-named temporary (as in jobs/outputs/commit.py) that the stream below creates with
    # the umask's usual permissions: workers running as another user must read the copy
    target = os.path.join(os.path.dirname(final), f".tmp-staged-{uuid.uuid4().hex}.parquet") if local else final
    decoded = 0
    try:
        with open_input(f.path) as fh, out.fs.open_output_stream(target) as sink, \
                pq.ParquetWriter(sink, schema, compression="zstd") as w:
            # groups of exactly unit_rows rows whatever the read batches' sizes: the rows short
            # of a whole group wait for the next batch (fewer than unit_rows: bounded memory)
            pending: list[pa.RecordBatch] = []
            held = 0
            for batch in pq.ParquetFile(fh).iter_batches(columns=columns, batch_size=READ_BATCH):
                decoded += batch.num_rows
                pending.append(batch)
                held += batch.num_rows
                if held >= unit_rows:
                    t = pa.Table.from_batches(pending)
                    whole = held - held % unit_rows
                    w.write_table(t.slice(0, whole), row_group_size=unit_rows)
                    pending, held = t.slice(whole).to_batches(), held - whole
            if held:
                w.write_table(pa.Table.from_batches(pending), row_group_size=unit_rows)
        if local:
            os.replace(target, final)
    finally:
        if local and os.path.exists(target):
            os.unlink(target)
    return rel, decoded


def stage_inputs(plan: Any, out: Any, unit_rows: int, columns: list[str],
                 units: list[WorkUnit]) -> tuple[list[WorkUnit], dict[str, str], int]:
    """Stage every file of `plan` (a JobPlan) marked `staged` into the output directory `out`
(an OutputDir), and point `units` at the copies.

    Returns (units with their sources replaced, {staged source: input file name}, input
    rows decoded while staging). Raises OSError / pyarrow errors when a file cannot be
    read or written (the job stops before any unit runs).
    """
    files = plan.staged_files
    if not files:
        return units, {}, 0
    log.info("staging %d input file(s) whose row groups are larger than 2 x unit_rows (%d): rewriting %s with "
             "%d-row groups into %s", len(files), unit_rows, ", ".join(columns), unit_rows, STAGED_DIR)
    with ThreadPoolExecutor(max_workers=min(THREADS, len(files))) as ex:
        done = list(ex.map(lambda f: _stage_one(out, f, unit_rows, columns), files))
    source_of = {f.path: uri.join(out.path, rel) if uri.is_uri(out.path) else out.fs_path(rel)
                 for f, (rel, _) in zip(files, done)}
    names = {source_of[f.path]: f.name for f in files}
    moved = [WorkUnit(u.index, source_of[u.source], u.row_start, u.row_end) if u.source in source_of else u
             for u in units]
    return moved, names, sum(d for _, d in done)
