"""Paths and URIs to pyarrow filesystems: local paths, file://, s3://, gs://, hdfs://.

    fs, p = filesystem_for("s3://bucket/run?endpoint_override=127.0.0.1:9000&scheme=http")
    # -> (S3FileSystem(endpoint 127.0.0.1:9000, http), "bucket/run")

- A URI's query string is pyarrow's filesystem options (`endpoint_override`, `scheme`,
  `region`, ...): it is never part of the path and `?` in a URI is never a glob. As in
  pyarrow's `FileSystem.from_uri`, a URI's path is percent-decoded: an object key holding
  `?`, `#` or `%` is written `%3F`, `%23`, `%25` (`s3://bkt/a%3Fb.parquet` is key
  `a?b.parquet`), and `uri_for` writes them so. Without
  options, S3 credentials, region and endpoint come from the standard AWS environment
  (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION / AWS_DEFAULT_REGION,
  AWS_ENDPOINT_URL), as pyarrow's S3FileSystem reads them.
- Filesystems are cached per (scheme, host, options): a worker opening thousands of unit
  files on S3 builds one client, not one per file.
- `redact` removes credentials (user:secret@ and secret options) from a URI before it is
  written into a manifest, a unit file or a message.
"""
from __future__ import annotations

import functools
import os
import re
from urllib.parse import parse_qsl, unquote, urlencode

import pyarrow.fs as pafs

SECRET_OPTIONS = ("access_key", "secret_key", "session_token")


def is_uri(path: str) -> bool:
    return "://" in path


def split_query(uri: str) -> tuple[str, str]:
    """("scheme://host/path", "options") of a URI; a local path is returned whole."""
    if not is_uri(uri):
        return uri, ""
    base, _, query = uri.partition("?")
    return base, query


def with_query(uri: str, query: str) -> str:
    return f"{uri}?{query}" if query else uri


def join(uri: str, name: str) -> str:
    """`name` appended to a directory path or URI, before its options (percent-encoded in a URI)."""
    base, query = split_query(uri)
    if is_uri(uri):
        name = _quote_path(name)
    return with_query(f"{base.rstrip('/')}/{name}" if base else name, query)


@functools.lru_cache(maxsize=64)
def _cached_fs(root: str) -> pafs.FileSystem:
    fs, _ = pafs.FileSystem.from_uri(root)
    return fs


def filesystem_for(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a URI or local path (relative paths: against the
    current directory). Raises pyarrow/ValueError/OSError errors for a URI pyarrow rejects."""
    if not is_uri(uri):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    base, query = split_query(uri)
    scheme, rest = base.split("://", 1)
    if scheme == "file":
        return pafs.LocalFileSystem(), pafs.FileSystem.from_uri(base)[1]
    host, _, key = rest.partition("/")
    key = unquote(key)  # as pyarrow's from_uri: "a%3Fb" is the key "a?b"
    try:
        fs = _cached_fs(with_query(f"{scheme}://{host}", query))
    except (ValueError, OSError) as e:  # pyarrow.ArrowInvalid is a ValueError
        if not query:
            raise
        raise type(e)(f"{e} (`?` starts the URI's options, such as ?endpoint_override=host:port; an object key "
                      f"holding `?` is written %3F)") from None
    if scheme in ("hdfs", "viewfs"):  # the host is the name node; paths are absolute
        return fs, "/" + key.rstrip("/")
    bucket = host.rsplit("@", 1)[-1]  # object stores: the host is the bucket
    return fs, f"{bucket}/{key}".rstrip("/") if key else bucket


def _quote_path(path: str) -> str:
    """`path` as a URI's path: "%", "?" and "#" percent-encoded (filesystem_for decodes them)."""
    return path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def uri_for(template: str, fs_path: str) -> str:
    """The URI of `fs_path` on the filesystem of `template` (same scheme and options)."""
    if not is_uri(template):
        return fs_path
    base, query = split_query(template)
    scheme, rest = base.split("://", 1)
    if scheme == "file":
        return fs_path
    host = rest.split("/", 1)[0]
    userinfo = host.rsplit("@", 1)[0] + "@" if "@" in host else ""
    fs_path = _quote_path(fs_path)
    if scheme in ("hdfs", "viewfs"):
        return with_query(f"{scheme}://{host}{fs_path}", query)
    return with_query(f"{scheme}://{userinfo}{fs_path}", query)


def redact(uri: str) -> str:
    """`uri` without credentials: user:password@ and the access_key / secret_key /
    session_token options are removed. A user:password@ whose secret holds a "/" (AWS
    secret keys may; pasted raw, not percent-encoded) is removed too: what precedes the
    first "@" goes when it holds a ":" (key:secret), as a bucket and path do not before an
    "@" of theirs."""
    if not is_uri(uri):
        return uri
    base, query = split_query(uri)
    base = re.sub(r"^([a-z0-9+.-]+://)(?:[^/@]*|[^/@:]*:[^@]*)@", r"\1", base, flags=re.I)
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k not in SECRET_OPTIONS]
    return with_query(base, urlencode(kept, safe=":/"))


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


__all__ = ["filesystem_for", "is_local", "is_uri", "join", "redact", "split_query", "uri_for", "with_query"]
