"""jobs.inputs.row_groups (units along Parquet row groups) and jobs.ids (duplicates in bounded memory)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.ids import find_duplicate, find_duplicates
from jobs.inputs.row_groups import cut_file


@given(groups=st.lists(st.integers(0, 40), max_size=30), unit_rows=st.integers(1, 16))
@settings(max_examples=300, deadline=None)
def test_cuts_cover_the_file_and_decode_at_most_twice(groups, unit_rows):
    """Whatever the row groups: units are consecutive, cover every row once, hold at most
    unit_rows rows, decode at most 2x the file (staging included), and each unit of an
    unstaged file decodes at most 2x its rows (+1 for half of an odd row group)."""
    cut = cut_file(groups, unit_rows)
    n = sum(groups)
    pos = 0
    for a, b in cut.ranges:
        assert a == pos and 0 < b - a <= unit_rows
        pos = b
    assert pos == n
    assert cut.rows_decoded <= 2 * n
    assert cut.staged == any(g > 2 * unit_rows for g in groups)
    if not cut.staged:
        starts = np.cumsum([0] + list(groups))
        for a, b in cut.ranges:  # rows decoded = every row group the unit overlaps
            decoded = sum(g for g, s in zip(groups, starts) if g and s < b and s + g > a)
            assert decoded <= 2 * (b - a) + 1, (groups, unit_rows, (a, b), decoded)


def test_cut_examples():
    # small groups packed whole: each unit decodes its own rows
    c = cut_file([3, 3, 3, 3], 4)
    assert c.ranges == ((0, 3), (3, 6), (6, 9), (9, 12)) and c.rows_decoded == 12 and not c.staged
    c = cut_file([2, 2, 2, 2], 4)
    assert c.ranges == ((0, 4), (4, 8)) and c.rows_decoded == 8
    # a group up to 2x unit_rows is cut in two halves that each decode it (2x)
    c = cut_file([2, 2, 5, 1, 1], 4)
    assert c.ranges == ((0, 4), (4, 7), (7, 9), (9, 11)) and c.rows_decoded == 4 + 2 * 5 + 2
    # pyarrow's default 1Mi-row group: staged, plain cuts of the copy, 2x in all
    c = cut_file([1 << 20], 256)
    assert c.staged and len(c.ranges) == 4096 and c.rows_decoded == 2 << 20
    assert cut_file([], 4).ranges == () and cut_file([0, 0], 4).ranges == ()


def _reader(files):
    def read(i):
        for chunk in files[i]:
            yield chunk
    return read


def test_find_duplicates_strings_ints_nulls_across_files():
    files = [[pa.array(["a", None, "b"]), pa.array(["c"])], [pa.array([None, "d", "b"])], [pa.array(["e", "a"])]]
    assert find_duplicates(3, _reader(files), limit=5) == [("b", (0, 2), (1, 2)), ("a", (0, 0), (2, 1))]
    assert find_duplicate(3, _reader(files)) == ("b", (0, 2), (1, 2))
    ints = [[pa.array([1, 2, 3], pa.int64())], [pa.array([4, None, 2], pa.int32())]]
    assert find_duplicate(2, _reader(ints)) == ("2", (0, 1), (1, 2))
    assert find_duplicate(2, _reader([[pa.array(["x"])], [pa.array(["y"])]])) is None
    assert find_duplicate(0, _reader([])) is None


def test_find_duplicates_uint64_ids_above_int64():
    """uint64 ids above 2**63 - 1 (which do not cast to int64) get keys, distinct for distinct
    ids: a real duplicate is found and named by its unsigned value, nulls skipped, and
    distinct ids (2**63 and 0 share the low 63 bits) are not reported."""
    big = 2**63 + 5
    files = [[pa.array([big, None, 2**64 - 1], pa.uint64())], [pa.array([7, 2**63, big], pa.uint64())]]
    assert find_duplicates(2, _reader(files), limit=5) == [(str(big), (0, 0), (1, 2))]
    distinct = [[pa.array([2**63, 1], pa.uint64())], [pa.array([0, 2**63 + 1], pa.uint64())]]
    assert find_duplicate(2, _reader(distinct)) is None


def test_hash_collisions_are_not_duplicates(monkeypatch):
    """Equal 64-bit keys are only candidates: the second pass compares real values."""
    import jobs.ids

    monkeypatch.setattr(jobs.ids, "hash", lambda s: 7, raising=False)  # every string collides
    files = [[pa.array(["p", "q"])], [pa.array(["r", "q"])]]
    assert find_duplicates(2, _reader(files), limit=5) == [("q", (0, 1), (1, 1))]
    assert find_duplicate(2, _reader([[pa.array(["p"])], [pa.array(["r"])]])) is None


@pytest.mark.parametrize("n", [200_000])
def test_find_duplicate_memory_is_keys_not_strings(n):
    """200k ids in 20 files: found with 8-byte keys (the values are never all held)."""
    files = [[pa.array([f"prompt-{k:09d}" for k in range(i * n // 20, (i + 1) * n // 20)])] for i in range(20)]
    assert find_duplicate(20, _reader(files)) is None
    files[13].append(pa.array(["prompt-000000005"]))
    assert find_duplicate(20, _reader(files)) == ("prompt-000000005", (0, 5), (13, n // 20))
