"""Writing files whole: a unit's part file committed once, small files replaced whole.

Commits (`commit_file`, `write_part`): a reader sees a file whole or not at all, and the
first copy to commit wins (a unit may run twice: retries, deadlines):
- local filesystem: written to a temporary name in the same directory, then hard-linked to
  the final name, which fails if it exists (then the temporary file is dropped); where
  hard links are not supported, renamed unless the final file exists;
- object store: the whole file is serialised in memory, then written with one PUT of the
  final object, which S3 makes visible whole or not at all; skipped if the object exists.
  (Two copies finishing within the same moment may both PUT: the later one replaces the
  earlier, whole, with the same rows.)
The output lease is created the same way (jobs/outputs/lease.py).

Replacements (`replace_whole`: the manifest, _SUCCESS, the lease's heartbeats): a temporary
file and a rename locally, one PUT on an object store.
"""
from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs import uri
from jobs.errors import OutputError
from jobs.outputs.layout import part_name


def resolve_output(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for an output path; relative local paths resolve against
    the current working directory. Raises OutputError for a URI pyarrow cannot open."""
    try:
        return uri.filesystem_for(path)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise OutputError(f"output.path {uri.redact(path)}: cannot open this URI: {e}") from None


def canonical_output(path: str) -> str:
    """The output path as workers should use it: absolute local path or the URI itself."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def join(base: str, name: str) -> str:
    """`name` inside directory `base` (a path inside a filesystem)."""
    return f"{base.rstrip('/')}/{name}" if base else name


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def put_whole(fs: pafs.FileSystem, path: str, data: bytes | pa.Buffer) -> None:
    """Write `data` as one object on an object store (one PUT on close: visible whole or not
    at all). Never inside `with`: closing a stream after a failed write would complete the
    upload with what was written so far."""
    f = fs.open_output_stream(path)
    f.write(data)
    f.close()


def commit_file(fs: pafs.FileSystem, final: str, data: pa.Buffer | bytes, tmp_prefix: str) -> bool:
    """Make `final` hold `data` unless it exists already (first commit wins); returns whether
    this call committed it. See the module docstring for how, per filesystem; a local
    temporary file is named `<tmp_prefix>-<uuid><final's extension>`. Raises OSError /
    pyarrow errors if the write fails (a local temporary file is removed)."""
    if not uri.is_local(fs):
        if exists(fs, final):
            return False
        put_whole(fs, final, data)
        return True
    parent = final.rsplit("/", 1)[0]
    tmp = join(parent, f"{tmp_prefix}-{uuid.uuid4().hex}{os.path.splitext(final)[1]}")
    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
        try:
            os.link(tmp, final)
            committed = True
        except FileExistsError:
            committed = False
        except OSError:  # no hard links here (some network filesystems): rename, unless it exists
            committed = not os.path.exists(final)
            if committed:
                os.replace(tmp, final)
        return committed
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def replace_whole(fs: pafs.FileSystem, final: str, data: bytes) -> None:
    """Replace `final` with `data`, whole (see the module docstring); creates its directory."""
    parent = final.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if not uri.is_local(fs):
        put_whole(fs, final, data)
        return
    tmp = join(parent, f".tmp-{uuid.uuid4().hex}")
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    os.replace(tmp, final)


def write_part(output_path: str, index: int, table: pa.Table) -> str:
    """Commit one unit's table as part-<index>.parquet (see the module docstring: whole or
    not at all, first commit wins). A crash before the commit leaves at most a local
    temporary file, which readers ignore and OutputDir.cleanup_temp_files removes. Returns
    the committed file's path (local) or URI. Raises OSError / pyarrow errors if the write
    fails."""
    fs, base = resolve_output(output_path)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    commit_file(fs, join(base, part_name(index)), sink.getvalue(), f".tmp-part-{index:06d}")
    return join(base, part_name(index)) if uri.is_local(fs) else uri.join(output_path, part_name(index))
