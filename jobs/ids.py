"""Finding duplicate keys across many Parquet files in bounded memory.

Keeping every id of a 10-million-prompt job in a Python dict takes gigabytes. Instead:
1. every key becomes one 64-bit number: integer ids are their own key, strings their
   Python hash (stable within this process), so 10 million keys are 80 MB of numpy;
2. the numbers are sorted; equal neighbours are candidate duplicates (real duplicates, or
   one hash collision in about 2^64 / n^2);
3. a second pass reads only the files holding candidates and compares the real values.

Files are read in parallel (pyarrow releases the GIL while it reads and decodes).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

# reads one column of one file as record batches (the caller opens files its own way)
BatchReader = Callable[[int], Iterator[pa.Array]]


def _keys(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit keys, row positions) of the non-null values of `arr`."""
    if arr.null_count:
        valid = np.flatnonzero(arr.is_valid().to_numpy(zero_copy_only=False))
        arr = arr.drop_null()
    else:
        valid = None
    if pa.types.is_integer(arr.type):
        keys = arr.cast(pa.int64()).to_numpy(zero_copy_only=False)
    else:
        keys = np.fromiter(map(hash, arr.to_pylist()), dtype=np.int64, count=len(arr))
    return keys, valid


def _file_keys(read: BatchReader, i: int) -> np.ndarray:
    parts = []
    for arr in read(i):
        keys, _ = _keys(arr)
        parts.append(keys)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def find_duplicates(num_files: int, read: BatchReader, limit: int = 1,
                    threads: int = 8) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """Up to `limit` duplicate values across files 0..num_files-1, in (file, row) order of
    the duplicate.

    read(i) yields the column of file i as arrays, in row order (it is called twice per
    file holding a candidate). Each duplicate is (value as str, (file, row) of its first
    occurrence, (file, row) of the repeat). Memory: 8 bytes per key plus one batch per
    thread. Integer and string columns compare by str(value).
    """
    if num_files == 0:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(threads, num_files))) as ex:
        per_file = list(ex.map(lambda i: _file_keys(read, i), range(num_files)))
    has = [k.size > 0 for k in per_file]
    keys = np.concatenate(per_file)
    del per_file
    keys.sort()
    candidates = np.unique(keys[1:][keys[1:] == keys[:-1]])
    del keys
    if candidates.size == 0:
        return []
    # second pass: the real values of candidate keys, in file order
    seen: dict[str, tuple[int, int]] = {}
    found = []
    for i in range(num_files):
        if not has[i]:
            continue
        row = 0
        for arr in read(i):
            keys, valid = _keys(arr)
            hit = np.flatnonzero(np.isin(keys, candidates))
            if hit.size:
                values = arr.drop_null().take(pa.array(hit)).to_pylist()
                rows = (valid[hit] if valid is not None else hit) + row
                for v, r in zip(values, rows.tolist()):
                    key = str(v)
                    if key in seen:
                        found.append((key, seen[key], (i, r)))
                        if len(found) >= limit:
                            return found
                    else:
                        seen[key] = (i, r)
            row += len(arr)
    return found  # fewer than limit: the rest were hash collisions


def find_duplicate(num_files: int, read: BatchReader, threads: int = 8) -> tuple[str, tuple[int, int], tuple[int, int]] | None:
    """The first duplicate (see find_duplicates), or None."""
    found = find_duplicates(num_files, read, 1, threads)
    return found[0] if found else None
