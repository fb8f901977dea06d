"""Reading a job's input: one reader interface, each input format behind it.

    from jobs.inputs import reader_for
    scan = reader_for(spec).scan(spec)                       # planning (jobs/plan/planner.py)
    requests, decoded = reader.read_unit(unit, tokenizer, params)   # a worker (jobs/task.py)

- reader.py: the interface (InputReader, InputScan, InputFile) and how sources are opened
  (local paths, URIs, package://);
- parquet.py: input.format text, chat and tokens, Parquet files; row_groups.py cuts them into
  units along their row groups, staging.py re-chunks files whose row groups are too large;
- openai_batch.py: input.format openai_batch, an OpenAI Batch JSONL file;
- prompts.py: how a row becomes a request (tokenizing text, chat and token-id prompts, ids);
  row_params.py: per-request sampling parameters (input.sampling_column);
- prepare.py: `batchgen prepare`, a JSONL file into a prompts Parquet file.

inputs/ never imports plan/, the task or the runner; of outputs/ it reads only the row schema
(jobs/outputs/schema.py: Arrow type text, the columns an openai_batch job adds).
"""
from __future__ import annotations

from typing import Any, Mapping

from jobs.inputs.reader import InputReader


def reader_for(spec: Any, names: Mapping[str, str] | None = None, reader_state: Any = None) -> InputReader:
    """The reader of `spec`'s input.format. For reading units (a worker's task): names,
    {unit source: input file name}; reader_state, what the scan left (JobPlan.reader_state)."""
    if spec.input.format == "openai_batch":
        from jobs.inputs.openai_batch import BatchReader

        return BatchReader(reader_state, spec.model.chat_template_date)
    from jobs.inputs.parquet import ParquetReader
    from jobs.inputs.prompts import RowLayout

    return ParquetReader(RowLayout.of(spec), names)
