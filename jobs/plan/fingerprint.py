"""Content hashes of a checkpoint's files, for the job fingerprint.

Names and sizes do not identify weights: a retrained checkpoint usually has the same file
sizes. The fingerprint therefore holds the SHA-256 of every file under `model.path` (and
`model.tokenizer`), hidden files excepted. Hashing a large checkpoint takes a while, so the
hashes are cached in the output directory (`_batchgen/checkpoint-sha256.json`), keyed by
the file's absolute path, size and modification time: a file is read again only when one
of those changed.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CACHE_FILE = "_batchgen/checkpoint-sha256.json"
CHUNK = 8 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(path: str) -> list[Path]:
    """Every non-hidden file under a local checkpoint path (the path itself if a file), sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    return [f for f in sorted(p.rglob("*")) if f.is_file()
            and not any(part.startswith(".") for part in f.relative_to(p).parts)]


class HashCache:
    """sha256 by (absolute path, size, mtime_ns); `entries` is the JSON-able dict.

    load(text) / dumps(): the cache file's contents; `changed`: whether hash() added any.
    """

    def __init__(self, entries: dict[str, Any] | None = None) -> None:
        self.entries: dict[str, Any] = dict(entries or {})
        self.changed = False

    @classmethod
    def loads(cls, text: str | None) -> "HashCache":
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            data = {}
        return cls(data if isinstance(data, dict) else {})

    def dumps(self) -> str:
        return json.dumps(self.entries, indent=1, sort_keys=True)

    def hash(self, f: Path) -> str:
        st = f.stat()
        key = str(f.resolve())
        hit = self.entries.get(key)
        if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            return hit["sha256"]
        digest = sha256_file(f)
        self.entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self.changed = True
        return digest


def content_identity(path: str, cache: HashCache | None = None) -> dict[str, str] | str:
    """{relative name: sha256} of a checkpoint path's files (built-in names resolved to their
    files); "tiny-random" for the built-in untrained model, which has none."""
    from engine.builtin import TINY_RANDOM, resolve_builtin

    if path == TINY_RANDOM:
        return TINY_RANDOM
    path = str(resolve_builtin(path))
    cache = cache if cache is not None else HashCache()
    root = Path(path)
    out = {}
    for f in checkpoint_files(path):
        name = f.name if root.is_file() else f.relative_to(root).as_posix()
        out[name] = cache.hash(f)
    return out
