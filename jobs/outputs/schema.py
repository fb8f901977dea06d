"""What an output row is: its columns and their Arrow types, and what a part file carries.

One row per sample: OUTPUT_SCHEMA, then TOP_LOGPROBS_FIELDS in a job that asks for top
logprobs (JobSpec.top_logprobs_columns), then the passthrough columns (input.passthrough, with
their input types; for input.format openai_batch, BATCH_FIELDS). Every part file carries
the job fingerprint, its unit (index, file, row range) and its counts in its Parquet
key-value metadata (the META_* keys), which `batchgen status` sums without reading rows.
"""
from __future__ import annotations

import re

import pyarrow as pa

TOOL_CALL_TYPE = pa.struct([
    pa.field("start", pa.int32()), pa.field("end", pa.int32()), pa.field("expr", pa.string()),
    pa.field("output", pa.string()), pa.field("error", pa.string()),
    # appended for Hermes tool calls (docs/output.md): readers by field name are unaffected
    pa.field("name", pa.string()), pa.field("arguments", pa.string()), pa.field("latency_s", pa.float64()),
    pa.field("forced_start", pa.int32()),
])

OUTPUT_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string()),
    pa.field("sample_index", pa.int32()),
    pa.field("prompt_tokens", pa.list_(pa.int32())),
    pa.field("tokens", pa.list_(pa.int32())),
    pa.field("mask", pa.list_(pa.int8())),
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("stop_reason", pa.string()),
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("error", pa.string()),
    pa.field("weight_version", pa.list_(pa.int32())),
])
"""Columns of every output row (one row per sample); passthrough columns follow them."""

# Only in the outputs of jobs that ask for top logprobs (sampling.top_logprobs > 0, and OpenAI
# batch jobs, whose lines may): per token of `tokens`, its k most likely tokens and their
# logprobs (a null inner list for a forced token), null for a row that asked for none. Not
# in every output: an output begun before these columns existed resumes with its own schema.
TOP_LOGPROBS_FIELDS = [
    pa.field("top_logprob_ids", pa.list_(pa.list_(pa.int32()))),
    pa.field("top_logprobs", pa.list_(pa.list_(pa.float32()))),
]

# The endpoints an OpenAI batch request line may name (the `endpoint` column's values).
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

BATCH_FIELDS = [
    pa.field("custom_id", pa.string()),
    pa.field("batch_line", pa.int64()),
    pa.field("endpoint", pa.string()),
    pa.field("request_model", pa.string()),
    pa.field("choice", pa.string()),
]
"""The columns an openai_batch job adds to every output row: the request's custom_id, its
1-based line in the JSONL file, its url, the body's model, and the sample as an OpenAI
choice object (JSON text; null for error rows)."""

META_FINGERPRINT = b"batchgen.fingerprint"
META_UNIT = b"batchgen.unit"
META_COUNTS = b"batchgen.counts"
META_VERSION = b"batchgen.version"
COUNT_KEYS = ("prompts", "rows", "generated_tokens", "prompt_tokens", "tool_calls", "tool_errors", "error_rows",
              "input_rows_decoded")


def batchgen_version() -> str:
    try:
        from importlib.metadata import version

        return version("batchgen")
    except Exception:  # not installed (running from a checkout)
        return "0.1.0"


def output_schema(passthrough_fields: list[pa.Field] = (), top_logprobs: bool = False) -> pa.Schema:
    """OUTPUT_SCHEMA, TOP_LOGPROBS_FIELDS when `top_logprobs` (JobSpec.top_logprobs_columns),
    then the passthrough columns (with their input types)."""
    return pa.schema(list(OUTPUT_SCHEMA) + (TOP_LOGPROBS_FIELDS if top_logprobs else []) + list(passthrough_fields))


def type_str(t: pa.DataType) -> str:
    """An Arrow type as text, with list item names dropped ("item" in memory, "element"
    after a Parquet round trip) so written and expected schemas compare equal."""
    return re.sub(r"list<(item|element): ", "list<", str(t))
