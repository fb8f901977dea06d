"""The contract between a job (jobs/) and the workers (cluster/).

cluster/ schedules `WorkUnit`s and drives engines; everything about the input and output
formats stays behind `UnitTask`, which jobs/ implements (jobs.task.JobTask). A UnitTask is
pickled to every worker, so it holds only plain data (spec values, paths).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: importing cluster.task must not load the engine
    from engine.params import RequestOutput, SamplingParams


@dataclass(frozen=True, slots=True)
class WorkUnit:
    """A slice of one input file: rows [row_start, row_end) of `source`.

    index: the unit's position in the job plan (0-based); it names the unit's output file,
    so a unit is committed at most once whoever runs it and however often.
    """

    index: int
    source: str
    row_start: int
    row_end: int

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
    """What a committed unit reports back to the driver (counts, not data)."""

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
