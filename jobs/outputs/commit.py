"""Writing files whole: a unit's part file committed once, small files replaced whole.

Commits (`commit_file`, `write_part`): a reader sees a file whole or not at all, and the
first copy to commit wins (a unit may run twice: retries, deadlines):
- local filesystem: written to a temporary name in the same directory, then hard-linked to
  the final name, which fails if it exists (then the temporary file is dropped); where
  hard links are not supported (vfat, exFAT, many FUSE filesystems), renamed with Linux's
  renameat2(RENAME_NOREPLACE), which fails likewise if it exists. Only where neither works
  (a filesystem refusing both, a system without renameat2) is it renamed after checking that
  the final file is absent, with a warning once per process and directory: two copies
  finishing within the same moment may then both rename, the later replacing the earlier;
- S3 (AWS S3, MinIO and other stores that implement conditional writes): the whole file is
  serialised in memory, then written with one PUT of the final object carrying
  `If-None-Match: *`: the store makes it visible whole or not at all, and refuses it (412)
  if the object exists, so a second copy can never replace a committed part. pyarrow's
  S3FileSystem cannot send that header: this one request goes through botocore, with the
  endpoint, region, credentials and addressing of the pyarrow filesystem
  (`conditional_writes`). Whether a store honours the header is learnt once per process and
  store, from a probe object written twice next to the file and removed (a probe whose
  requests fail, the store unreachable or answering 5xx, learns nothing: that commit fails,
  and the next one asks again);
- a store that ignores or refuses the header, other object stores (gs://, hdfs://), and S3
  where botocore is missing or the filesystem assumes a role (role_arn): one PUT, skipped if
  the object exists, with a warning once per process and store: two copies finishing within
  the same moment may both PUT, the later replacing the earlier, whole, with the same rows.
The output lease is created the same way (jobs/outputs/lease.py).

Replacements (`replace_whole`: the manifest, _SUCCESS, the lease's heartbeats): a temporary
file and a rename locally, one PUT on an object store.

Locally the temporary file is fsynced before its link or rename, and the directory after:
otherwise a power loss can leave the new name pointing at an empty or partial file (ext4's
delayed allocation, XFS), a "committed" unit that cannot be read. (A part damaged anyway is
found on resume and its unit run again: OutputDir.committed_units(remove_damaged=True).)
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import threading
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs import uri
from jobs.errors import OutputError
from jobs.outputs.layout import PROBE_PREFIX, part_name

log = logging.getLogger("batchgen")


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


# fsync refused because the file or filesystem cannot sync (not a failed write): nothing to do
_NO_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _write_synced(path: str, data: pa.Buffer | bytes) -> None:
    """Write `data` to the new local file `path` and fsync it, so that a link or rename made
    afterwards never names a file whose data a power loss dropped."""
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        try:
            os.fsync(f.fileno())
        except OSError as e:
            if e.errno not in _NO_SYNC:
                raise


def _fsync_dir(path: str) -> None:
    """fsync directory `path`, making a name just linked or renamed into it durable. Best
    effort: some filesystems cannot open or sync a directory; the file's data is synced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100
# renameat2 refused for this filesystem (or not in this C library): the caller checks, then renames
_NO_RENAME2 = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}
# link refused because the filesystem has no hard links (not a failed write): commit by renaming
_NO_LINKS = {errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK}
_UNCHECKED_DIRS: set[str] = set()  # directories warned about: renamed after a check (see commit_file)


def _renameat2() -> Any:
    """libc's renameat2 (glibc >= 2.28, musl >= 1.2.2), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _rename_noreplace(src: str, dst: str) -> bool | None:
    """Rename `src` to `dst` unless `dst` exists, in one step (RENAME_NOREPLACE: the kernel
    checks and renames under the directory's lock): True if renamed, False if `dst` exists,
    None where this system or filesystem cannot. Raises OSError for other failures."""
    fn = _renameat2()
    if fn is None:
        return None
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in _NO_RENAME2:
        return None
    raise OSError(err, os.strerror(err), src, None, dst)


def _rename_unless_exists(tmp: str, final: str, parent: str) -> bool:
    """The commit where `final`'s filesystem has no hard links (see the module docstring)."""
    renamed = _rename_noreplace(tmp, final)
    if renamed is not None:
        return renamed
    if parent not in _UNCHECKED_DIRS:
        _UNCHECKED_DIRS.add(parent)
        log.warning("%s: this filesystem supports neither hard links nor renames that refuse to replace a file "
                    "(RENAME_NOREPLACE): commits there check whether the file exists, then rename, so two copies of "
                    "a unit finishing in the same moment may both commit it, the later replacing the earlier", parent)
    if os.path.exists(final):
        return False
    os.replace(tmp, final)
    return True


def commit_file(fs: pafs.FileSystem, final: str, data: pa.Buffer | bytes, tmp_prefix: str) -> bool:
    """Make `final` hold `data` unless it exists already (first commit wins); returns whether
    this call committed it. See the module docstring for how, per filesystem; a local
    temporary file is named `<tmp_prefix>-<uuid><final's extension>`. Raises OSError /
    pyarrow errors if the write fails (a local temporary file is removed)."""
    if not uri.is_local(fs):
        client = conditional_writes(fs, final)
        if client is not None:
            return _put_if_absent(client, final, data)
        if exists(fs, final):
            return False
        put_whole(fs, final, data)
        return True
    parent = final.rsplit("/", 1)[0]
    tmp = join(parent, f"{tmp_prefix}-{uuid.uuid4().hex}{os.path.splitext(final)[1]}")
    try:
        _write_synced(tmp, data)
        try:
            os.link(tmp, final)
            committed = True
        except FileExistsError:
            committed = False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            committed = _rename_unless_exists(tmp, final, parent)  # no hard links here (vfat, FUSE)
        if committed:
            _fsync_dir(parent)
        return committed
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def replace_whole(fs: pafs.FileSystem, final: str, data: bytes, tmp_name: str | None = None) -> None:
    """Replace `final` with `data`, whole (see the module docstring); creates its directory.
    tmp_name: the local temporary file's name in that directory (default `.tmp-<uuid>`)."""
    parent = final.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if not uri.is_local(fs):
        put_whole(fs, final, data)
        return
    tmp = join(parent, tmp_name or f".tmp-{uuid.uuid4().hex}")
    _write_synced(tmp, data)
    os.replace(tmp, final)
    _fsync_dir(parent)


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


# ---------------------------------------------------------------------- conditional PUTs on S3

_VERDICTS: dict[tuple[str, str], Any] = {}  # (store, bucket) -> a botocore client, or None: check then write
_VERDICTS_LOCK = threading.Lock()
CONFLICT_RETRIES = 5  # 409 ConditionalRequestConflict: another conditional write of the key was in flight


def _s3_options(fs: pafs.FileSystem) -> dict[str, Any]:
    """The options pyarrow's S3FileSystem was built with (what it pickles)."""
    return dict(fs.__reduce__()[1][0])


def _store_name(opts: dict[str, Any], region: str) -> str:
    ep = opts.get("endpoint_override")
    return f"S3 endpoint {ep}" if ep else f"AWS S3 ({region or 'default region'})"


def _botocore_client(fs: pafs.FileSystem, opts: dict[str, Any]) -> Any:
    """A botocore S3 client that talks to the store of `fs` as pyarrow does: its endpoint and
    scheme, region, credentials (explicit ones, or the standard AWS chain as pyarrow), bucket
    addressing (virtual-hosted unless an endpoint is set, as pyarrow), timeouts, proxy and CA
    file. Raises ImportError without botocore, ValueError for options it cannot carry over."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    if opts.get("role_arn"):
        raise ValueError("the filesystem assumes a role (role_arn), which batchgen does not pass to botocore")
    kw: dict[str, Any] = {"region_name": fs.region or None}
    ep, scheme = opts.get("endpoint_override") or "", opts.get("scheme") or "https"
    if ep:
        kw["endpoint_url"] = ep if "://" in ep else f"{scheme}://{ep}"
    elif scheme == "http":
        kw["use_ssl"] = False
    if opts.get("access_key"):
        kw.update(aws_access_key_id=opts["access_key"], aws_secret_access_key=opts.get("secret_key"),
                  aws_session_token=opts.get("session_token") or None)
    if opts.get("tls_ca_file_path"):
        kw["verify"] = opts["tls_ca_file_path"]
    cfg: dict[str, Any] = {
        "s3": {"addressing_style": "virtual" if opts.get("force_virtual_addressing") or not ep else "path"},
        "retries": {"mode": "standard"},
        # no default CRC checksums (botocore >= 1.36): stores that predate them reject the request
        "request_checksum_calculation": "when_required", "response_checksum_validation": "when_required",
    }
    if opts.get("anonymous"):
        cfg["signature_version"] = UNSIGNED
    for name, key in (("connect_timeout", "connect_timeout"), ("request_timeout", "read_timeout")):
        if (opts.get(name) or -1) > 0:
            cfg[key] = opts[name]
    proxy = opts.get("proxy_options") or {}
    if proxy.get("host"):
        auth = f"{proxy['username']}:{proxy.get('password') or ''}@" if proxy.get("username") else ""
        port = f":{proxy['port']}" if (proxy.get("port") or -1) > 0 else ""
        url = f"{proxy.get('scheme') or 'http'}://{auth}{proxy['host']}{port}"
        cfg["proxies"] = {"http": url, "https": url}
    try:
        config = Config(**cfg)
    except TypeError:  # botocore < 1.36: no checksum settings (and no default checksums either)
        cfg.pop("request_checksum_calculation"), cfg.pop("response_checksum_validation")
        config = Config(**cfg)
    return botocore.session.get_session().create_client("s3", config=config, **kw)


def s3_error_code(e: Exception) -> tuple[str, int]:
    """A botocore ClientError's (error code, HTTP status): ("", 0) for any other exception
    (no answer: a connection or timeout error). Shared with lease.py's conditional writes."""
    response = getattr(e, "response", None) or {}
    return (str((response.get("Error") or {}).get("Code") or ""),
            int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0))


def _put_if_absent(client: Any, final: str, data: pa.Buffer | bytes) -> bool:
    """PUT `data` at `final` (bucket/key) with If-None-Match: *; False if the object exists.
    Raises OSError if the write fails."""
    bucket, key = final.split("/", 1)
    body = data.to_pybytes() if isinstance(data, pa.Buffer) else bytes(data)
    for attempt in range(CONFLICT_RETRIES):
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
            return True
        except Exception as e:  # noqa: BLE001 - botocore's errors, mapped below
            code, status = s3_error_code(e)
            if code == "PreconditionFailed" or status == 412:
                return False  # committed already: first commit wins
            if (code == "ConditionalRequestConflict" or status == 409) and attempt + 1 < CONFLICT_RETRIES:
                time.sleep(0.05 * 2 ** attempt)  # back off, then ask again: the other write decides it
                continue
            raise OSError(f"conditional PUT of s3://{bucket}/{key} failed: {e}") from e
    raise AssertionError("unreachable")  # pragma: no cover


SECOND_PUT_SUCCEEDED = "a second conditional PUT of the same new object succeeded"


def store_refuses(status: int) -> bool:
    """Whether an error answer to a conditional PUT is the store refusing it, as it would
    again (a client error: 400 InvalidArgument, 501 NotImplemented, ...), rather than the
    request failing this time (no answer, a server error, throttling, a timeout, a conflict)."""
    return status == 501 or (400 <= status < 500 and status not in (408, 409, 429))


def _probe(client: Any, final: str) -> str | None:
    """None if the store honours If-None-Match on PUT, else why not: writes a probe object
    next to `final` twice, conditionally (the second must be refused), then removes it.
    Raises OSError when the store did not answer the question (see store_refuses): nothing is
    learnt from a failed request."""
    bucket, key = final.split("/", 1)
    probe = f"{key.rsplit('/', 1)[0] + '/' if '/' in key else ''}{PROBE_PREFIX}if-none-match-{uuid.uuid4().hex}"
    try:
        for attempt in ("first", "second"):
            try:
                client.put_object(Bucket=bucket, Key=probe, Body=b"probe", IfNoneMatch="*")
            except Exception as e:  # noqa: BLE001
                code, status = s3_error_code(e)
                if attempt == "second" and (code == "PreconditionFailed" or status == 412):
                    return None
                if not store_refuses(status):
                    raise OSError(f"the {attempt} PUT of the probe object s3://{bucket}/{probe} failed: {e}") from e
                return f"a conditional PUT was refused: {code or type(e).__name__} {status or ''}".rstrip()
        return SECOND_PUT_SUCCEEDED
    finally:
        try:
            client.delete_object(Bucket=bucket, Key=probe)
        except Exception as e:  # noqa: BLE001 - best effort
            log.warning("could not remove the probe object s3://%s/%s: %s", bucket, probe, e)


def conditional_writes(fs: pafs.FileSystem, final: str) -> Any:
    """The botocore client that commits `final` (a path in `fs`, an object store) with
    If-None-Match: *, or None where commits check then write (see the module docstring).
    Learnt once per process and store (endpoint, options and bucket); a store without it is
    warned about once, naming it. Raises OSError, learning nothing, when the probe's requests
    fail (the store unreachable, 5xx, throttling): the next call asks again."""
    bucket = final.split("/", 1)[0]
    s3_type = getattr(pafs, "S3FileSystem", None)  # absent from a pyarrow built without S3
    is_s3 = s3_type is not None and isinstance(fs, s3_type)
    if is_s3:
        opts = _s3_options(fs)
        store = (json.dumps(opts, sort_keys=True, default=str), bucket)
    else:
        opts, store = {}, (type(fs).__name__, bucket)
    with _VERDICTS_LOCK:
        if store in _VERDICTS:
            return _VERDICTS[store]
        client, why = None, None
        if not is_s3:
            name, why = f"{fs.type_name} filesystem", "batchgen makes conditional writes on S3 only"
        else:
            name = _store_name(opts, fs.region)
            try:
                client = _botocore_client(fs, opts)
            except ImportError:
                why = "botocore, which sends the header, is not installed (pip install botocore)"
            except ValueError as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 - e.g. an endpoint botocore rejects: as if unsupported
                why = f"botocore could not be set up for it: {e}"
            if client is not None:
                try:
                    why = _probe(client, final)
                    if why == SECOND_PUT_SUCCEEDED:
                        # once more under a new name: a driver cleaning up leftovers of a crash
                        # (OutputDir.cleanup_temp_files) may have removed the probe between the
                        # PUTs; a store that ignores the header lets the second PUT through again
                        why = _probe(client, final)
                except Exception as e:  # noqa: BLE001 - not answered: nothing learnt, asked again next time
                    raise OSError(f"{name}, bucket {bucket}: could not learn whether it honours If-None-Match "
                                  f"(conditional writes): {e}") from e
                if why is not None:
                    client = None
        if why is not None:
            log.warning("%s, bucket %s, does not honour If-None-Match for batchgen (%s): unit commits there check "
                        "whether the object exists, then write it, so two copies of a unit finishing in the same "
                        "moment may both write it, the later replacing the earlier, whole, with the same rows",
                        name, bucket, why)
        _VERDICTS[store] = client
        return client
