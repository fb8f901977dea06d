"""The job fingerprint: what identifies a job's output, so that a rerun resumes it and
another job is refused.

    data = fingerprint_data(spec, scan.fingerprint_files, hash_cache)
    fingerprint_of(data)          # sha256 hex of its canonical JSON

The data: FINGERPRINT_VERSION, the spec fields that decide the rows
(JobSpec.fingerprint_dict: model identity, resolved dtype and device kind, sampling, tools,
input columns, unit_rows), each input file's identity from its reader (name, size, rows; a
Parquet file's footer sha256 and modification time, an OpenAI batch file's sha256), and the
checkpoint's content hashes.

Content hashes: names and sizes do not identify weights (a retrained checkpoint usually has
the same file sizes), so the data holds the SHA-256 of every file under `model.path` (and
`model.tokenizer`), hidden files excepted (an openai_batch job's manifest holds them instead:
`checkpoint_identity`, jobs/outputs/output_dir.py weights_problem). Hashing a large checkpoint takes a while, so the
hashes are cached in the output directory (`_batchgen/checkpoint-sha256.json`), keyed by
the file's absolute path, size, modification time, inode change time and inode number: a
file is read again only when one of those changed. The change time and inode are there for
a file replaced with its old modification time kept (`cp -p`, `rsync -a`, `tar x`, `touch
-r`): no program can set a change time back, so a rewritten file never answers from the
cache with its previous content's hash.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jobs.outputs.layout import CACHE_FILE

CHUNK = 8 << 20
# 2: checkpoint content hashes, resolved device kind and dtype, row-group units; the stop
# token kept in `tokens`, the stop_reason column, per-row sampling parameters
# 3: each Parquet input's footer sha256 and modification time; chat jobs' template date
# 4: the weight_version column; tool_calls' name, arguments, latency_s and forced_start
# (sampling.top_logprobs, only when > 0, added its columns only to the outputs of jobs that
# set it: other outputs keep their schema and fingerprint, and resume)
FINGERPRINT_VERSION = 4


def fingerprint_of(data: dict[str, Any]) -> str:
    """sha256 hex of the canonical JSON of `data` (sorted keys, no whitespace)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def fingerprint_data(spec: Any, files: list[list[Any]], cache: "HashCache | None" = None,
                     hash_checkpoint: bool = True) -> dict[str, Any]:
    """The fingerprint data of a job (see the module docstring): `files` holds each input
    file's identity; the checkpoint's (and tokenizer's) content hashes are added unless
    `hash_checkpoint` is False (openai_batch plans, InputScan.hash_checkpoint)."""
    data = {"version": FINGERPRINT_VERSION, **spec.fingerprint_dict()}
    if hash_checkpoint:
        data["model"].update(checkpoint_identity(spec, cache))
    data["input"] = {**data["input"], "files": files}
    return data


def checkpoint_identity(spec: Any, cache: "HashCache | None" = None) -> dict[str, Any]:
    """{"sha256": the checkpoint's content_identity, "tokenizer_sha256": model.tokenizer's
    (only when set)}: in the fingerprint data's "model", or (openai_batch jobs, whose
    fingerprint leaves them out) in the manifest's `checkpoint_sha256`."""
    out = {"sha256": content_identity(spec.model.path, cache)}
    if spec.model.tokenizer is not None:
        out["tokenizer_sha256"] = content_identity(spec.model.tokenizer, cache)
    return out


def changed_files(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The files whose content differs between two checkpoint_identity dicts ("tokenizer/"
    before a tokenizer's), sorted: changed, added or removed."""
    out = []
    for key, prefix in (("sha256", ""), ("tokenizer_sha256", "tokenizer/")):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if not isinstance(a, dict) or not isinstance(b, dict):
            out.append(prefix or "the checkpoint")
            continue
        out += [prefix + name for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    return out


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
    """sha256 by (absolute path, size, mtime_ns, ctime_ns, inode); `entries` is the JSON-able
    dict (an entry without ctime_ns or inode, from an older release, is read again).

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
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
        if isinstance(hit, dict) and isinstance(hit.get("sha256"), str) and all(hit.get(k) == v for k, v in stamp.items()):
            return hit["sha256"]
        digest = sha256_file(f)
        self.entries[key] = {**stamp, "sha256": digest}
        self.changed = True
        return digest


def content_identity(path: str, cache: HashCache | None = None) -> dict[str, str] | str:
    """{relative name: sha256} of a checkpoint path's files (built-in names resolved to their
    files); "tiny-random" for the built-in untrained model, which has none."""
    from engine.loading.builtin import TINY_RANDOM, resolve_builtin

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


def load_hash_cache(out: Any) -> HashCache:
    """The checkpoint hash cache stored in output directory `out` (an OutputDir; empty if
    absent or unreadable)."""
    try:
        return HashCache.loads(out.read_text(CACHE_FILE))
    except Exception:  # noqa: BLE001 - a cache: an unreadable one is rebuilt
        return HashCache()


def save_hash_cache(out: Any, cache: HashCache) -> None:
    """Store `cache` in output directory `out` if hashing added to it."""
    if cache.changed:
        out.write_text(CACHE_FILE, cache.dumps())
