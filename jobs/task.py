"""JobTask: how a worker reads a unit's prompts and commits its rows (cluster.unit.UnitTask).

A JobTask is pickled to every worker, so it holds plain data only: the engine arguments,
the sampling parameters, the input format and columns, the output path, the fingerprint.

Prompt rules (per input.format; a row that breaks one becomes an error row, never an
exception; the error names the file, the row and the column):
- text: `tokenizer.encode(text)`. A tokenizer with nanochat's "<|bos|>" special token gets
  it prepended (nanochat trains every document with a leading <|bos|>); GPT-2-style
  tokenizers (whose bos_token_id is <|endoftext|>) get no BOS, as GPT-2 was used. A fake
  tokenizer may say explicitly with a boolean `prepend_bos` attribute.
  Errors: null, empty string, encodes to nothing.
- chat: `tokenizer.render_chat(messages)` after checking the structure here (a non-empty
  list of {role, content} with string values). Roles and their order are the model's rule:
  render_chat raises for what its format refuses (nanochat's alternation, an exception
  raised by a Hugging Face chat template) and the row's error carries its message.
- tokens: the ids as-is; null/empty lists, null elements, negative ids and ids >=
  tokenizer.vocab_size are errors.
- id_column (if set): a null id is an error row (its prompt_id falls back to "<file>:<row>").
- sampling_column (if set): the row's struct overrides the job's sampling (jobs/inputs/row_params.py);
  a bad value is an error row naming the field.
- openai_batch: each JSONL line is parsed, checked and tokenized by jobs/inputs/openai_batch.py.

Output text: the sample's tokens decoded, without the stop token that ended it and cut
before the stop string that ended it (engine.stop_strings.completion_text); `stop_reason`
is that stop string, or the stop token's text (e.g. "<|im_end|>").
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from cluster.unit import UnitRequest, UnitResult, WorkUnit
from engine.stop_strings import completion_text
from jobs import uri
from jobs.inputs.parquet import JobPlan, read_rows_counted
from jobs.outputs.output_dir import (META_COUNTS, META_FINGERPRINT, META_UNIT, META_VERSION, OUTPUT_SCHEMA, batchgen_version,
                         canonical_output, output_schema, write_part)
from jobs.inputs.row_params import row_params
from jobs.spec import JobSpec

def text_bos(tokenizer: Any) -> int | None:
    """The BOS id to prepend to text prompts for this tokenizer, or None (see module docstring)."""
    flag = getattr(tokenizer, "prepend_bos", None)
    if isinstance(flag, bool):
        return getattr(tokenizer, "bos_token_id", None) if flag else None
    special = getattr(tokenizer, "special", None)
    if callable(special):
        return special("<|bos|>")
    return None


def check_messages(messages: Any) -> str | None:
    """Why a chat prompt is malformed in structure (None if it is fine); names the message index.

    Only the structure is checked here: a non-empty list of {role, content} with string
    values. Which roles exist and in which order they may come is the model's own rule, so
    the tokenizer's render_chat judges it (nanochat's layout wants user/assistant
    alternation; a Hugging Face chat template may accept tool messages or raise its own
    error), and its message becomes the row's error.
    """
    if messages is None:
        return "messages is null"
    if not isinstance(messages, (list, tuple)):
        return f"messages must be a list of {{role, content}}, got {type(messages).__name__}"
    if len(messages) == 0:
        return "messages is empty (a conversation needs at least one user message)"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is not a {{role, content}} struct (got {m!r})"
        role, content = m.get("role"), m.get("content")
        if role is None:
            return f"message {i} has no role"
        if not isinstance(role, str) or not role:
            return f"message {i} role must be a non-empty string, got {role!r}"
        if content is None:
            return f"message {i} ({role}) has no content (null)"
        if not isinstance(content, str):
            return f"message {i} ({role}) content must be a string, got {type(content).__name__}"
    return None


class JobTask:
    """The UnitTask of a batchgen job (see module docstring and cluster/unit.py).

    JobTask(spec, plan, output_path=None, staged=None): output_path defaults to
    spec.output.path; relative paths are made absolute here, on the driver. staged: {staged
    copy's source: the input file's name} for units that read a re-chunked copy
    (jobs/inputs/staging.py).
    """

    def __init__(self, spec: JobSpec, plan: JobPlan, output_path: str | None = None,
                 staged: dict[str, str] | None = None):
        self.engine_kwargs: dict[str, Any] = spec.engine_kwargs()
        self.params = spec.sampling_params()
        self.output_path = canonical_output(output_path if output_path is not None else spec.output.path)
        self.fingerprint = plan.fingerprint
        self.format = spec.input.format
        self.column = spec.input.column
        self.id_column = spec.input.id_column
        self.passthrough = list(spec.input.passthrough)
        self.file_names = {f.path: f.name for f in plan.files}
        self.file_names.update(staged or {})
        self._decoded: dict[int, int] = {}  # unit index -> input rows decoded to read it
        self.sampling_column = spec.input.sampling_column
        self.passthrough_fields = list(plan.passthrough_fields)
        self.schema = output_schema(self.passthrough_fields)
        self.batch = plan.batch  # openai_batch: each unit's byte range in the JSONL file
        self.model_name = spec.model.path

    # ------------------------------------------------------------ reading
    def _columns(self) -> list[str]:
        cols = [self.column]
        if self.id_column:
            cols.append(self.id_column)
        if self.sampling_column:
            cols.append(self.sampling_column)
        cols.extend(self.passthrough)
        return list(dict.fromkeys(cols))

    def read_unit(self, unit: WorkUnit, tokenizer: Any) -> list[UnitRequest]:
        """One UnitRequest per row of `unit`, in row order (see the module docstring for the
        rules). Bad rows become requests with prompt_tokens None and an error naming the file,
        row (0-based, within the file) and column. Raises only if the file cannot be read."""
        if self.format == "openai_batch":
            from jobs.inputs.openai_batch import read_unit

            return read_unit(self, unit, tokenizer)
        name = self.file_names.get(unit.source, unit.source)
        table, self._decoded[unit.index] = read_rows_counted(unit.source, unit.row_start, unit.row_end, self._columns())
        if table.num_rows != unit.num_rows:
            raise RuntimeError(f"{name}: rows {unit.row_start}..{unit.row_end} of unit {unit.index} could not be read "
                               f"(got {table.num_rows} rows; was the input file changed after the job started?)")
        return self.requests_from_columns({c: table.column(c).to_pylist() for c in self._columns()}, name,
                                          unit.row_start, tokenizer)

    def requests_from_columns(self, columns: dict[str, list[Any]], name: str, row_start: int,
                              tokenizer: Any) -> list[UnitRequest]:
        """One UnitRequest per row of `columns` (the job's input columns as Python lists),
        by the rules of the module docstring; `name` and `row_start` (the first row's index)
        name a row in errors and make its default prompt id "<name>:<row>"."""
        prompts = columns[self.column]
        ids = columns[self.id_column] if self.id_column else None
        passthrough = {c: columns[c] for c in self.passthrough}
        sampling = columns[self.sampling_column] if self.sampling_column else None
        bos = text_bos(tokenizer) if self.format == "text" else None
        vocab = getattr(tokenizer, "vocab_size", None)
        out: list[UnitRequest] = []
        for i, value in enumerate(prompts):
            row = row_start + i
            where = f"{name} row {row}"
            pid = f"{name}:{row}"
            error = None
            if ids is not None:
                if ids[i] is None:
                    error = f"{where} column {self.id_column!r}: prompt id is null"
                else:
                    pid = str(ids[i])
            params = None
            if sampling is not None:
                params, why = row_params(self.params, sampling[i], f"{where} column {self.sampling_column!r} ")
                error = error or why
            tokens = None
            if error is None:
                tokens, why = self._tokenize(value, tokenizer, bos, vocab)
                if why is not None:
                    error = f"{where} column {self.column!r}: {why}"
                    tokens = None
            out.append(UnitRequest(prompt_id=pid, prompt_tokens=tokens, error=error,
                                   passthrough={c: passthrough[c][i] for c in self.passthrough},
                                   params=params))
        return out

    def _tokenize(self, value: Any, tokenizer: Any, bos: int | None, vocab: int | None,
                  fmt: str | None = None) -> tuple[list[int] | None, str | None]:
        """(token ids, None) or (None, why) for one prompt of format `fmt` (default input.format)."""
        fmt = fmt or self.format
        if fmt == "text":
            if value is None:
                return None, "prompt is null"
            if value == "":
                return None, "prompt is an empty string"
            try:
                ids = list(tokenizer.encode(value))
            except (ValueError, TypeError) as e:
                return None, f"cannot tokenize the prompt: {e}"
            if not ids:
                return None, "prompt encodes to no tokens"
            return ([bos] + ids if bos is not None else ids), None
        if fmt == "chat":
            msgs = None if value is None else [{"role": m.get("role"), "content": m.get("content")}
                                               if isinstance(m, dict) else m for m in value]
            why = check_messages(msgs)
            if why is not None:
                return None, why
            try:
                ids = list(tokenizer.render_chat(msgs))
            except (ValueError, TypeError, KeyError) as e:
                return None, f"cannot render the conversation: {e}"
            if not ids:
                return None, "conversation renders to no tokens"
            return ids, None
        # tokens
        if value is None:
            return None, "token list is null"
        if len(value) == 0:
            return None, "token list is empty"
        for j, t in enumerate(value):
            if t is None:
                return None, f"token {j} is null"
            if t < 0:
                return None, f"token {j} is {t}: token ids must be >= 0"
            if vocab is not None and t >= vocab:
                return None, f"token {j} is {t}: outside the tokenizer's vocabulary (size {vocab})"
        return [int(t) for t in value], None

    # ------------------------------------------------------------ writing
    def write_unit(self, unit: WorkUnit, requests: list[UnitRequest], outputs: list[Any],
                   tokenizer: Any = None) -> UnitResult:
        """Commit the unit: one row per sample in (prompt, sample_index) order, written
        atomically as part-<index>.parquet (see jobs.outputs.output_dir.write_part).

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
                calls = [{"start": c.start, "end": c.end, "expr": c.expr, "output": c.output, "error": c.error}
                         for c in s.tool_calls]
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
                for c in self.passthrough:
                    cols[c].append(req.passthrough.get(c))
                if self.format == "openai_batch":
                    from jobs.inputs.openai_batch import sample_columns

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


__all__ = ["JobTask", "OUTPUT_SCHEMA", "check_messages", "text_bos"]
