"""JobTask: what a worker does with a unit of a job (cluster.unit.UnitTask): read its rows,
then commit its output rows.

A JobTask is pickled to every worker, so it holds plain data only: the engine arguments,
the sampling parameters, the input's reader (its format and columns), the output path, the
fingerprint.

Reading: the reader of input.format (jobs/inputs/) turns the unit's rows into requests by
the prompt rules of jobs/inputs/prompts.py (an OpenAI batch line's by
jobs/inputs/openai_batch.py); a bad row becomes an error row, never an exception.

Writing: one row per sample (jobs/outputs/schema.py), committed once as the unit's part
file (jobs/outputs/commit.py). Output text: the sample's tokens decoded, without the stop
token that ended it and cut before the stop string that ended it
(engine.tokenizers.stop_strings.completion_text); `stop_reason` is that stop string, or the stop
token's text (e.g. "<|im_end|>"). An openai_batch job's rows carry the request's columns and
the sample as an OpenAI choice (jobs/outputs/batch_responses.py).
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from cluster.unit import UnitRequest, UnitResult, WorkUnit
from engine.tokenizers.stop_strings import completion_text
from jobs import uri
from jobs.inputs import reader_for
from jobs.inputs.prompts import RowLayout
from jobs.outputs.batch_responses import sample_columns
from jobs.outputs.commit import canonical_output, write_part
from jobs.outputs.schema import META_COUNTS, META_FINGERPRINT, META_UNIT, META_VERSION, batchgen_version, output_schema
from jobs.spec import JobSpec


def refuse_top_rows(requests: list[UnitRequest]) -> None:
    """Rows asking for top logprobs (their own top_logprobs > 0) in a job whose output has no
    columns for them (JobSpec.top_logprobs_columns) become error rows naming why: nowhere to
    write the lists, and dropping them silently would lose what the row asked for."""
    for r in requests:
        k = r.params.top_logprobs if r.params is not None else 0
        if k and r.error is None:
            r.prompt_tokens, r.error = None, (
                f"{r.prompt_id}: field 'top_logprobs' {k}: a row may ask for top logprobs only in a job with "
                f"sampling.top_logprobs > 0 (its output then has the top_logprob_ids and top_logprobs columns; "
                f"a row's 0 turns them off for that row)")


class JobTask:
    """The UnitTask of a batchgen job (see module docstring and cluster/unit.py).

    JobTask(spec, plan, output_path=None, staged=None): plan is the job's JobPlan
    (jobs/plan/planner.py); output_path defaults to spec.output.path; relative paths are made
    absolute here, on the driver. staged: {staged copy's source: the input file's name} for
    units that read a re-chunked copy (jobs/inputs/staging.py).
    """

    def __init__(self, spec: JobSpec, plan: Any, output_path: str | None = None,
                 staged: dict[str, str] | None = None):
        self.engine_kwargs: dict[str, Any] = spec.engine_kwargs()
        self.params = spec.sampling_params()
        self.output_path = canonical_output(output_path if output_path is not None else spec.output.path)
        self.fingerprint = plan.fingerprint
        self.layout = RowLayout.of(spec)
        self.file_names = {f.path: f.name for f in plan.files}
        self.file_names.update(staged or {})
        self.reader = reader_for(spec, self.file_names, plan.reader_state)
        self._decoded: dict[int, int] = {}  # unit index -> input rows decoded to read it
        self.passthrough_fields = list(plan.passthrough_fields)
        self.top_columns = spec.top_logprobs_columns()  # the output has top_logprob_ids / top_logprobs
        self.schema = output_schema(self.passthrough_fields, self.top_columns)
        self.model_name = spec.model.path

    # ------------------------------------------------------------ reading
    def read_unit(self, unit: WorkUnit, tokenizer: Any) -> list[UnitRequest]:
        """One UnitRequest per row of `unit`, in row order (jobs/inputs/prompts.py for the
        rules). Bad rows become requests with prompt_tokens None and an error naming the file,
        row (0-based, within the file) and column. Raises only if the file cannot be read."""
        requests, self._decoded[unit.index] = self.reader.read_unit(unit, tokenizer, self.params)
        if not self.top_columns and self.layout.format != "openai_batch":  # (a batch line's go in its choices)
            refuse_top_rows(requests)
        return requests

    # ------------------------------------------------------------ writing
    def write_unit(self, unit: WorkUnit, requests: list[UnitRequest], outputs: list[Any],
                   tokenizer: Any = None) -> UnitResult:
        """Commit the unit: one row per sample in (prompt, sample_index) order, written
        once as part-<index>.parquet (jobs.outputs.commit.write_part).

        outputs[i] is the engine.params.RequestOutput of requests[i] (error_output for a bad
        row). `tokenizer` decodes each sample's tokens into the `text` column and its stop
        token into `stop_reason` (null without one, or if decoding fails). Raises ValueError
        when outputs do not match requests (a worker bug; the unit is retried) and the
        write's OSError/pyarrow errors.
        """
        table, counts = self.unit_table(unit, requests, outputs, tokenizer)
        counts["input_rows_decoded"] = self._decoded.pop(unit.index, 0)
        meta = {
            META_FINGERPRINT: self.fingerprint.encode(),
            META_UNIT: json.dumps({"index": unit.index, "file": self.file_names.get(unit.source, unit.source),
                                   "source": uri.redact(unit.source), "row_start": unit.row_start,
                                   "row_end": unit.row_end}).encode(),
            META_COUNTS: json.dumps(counts).encode(),
            META_VERSION: batchgen_version().encode(),
        }
        path = write_part(self.output_path, unit.index, table.replace_schema_metadata(meta))
        counts.pop("input_rows_decoded")  # recorded in the file; not a UnitResult field
        return UnitResult(index=unit.index, path=path, **counts)

    def unit_table(self, unit: WorkUnit, requests: list[UnitRequest], outputs: list[Any],
                   tokenizer: Any = None) -> tuple[pa.Table, dict[str, int]]:
        """The unit's output rows (`self.schema`, no metadata) and their counts (prompts, rows,
        generated_tokens, prompt_tokens, tool_calls, tool_errors, error_rows); see write_unit
        for the rules and the errors."""
        if len(outputs) != len(requests) or len(requests) != unit.num_rows:
            raise ValueError(f"unit {unit.index}: {len(requests)} requests and {len(outputs)} outputs for "
                             f"{unit.num_rows} rows")
        cols: dict[str, list[Any]] = {f.name: [] for f in self.schema}
        counts = {"prompts": len(requests), "rows": 0, "generated_tokens": 0, "prompt_tokens": 0, "tool_calls": 0,
                  "tool_errors": 0, "error_rows": 0}
        for req, out in zip(requests, outputs):
            if out is None:
                raise ValueError(f"unit {unit.index}: no output for prompt {req.prompt_id!r}")
            n = (req.params or self.params).num_samples
            samples = sorted(out.samples, key=lambda s: s.sample_index)
            if [s.sample_index for s in samples] != list(range(n)):
                raise ValueError(f"unit {unit.index}: prompt {req.prompt_id!r} has samples "
                                 f"{[s.sample_index for s in samples]}, expected 0..{n - 1}")
            prompt = None if req.prompt_tokens is None else list(out.prompt_tokens or req.prompt_tokens)
            counts["prompt_tokens"] += len(prompt or [])
            for s in samples:
                text = None
                if tokenizer is not None and (s.tokens or s.finish_reason != "error"):
                    try:
                        text = completion_text(tokenizer, s.tokens, s.stop_reason)
                    except Exception:  # decoding is best effort; tokens are the data
                        text = None
                calls = [{"start": c.start, "end": c.end, "expr": c.expr, "output": c.output, "error": c.error,
                          "name": c.name, "arguments": c.arguments, "latency_s": c.latency_s,
                          "forced_start": c.forced_start} for c in s.tool_calls]
                cols["prompt_id"].append(req.prompt_id)
                cols["sample_index"].append(s.sample_index)
                cols["prompt_tokens"].append(prompt)
                cols["tokens"].append(list(s.tokens))
                cols["mask"].append(list(s.mask))
                cols["logprobs"].append(list(s.logprobs))
                cols["text"].append(text)
                cols["finish_reason"].append(s.finish_reason)
                cols["stop_reason"].append(_stop_reason_text(s.stop_reason, tokenizer))
                cols["tool_calls"].append(calls)
                cols["num_prompt_tokens"].append(s.num_prompt_tokens or len(prompt or []))
                cols["num_tokens"].append(len(s.tokens))
                cols["seed"].append(s.seed)
                cols["error"].append(s.error)
                cols["weight_version"].append(list(s.weight_versions))
                if self.top_columns:
                    cols["top_logprob_ids"].append(s.top_logprob_ids)
                    cols["top_logprobs"].append(s.top_logprobs)
                for c in self.layout.passthrough:
                    cols[c].append(req.passthrough.get(c))
                if self.layout.format == "openai_batch":
                    for c, v in sample_columns(req, s, text, tokenizer).items():
                        cols[c].append(v)
                counts["rows"] += 1
                counts["generated_tokens"] += len(s.tokens)
                counts["tool_calls"] += len(calls)
                counts["tool_errors"] += sum(1 for c in calls if c["error"] is not None)
                counts["error_rows"] += s.finish_reason == "error" or s.error is not None
        return pa.Table.from_pydict(cols, schema=self.schema), counts


def _stop_reason_text(reason: int | str | None, tokenizer: Any) -> str | None:
    """The stop_reason column: the stop string, or the stop token's text (its id as text when
    the tokenizer cannot decode it)."""
    if reason is None or isinstance(reason, str):
        return reason
    if tokenizer is not None:
        try:
            return tokenizer.decode([reason])
        except Exception:  # noqa: BLE001 - a padded vocabulary id
            pass
    return str(reason)
