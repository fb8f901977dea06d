"""PoolTask: a job's prompt and row rules for a GenerationPool call (cluster.unit.PromptTask).

A call's prompts are cut into units that carry them (WorkUnit.payload, a `PromptBatch`);
a worker turns them into requests and its outputs into rows with a job's own code (the
prompt rules of jobs/inputs/prompts.py, JobTask.unit_table), and returns the rows in
UnitResult.data instead of committing a part file. So a call's rows equal, bit for bit, what `run_job` writes for the
same prompts, prompt ids, sampling parameters and checkpoint.

Prompts of a call:
- a list: of strings (input.format text), of token-id lists (tokens) or of chat message
  lists (chat: [{role, content}, ...]), one kind per call whatever the config's format;
  the rows carry no passthrough columns;
- a pyarrow.Table with the job's input columns, in the config's input.format (text, chat or
  tokens): input.column, and input.id_column, input.passthrough, input.sampling_column
  when the config sets them, checked as a job checks its files.
Prompt ids: `prompt_ids` (one per prompt), else the table's input.id_column (or a
"prompt_id" column when the config sets none), else the prompt's index in the call, "0",
"1", .... Ids must be unique within a call.
Noise: a sample's noise is keyed by (seed, prompt id, sample index). A call whose params name
no `seed` gets a seed of its own, `call_seed(config seed, call number)` (the pool counts its
calls from 0), so every call draws fresh samples even for the same prompts and ids; the rows'
`seed` column holds the seed used, and passing it back (`{"seed": row_seed}`) reproduces the
call exactly, whatever its number. A call with an explicit seed (a dict with "seed", or an
engine SamplingParams, which always carries one) uses it as is. `run_job` never goes through
here: a job is one call with its config's seed, exactly as before.
Bad rows (a null or empty prompt, malformed messages, bad token ids) become error rows
named "prompts row <i>", as a job's do; what a job could not even store (a list mixing
kinds, a token that is not an integer) is a ValueError before any work.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pyarrow as pa

from cluster.unit import UnitRequest, UnitResult, WorkUnit
from jobs.config import load_job_spec
from jobs.errors import InputError
from jobs.inputs.parquet import check_input_schema
from jobs.inputs.prompts import RowLayout, requests_from_columns
from jobs.outputs.schema import output_schema
from jobs.plan.planner import JobPlan
from jobs.spec import DEFAULT_COLUMNS, JobSpec
from jobs.task import JobTask, refuse_top_rows

CALL_NAME = "prompts"  # names a call's rows in error messages: "prompts row 3 column 'prompt': ..."
ID_COLUMN = "prompt_id"


@dataclass(slots=True)
class PromptBatch:
    """One unit's prompts (WorkUnit.payload): its rows of the call's columns, as Python lists,
    the first row's index in the call, how they are read (the format and the column roles),
    the call's SamplingParams, and the passthrough columns' Arrow fields."""

    columns: dict[str, list[Any]]
    row_start: int
    layout: RowLayout
    params: Any
    passthrough_fields: tuple[pa.Field, ...] = ()


@dataclass(slots=True)
class PoolCall:
    """What `collect` needs of a call: its output schema and its unit indices."""

    schema: pa.Schema
    indices: list[int] = field(default_factory=list)


class PoolTask(JobTask):
    """The PromptTask of a GenerationPool built from a job config (see the module docstring).

    Pickled to every worker like a JobTask (plain data: the spec's values).
    """

    def __init__(self, spec: JobSpec):
        super().__init__(spec, JobPlan(units=[], files=[], fingerprint="", num_prompts=0))
        # the keys the config gave, not a dump with defaults filled in: validated again (a
        # call's sampling overrides), a filled-in default would count as given (an openai_batch
        # config refuses the input.column its dump holds)
        self.spec_data = spec.given_dict()
        self.source = spec.source

    # ------------------------------------------------------------ driver side
    def make_units(self, prompts: Any, params: Any, prompt_ids: Any, first_index: int,
                   unit_rows: int, *, call_number: int | None = None) -> tuple[list[WorkUnit], PoolCall]:
        """The call's units of at most `unit_rows` prompts, indexed from `first_index`;
        call_number: the pool's count of calls, mixed into the seed of a call without an
        explicit one (see the module docstring; None: the config's seed as is).
        Raises SpecError for a bad params key or value, InputError for a table without the
        job's columns or duplicate prompt ids, ValueError / TypeError for prompts it cannot
        take (named by index)."""
        call_params = self.call_params(params, call_number=call_number)
        if isinstance(prompts, pa.Table):
            layout, fields, columns = self._table_columns(prompts, prompt_ids)
        elif isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a list (of strings, token-id lists or chat message lists) or a "
                            f"pyarrow.Table, got {type(prompts).__name__}")
        else:
            layout, fields, columns = self._list_columns(list(prompts), prompt_ids)
        n = len(columns[layout.column])
        _check_unique(columns[layout.id_column])
        units = []
        for k, start in enumerate(range(0, n, max(1, unit_rows))):
            end = min(n, start + max(1, unit_rows))
            batch = PromptBatch(columns={c: v[start:end] for c, v in columns.items()}, row_start=start,
                                layout=layout, params=call_params, passthrough_fields=fields)
            units.append(WorkUnit(index=first_index + k, source=CALL_NAME, row_start=start, row_end=end,
                                  payload=batch))
        # the top logprobs columns when the call's top_logprobs (the config's, or the call's own) asks
        top = bool(call_params.top_logprobs)
        return units, PoolCall(schema=output_schema(list(fields), top), indices=[u.index for u in units])

    def collect(self, call: PoolCall, results: list[UnitResult]) -> pa.Table:
        """The call's rows: its units' tables in unit order (prompts in order, then sample index)."""
        by_index = {r.index: r.data for r in results}
        missing = [i for i in call.indices if by_index.get(i) is None]
        if missing:
            raise RuntimeError(f"units {missing[:8]} of the call returned no rows")
        tables = [by_index[i] for i in call.indices]
        return pa.concat_tables(tables) if tables else call.schema.empty_table()

    def call_params(self, params: Any, *, call_number: int | None = None) -> Any:
        """The SamplingParams of a call: the config's (None), an engine SamplingParams as
        given, or a mapping of `sampling` keys ({"temperature": 0.7, "seed": 3}) over the
        config's, validated as the config is (SpecError naming "sampling.<key>"). Without an
        explicit seed and with a `call_number`, the seed is `call_seed(seed, call_number)`."""
        from engine.params import SamplingParams

        if isinstance(params, SamplingParams):
            return params
        if params is None:
            resolved, explicit = self.params, False
        elif isinstance(params, Mapping):
            keys = {k if str(k).startswith("sampling.") else f"sampling.{k}": v for k, v in params.items()}
            resolved = load_job_spec(JobSpec.from_dict(self.spec_data, self.source), keys).sampling_params()
            explicit = "sampling.seed" in keys
        else:
            raise TypeError(f"params must be None, an engine.SamplingParams or a dict of sampling keys, "
                            f"got {type(params).__name__}")
        if explicit or call_number is None:
            return resolved
        return dataclasses.replace(resolved, seed=call_seed(resolved.seed, call_number))

    def _table_columns(self, table: pa.Table,
                       prompt_ids: Any) -> tuple[RowLayout, tuple[pa.Field, ...], dict[str, list[Any]]]:
        job = self.layout
        if job.format == "openai_batch":
            raise InputError(f"{self.source}: input.format openai_batch reads JSONL files; give a GenerationPool "
                             f"of this config a list of prompts, or a table in the text, chat or tokens format")
        spec = JobSpec.from_dict(self.spec_data, self.source)
        check_input_schema(spec, "prompts table", table.schema)
        id_column = job.id_column or (ID_COLUMN if ID_COLUMN in table.column_names else None)
        if id_column is not None and prompt_ids is not None:
            raise ValueError(f"prompt ids given twice: prompt_ids and the table's column {id_column!r}")
        layout = RowLayout(format=job.format, column=job.column, id_column=id_column,
                           sampling_column=job.sampling_column, passthrough=job.passthrough,
                           chat_template_date=job.chat_template_date, tools=job.tools)
        columns = {c: table.column(c).to_pylist() for c in layout.columns()}
        if id_column is None:
            id_column = ID_COLUMN if ID_COLUMN not in columns else "_prompt_id"
            columns[id_column] = _ids(prompt_ids, table.num_rows)
            layout = dataclasses.replace(layout, id_column=id_column)
        return layout, tuple(table.schema.field(c) for c in job.passthrough), columns

    def _list_columns(self, prompts: list[Any],
                      prompt_ids: Any) -> tuple[RowLayout, tuple[pa.Field, ...], dict[str, list[Any]]]:
        fmt = _list_format(prompts)
        column = DEFAULT_COLUMNS[fmt]
        layout = RowLayout(format=fmt, column=column, id_column=ID_COLUMN,
                           chat_template_date=self.layout.chat_template_date, tools=self.layout.tools)
        return layout, (), {column: prompts, ID_COLUMN: _ids(prompt_ids, len(prompts))}

    # ------------------------------------------------------------ worker side
    def read_unit(self, unit: WorkUnit, tokenizer: Any) -> list[UnitRequest]:
        """The unit's requests from its payload, each with the call's parameters (or its
        row's, from the sampling column, over them)."""
        b: PromptBatch = unit.payload
        requests = requests_from_columns(b.layout, b.params, b.columns, CALL_NAME, b.row_start, tokenizer)
        for r in requests:
            if r.params is None:
                r.params = b.params
        if not b.params.top_logprobs:  # as a job's rows (JobTask.read_unit)
            refuse_top_rows(requests)
        return requests

    def write_unit(self, unit: WorkUnit, requests: list[UnitRequest], outputs: list[Any],
                   tokenizer: Any = None) -> UnitResult:
        """The unit's rows (JobTask.unit_table, with the call's layout and parameters) in
        UnitResult.data; nothing is written."""
        b: PromptBatch = unit.payload
        view = copy.copy(self)
        view.layout, view.params = b.layout, b.params
        view.passthrough_fields = list(b.passthrough_fields)
        view.top_columns = bool(b.params.top_logprobs)
        view.schema = output_schema(view.passthrough_fields, view.top_columns)
        table, counts = view.unit_table(unit, requests, outputs, tokenizer)
        return UnitResult(index=unit.index, path="", data=table, **counts)


def call_seed(seed: int, call_number: int) -> int:
    """The seed of a pool's call number `call_number` (0, 1, ...) made without an explicit
    seed, from the config's `seed`: 63 bits of blake2b over both, so calls draw unrelated
    noise, and the same pool config gives the same sequence of calls in every run."""
    h = hashlib.blake2b(f"{seed}\x1fcall\x1f{call_number}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def _list_format(prompts: list[Any]) -> str:
    """text, tokens or chat for a list of prompts (None entries fit any); ValueError naming the
    first prompt of another kind."""
    kinds: dict[str, int] = {}
    for i, p in enumerate(prompts):
        if p is None:
            continue
        if isinstance(p, str):
            kind = "text"
        elif isinstance(p, (list, tuple)):
            if any(isinstance(x, Mapping) for x in p):
                kind = "chat"
            else:
                bad = next((j for j, x in enumerate(p) if not (isinstance(x, numbers.Integral) and not isinstance(x, bool))
                            and x is not None), None)
                if bad is not None:
                    raise ValueError(f"prompts[{i}]: token {bad} is {p[bad]!r}; a token-id prompt holds integers "
                                     f"(a chat prompt is a list of {{role, content}} dicts)")
                kind = "tokens"
        else:
            raise ValueError(f"prompts[{i}] is a {type(p).__name__}; expected a string, a list of token ids or a "
                             f"list of chat messages")
        kinds.setdefault(kind, i)
        if len(kinds) > 1:
            (k1, i1), (k2, i2) = sorted(kinds.items(), key=lambda kv: kv[1])
            raise ValueError(f"prompts mix kinds: prompts[{i1}] is {k1}, prompts[{i2}] is {k2} (one kind per call)")
    return next(iter(kinds), "text")


def _ids(prompt_ids: Any, n: int) -> list[Any]:
    if prompt_ids is None:
        return [str(i) for i in range(n)]
    ids = list(prompt_ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} prompt_ids for {n} prompts")
    return ids


def _check_unique(ids: list[Any]) -> None:
    seen: dict[str, int] = {}
    for i, v in enumerate(ids):
        if v is None:
            continue
        if str(v) in seen:
            raise InputError(f"prompt id {str(v)!r} appears twice in the call (prompts {seen[str(v)]} and {i}); "
                             f"ids key the sampling noise and must be unique")
        seen[str(v)] = i


__all__ = ["PoolTask", "PromptBatch", "PoolCall", "call_seed"]
