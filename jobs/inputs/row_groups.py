"""Cutting an input file into work units along its Parquet row groups.

Parquet decodes whole row groups (pyarrow cannot start reading in the middle of one), so a
unit that needs 256 rows of a 1,048,576-row group decodes all of them. Units are therefore
cut along row groups:

- consecutive row groups no larger than `unit_rows` are packed whole into units of at most
  `unit_rows` rows: each unit decodes exactly its own rows;
- a row group of up to 2 x `unit_rows` rows is cut into two near-equal pieces, each
  decoding the whole group: at most 2x its rows (2x + 1 for an odd group);
- a file with a larger row group is *staged* (jobs/inputs/staging.py): its needed columns are
  rewritten once, before the job runs, with `unit_rows`-row groups, and its units are plain
  `unit_rows` cuts of that copy. Staging decodes the file once, its units once more: 2x.

`batchgen prepare` writes 256-row groups (the default unit_rows), so its files are never staged.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FileCut:
    """How one file becomes units.

    ranges: [row_start, row_end) of each unit, in order, covering the file.
    rows_decoded: rows the units decode in all (staging included, when `staged`).
    staged: the file has a row group larger than 2 x unit_rows and is read from a
        re-chunked copy (then `ranges` are plain unit_rows cuts).
    """

    ranges: tuple[tuple[int, int], ...]
    rows_decoded: int
    staged: bool


def plain_cuts(num_rows: int, unit_rows: int) -> tuple[tuple[int, int], ...]:
    return tuple((a, min(a + unit_rows, num_rows)) for a in range(0, num_rows, unit_rows))


def _halves(g: int) -> tuple[tuple[int, int], ...]:
    return ((0, (g + 1) // 2), ((g + 1) // 2, g))


def cut_file(row_groups: list[int] | tuple[int, ...], unit_rows: int) -> FileCut:
    """Units of a file whose row groups have `row_groups` rows each (in file order)."""
    num_rows = sum(row_groups)
    if any(g > 2 * unit_rows for g in row_groups):
        return FileCut(plain_cuts(num_rows, unit_rows), 2 * num_rows, True)
    ranges: list[tuple[int, int]] = []
    decoded = 0
    start = pos = 0  # the open unit is [start, pos), made of whole groups
    for g in row_groups:
        if g == 0:
            continue
        if g > unit_rows:
            if pos > start:
                ranges.append((start, pos))
                decoded += pos - start
            pieces = _halves(g)  # unit_rows < g <= 2 x unit_rows here
            ranges.extend((pos + a, pos + b) for a, b in pieces)
            decoded += g * len(pieces)
            pos += g
            start = pos
            continue
        if pos + g - start > unit_rows:
            ranges.append((start, pos))
            decoded += pos - start
            start = pos
        pos += g
    if pos > start:
        ranges.append((start, pos))
        decoded += pos - start
    return FileCut(tuple(ranges), decoded, False)
