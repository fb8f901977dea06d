"""Finding duplicate keys across many Parquet files in bounded memory.

Keeping every id of a 10-million-prompt job in a Python dict takes gigabytes. Instead:
1. every key becomes one 64-bit number: integer ids are their own key (uint64 ids their
   bits read as int64: one-to-one, so distinct ids keep distinct keys), strings their
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
    if pa.types.is_uint64(arr.type):
        # values above 2**63 - 1 do not cast to int64; the same 64 bits read as int64 are a
        # one-to-one key (the keys only find candidates, which are then compared by value)
        keys = arr.to_numpy(zero_copy_only=False).view(np.int64)
    elif pa.types.is_integer(arr.type):
        keys = arr.cast(pa.int64()).to_numpy(zero_copy_only=False)
    else:
        keys = np.fromiter(map(hash, arr.to_pylist()), dtype=np.int64, count=len(arr))
    return keys, valid


def keys_of(arr: pa.Array) -> np.ndarray:
    """The 64-bit keys of the non-null values of `arr` (see the module docstring)."""
    return _keys(arr)[0]


def _file_keys(read: BatchReader, i: int) -> np.ndarray:
    parts = [keys_of(arr) for arr in read(i)]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def find_duplicates(num_files: int, read: BatchReader, limit: int = 1, threads: int = 8,
                    keys: list[np.ndarray] | None = None) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """Up to `limit` duplicate values across files 0..num_files-1, in (file, row) order of
    the duplicate.

    read(i) yields the column of file i as arrays, in row order. `keys`: each file's
    keys_of() if the caller computed them already (then only files holding a candidate are
    read, once). Each duplicate is (value as str, (file, row) of its first occurrence,
    (file, row) of the repeat). Memory: 8 bytes per key plus one batch per thread. Integer
    and string columns compare by str(value).
    """
    if num_files == 0:
        return []
    if keys is None:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, num_files))) as ex:
            keys = list(ex.map(lambda i: _file_keys(read, i), range(num_files)))
    every = np.concatenate(keys) if keys else np.empty(0, np.int64)
    every.sort()
    candidates = np.unique(every[1:][every[1:] == every[:-1]])
    del every
    if candidates.size == 0:
        return []
    # second pass, over the files holding a candidate: the real values, in file order
    seen: dict[str, tuple[int, int]] = {}
    found = []
    for i in range(num_files):
        if not np.isin(keys[i], candidates).any():
            continue
        row = 0
        for arr in read(i):
            k, valid = _keys(arr)
            hit = np.flatnonzero(np.isin(k, candidates))
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
