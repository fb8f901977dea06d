"""The contract between a job (jobs/) and the workers (cluster/).

cluster/ schedules `WorkUnit`s and drives engines; everything about the input and output
formats stays behind `UnitTask`, which jobs/ implements (jobs.task.JobTask). A UnitTask is
pickled to every worker, so it holds only plain data (spec values, paths). A run that cannot
finish raises `UnitFailed`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: importing cluster.unit must not load the engine
    from engine.params import RequestOutput, SamplingParams


@dataclass(frozen=True, slots=True)
class WorkUnit:
    """A slice of one input file: rows [row_start, row_end) of `source`.

    index: the unit's position in the job plan (0-based); it names the unit's output file,
    so a unit is committed at most once whoever runs it and however often.
    payload: the unit's prompts themselves, when they travel with it instead of being read
        from `source` (a GenerationPool call); opaque to cluster/, read by the task.
    """

    index: int
    source: str
    row_start: int
    row_end: int
    payload: Any = field(default=None, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(slots=True)
class UnitRequest:
    """One prompt of a unit, ready for the engine.

    prompt_tokens is None when the row could not become a prompt; `error` then says why
    (naming the file, row and column), and every sample of the row becomes an error row.
    passthrough: input columns copied to each output row of this prompt.
    params: this request's own SamplingParams (per-request parameters); None uses the task's.
    """

    prompt_id: str
    prompt_tokens: list[int] | None
    error: str | None = None
    passthrough: dict[str, Any] = field(default_factory=dict)
    params: SamplingParams | None = None


@dataclass(slots=True)
class UnitResult:
    """What a finished unit reports back to the driver: counts, and for a unit that returns
    its rows instead of committing a file (a GenerationPool call) the rows in `data`
    (`path` is then "")."""

    index: int
    path: str
    prompts: int = 0
    rows: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    error_rows: int = 0
    wall_s: float = 0.0
    worker: str = ""
    data: Any = None


class UnitFailed(Exception):
    """A run of units cannot finish (cluster/dispatcher.py): a unit failed too often, workers
    cannot start, or no node can host a worker."""


class UnitTask(Protocol):
    """What a worker needs from the job. Implemented by jobs.task.JobTask.

    engine_kwargs: keyword arguments for engine.load_engine (path, device, dtype, ...).
    params: the job's SamplingParams, for every prompt whose UnitRequest.params is None.
    read_unit: the unit's prompts, tokenized with the worker's tokenizer; a bad row becomes
        a UnitRequest with an error, never an exception. Raises only when the unit cannot
        be read at all (the unit is then retried, then the job fails).
    write_unit: commit the unit's output so that it is visible whole or not at all, one row
        per sample, and keep an existing commit of the same unit (a unit may run twice:
        retries, a second copy after its deadline; the first commit wins); `outputs[i]`
        belongs to `requests[i]`; `tokenizer` (the worker's engine tokenizer) decodes the
        text columns. Returns counts.
    """

    engine_kwargs: dict[str, Any]
    params: SamplingParams

    def read_unit(self, unit: WorkUnit, tokenizer: Any) -> list[UnitRequest]: ...

    def write_unit(self, unit: WorkUnit, requests: list[UnitRequest], outputs: list[RequestOutput],
                   tokenizer: Any) -> UnitResult: ...


class PromptTask(UnitTask, Protocol):
    """A UnitTask for a GenerationPool (jobs/pool.py): prompts arrive in a call, travel inside
    their units (WorkUnit.payload), and come back as data (UnitResult.data). Implemented by
    jobs.pool_task.PoolTask.

    make_units(prompts, params, prompt_ids, first_index, unit_rows, *, call_number): the
        call's units, indexed from `first_index` (unique over the pool's life, so a late copy
        from an earlier call never collides with a new unit), each of at most `unit_rows`
        prompts, and an opaque `call` object for `collect`; `call_number` counts the pool's
        calls (0, 1, ...), for fresh noise in calls without an explicit seed. Raises ValueError (or a subclass) for
        prompts or parameters it cannot take, before any work.
    collect(call, results): the call's output from its units' results (in any order).
    """

    def make_units(self, prompts: Any, params: Any, prompt_ids: Any, first_index: int,
                   unit_rows: int, *, call_number: int | None = None) -> tuple[list[WorkUnit], Any]: ...

    def collect(self, call: Any, results: list[UnitResult]) -> Any: ...
