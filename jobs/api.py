"""The Python API for a whole job: `from jobs import run_job`.

    from jobs import run_job
    result = run_job("configs/demo.yaml", {"sampling.temperature": 0.7}, overwrite=True)
    result.output_path, result.summary["samples"]
    table = result.dataset.to_table(columns=["prompt_id", "tokens", "mask", "logprobs"])

The same job as `batchgen run` (plan, resume or refuse, Ray workers, atomic unit files,
_SUCCESS), from a config path, a dict of sections, or a JobSpec, with overrides
(load_job_spec, jobs/config.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from jobs.config import load_job_spec

__all__ = ["run_job", "JobResult", "load_job_spec"]


@dataclass(frozen=True)
class JobResult:
    """A finished job.

    output_path: the output directory (absolute local path or URI).
    summary: the _SUCCESS summary (prompts, samples, generated_tokens, error_rows, wall_s, ...).
    dataset: a pyarrow.dataset.Dataset over the committed part files (one row per sample, the
        output schema of the README), read lazily: `.to_table()`, `.to_batches()`, or hand it
        to polars / duckdb.
    """

    output_path: str
    summary: dict[str, Any]
    dataset: Any

    def to_table(self, columns: list[str] | None = None) -> Any:
        """The whole output as one pyarrow.Table, rows in unit order."""
        return self.dataset.to_table(columns=columns)


def run_job(config: str | Path | Mapping[str, Any] | Any, overrides: Iterable[str] | Mapping[str, Any] = (), *,
            overwrite: bool = False, progress: bool | None = False, tools: Iterable[Any] | None = None) -> JobResult:
    """Run (or resume) a job and return its JobResult.

    config: a YAML path, a dict of sections ({"model": {...}, "input": {...}, ...}) or a
    jobs.spec.JobSpec; overrides: see load_job_spec. overwrite: replace another job's output
    in output.path. progress: show the progress bar (None: when stderr is a terminal).
    tools: Python tools the model may call, added to the config's tools.functions: callables
    (named by __name__; parameters from the signature) or engine.tool_runner.Tool objects
    (docs/rl.md#tools). They travel to the workers pickled (by reference for module-level
    functions, by value for closures and lambdas, as Ray pickles).
    Raises SpecError / InputError / OutputError before any work (as `batchgen run` exits 2)
    and JobFailed when the job cannot finish (exit 1; committed units are kept and a rerun
    resumes).
    """
    import pyarrow.dataset as pads

    from jobs.outputs.layout import part_name
    from jobs.outputs.output_dir import OutputDir
    from jobs.runner import run_job as run

    spec = load_job_spec(config, overrides)
    if tools:
        spec = spec.with_python_tools(tools)
    run(spec, overwrite=overwrite, progress=progress, echo=False)
    od = OutputDir(spec.output.path)
    summary = _success_summary(od)
    files = [f"{od.base.rstrip('/')}/{part_name(i)}" for i in sorted(od.committed_units())]
    schema = None
    if not files:
        # a job of zero prompts has no part file to take the schema from: give the dataset the
        # one every part file would have (the manifest's output_schema), so that to_table()
        # has the output's columns, not none
        schema = _empty_output_schema(spec, od)
    dataset = pads.dataset(files, schema=schema, filesystem=od.fs, format="parquet")
    return JobResult(output_path=od.path, summary=summary, dataset=dataset)


def _success_summary(od: Any) -> dict[str, Any]:
    """The _SUCCESS summary the run just wrote, as OutputDir.status reports it ({"unreadable":
    true} for one that cannot be read; {} for none), read alone: status would read every
    part's footer again (the run's own summary just did; 16 s for 40,000 parts)."""
    from jobs.outputs.layout import SUCCESS

    try:
        text = od.read_text(SUCCESS)
        summary = json.loads(text) if text is not None else None
    except (OSError, ValueError):
        summary = {"unreadable": True}
    return summary or {}


def _empty_output_schema(spec: Any, od: Any) -> Any:
    """The Arrow schema of the output of a job without part files: the manifest's
    output_schema. The manifest holds types as text, so the passthrough columns' types come
    from the input again (a scan reads footers), as the task's schema does."""
    from jobs.inputs import reader_for
    from jobs.outputs.schema import output_schema

    plain = output_schema(top_logprobs=spec.top_logprobs_columns())
    names = [name for name, _ in (od.manifest_or_none() or {}).get("output_schema", [])]
    if names == plain.names:  # no passthrough columns: no need to scan the input again
        return plain
    return output_schema(reader_for(spec).scan(spec).passthrough_fields, spec.top_logprobs_columns())
