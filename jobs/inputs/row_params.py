"""Per-request sampling parameters: `input.sampling_column`, a struct column whose fields
override the job's `sampling` for their row.

    input:
      path: prompts.parquet
      sampling_column: params      # struct<max_tokens: int64, temperature: double, stop: list<string>, ...>

A null struct, or a null field, keeps the job's value. A value the engine refuses makes its
row an error row whose message names the field (the job goes on). The struct's field
names are checked before any work: a name outside ROW_FIELDS stops the job (InputError).

A row's output rows: its num_samples when that is valid, else the job's when null, else 1
(an error row); `row_num_samples` is the one rule the planner (expected rows per unit) and
the workers share.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa

from engine.params import SamplingParams, check_sampling_value
from jobs.errors import InputError

ROW_FIELDS = ("num_samples", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
              "stop_token_ids", "logprobs_mode", "top_logprobs")
"""The sampling parameters a row may set (SamplingParams fields; `calculator` stays per job)."""

_INT_FIELDS = ("num_samples", "max_tokens", "top_k", "seed", "top_logprobs")


def check_sampling_column_type(file_name: str, column: str, t: pa.DataType) -> None:
    """Raise InputError naming the file, the column and the field unless `t` is a struct
    whose fields are all in ROW_FIELDS."""
    if not pa.types.is_struct(t):
        raise InputError(f"{file_name}: input.sampling_column {column!r} has type {t}; expected a struct with "
                         f"fields among {', '.join(ROW_FIELDS)}")
    for i in range(t.num_fields):
        name = t.field(i).name
        if name not in ROW_FIELDS:
            raise InputError(f"{file_name}: input.sampling_column {column!r} has field {name!r}, which is not a "
                             f"per-request sampling parameter (fields: {', '.join(ROW_FIELDS)})")


def _normalise(name: str, v: Any) -> Any:
    # Parquet writers (pandas with nulls) store integers as floats: 5.0 is 5
    if name in _INT_FIELDS and isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def row_num_samples(value: dict[str, Any] | None, default: int) -> int:
    """How many output rows a row with sampling struct `value` has (see the module docstring)."""
    n = None if not value else _normalise("num_samples", value.get("num_samples"))
    if n is None:
        return default
    try:
        return check_sampling_value("num_samples", n)
    except ValueError:
        return 1


def row_params(base: SamplingParams, value: dict[str, Any] | None, where: str = "") -> tuple[SamplingParams, str | None]:
    """The row's SamplingParams: `base` with the struct's non-null fields, and None; or, for a
    bad value, (base with the row's num_samples, "<where>field 'x': must be ..., got ...").

    value: the row's struct as a dict (None keeps `base`). where: prefix for the message.
    """
    if not value:
        return base, None
    changes: dict[str, Any] = {}
    for name, v in value.items():
        if v is None:
            continue
        if name not in ROW_FIELDS:
            return _failed(base, value), f"{where}field {name!r}: not a per-request sampling parameter"
        try:
            changes[name] = check_sampling_value(name, _normalise(name, v))
        except ValueError as e:
            return _failed(base, value), f"{where}field {name!r}: {e}"
    return (dataclasses.replace(base, **changes) if changes else base), None


def _failed(base: SamplingParams, value: dict[str, Any]) -> SamplingParams:
    return dataclasses.replace(base, num_samples=row_num_samples(value, base.num_samples))


def rows_per_unit(num_samples: list[Any] | None, bounds: list[tuple[int, int, int]], default: int) -> dict[int, int]:
    """Output rows of each unit of one file: `num_samples` holds the file's per-row values of
    the struct's num_samples field (None when the struct has no such field); bounds are
    (unit index, row_start, row_end) in that file."""
    if num_samples is None:
        return {index: (end - start) * default for index, start, end in bounds}
    counts = [row_num_samples({"num_samples": v}, default) for v in num_samples]
    return {index: sum(counts[start:end]) for index, start, end in bounds}
