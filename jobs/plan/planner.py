"""Planning a job: what it will do, checked before any work starts.

    plan = plan_job(spec, hash_cache)     # its files, units, expected rows and fingerprint

plan_job checks the model path, asks the input's reader (jobs/inputs/, whichever
input.format says; the planner imports no format) to find, check and cut the input into
units, and fingerprints the job (jobs/plan/fingerprint.py). Everything it refuses is an
error of exit code 2 (SpecError, InputError) raised before Ray starts or anything is
written; `batchgen plan` (jobs/plan/report.py) prints the plan.

check_local_gpus is the other check a job makes of its machine before it starts: a local
run asking for more GPUs than the machine has. check_device (part of plan_job) refuses a
CUDA device without GPUs reserved for the workers.

with_chat_template_date fixes the one day a job's chat templates render at, before planning:
the config's, else the day the output was created (its manifest), else today in UTC.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cluster.unit import WorkUnit
from jobs.errors import SpecError, shown
from jobs.inputs import reader_for
from jobs.inputs.reader import InputFile
from jobs.plan.fingerprint import HashCache, checkpoint_identity, fingerprint_data, fingerprint_of


@dataclass
class JobPlan:
    """What a job will do: its files, its units, and the fingerprint that identifies its output.

    fingerprint: sha256 hex of the canonical JSON of `fingerprint_data` (spec fields that
    decide the rows + each input file's name, size and row count + the checkpoint's file
    hashes; jobs/plan/fingerprint.py).
    passthrough_fields: the output columns the input adds to every row (the Arrow fields of
        input.passthrough as the output will store them; openai_batch's request columns).
    rows_decoded: input rows the job's units (and staging) will decode, against
        num_prompts used.
    expected_rows: output rows per unit index where a unit's rows are not its prompts x
        sampling.num_samples (per-row num_samples: input.sampling_column, openai_batch).
    reader_state: what the input's reader needs to read a unit besides the unit itself
        (openai_batch: each unit's byte range, jobs.inputs.openai_batch.BatchPlan).
    checkpoint_sha256: the checkpoint's content hashes when the fingerprint leaves them out
        (openai_batch: InputScan.hash_checkpoint), kept in the manifest instead so that a
        resume with other weights is refused all the same (OutputDir.weights_problem);
        None when the fingerprint holds them.
    """

    units: list[WorkUnit]
    files: list[InputFile]
    fingerprint: str
    num_prompts: int
    root: str = ""
    fingerprint_data: dict[str, Any] = field(default_factory=dict)
    passthrough_fields: list[pa.Field] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rows_decoded: int = 0
    expected_rows: dict[int, int] = field(default_factory=dict)
    reader_state: Any = None
    checkpoint_sha256: dict[str, Any] | None = None

    @property
    def staged_files(self) -> list[InputFile]:
        return [f for f in self.files if f.staged]

    def unit_rows(self, unit: WorkUnit, num_samples: int) -> int:
        """Output rows unit `unit` commits (a verify check and the progress bar's total)."""
        return self.expected_rows.get(unit.index, unit.num_rows * num_samples)

    def file_of(self, source: str) -> InputFile:
        for f in self.files:
            if f.path == source:
                return f
        raise KeyError(source)


def plan_job(spec: Any, hash_cache: HashCache | None = None) -> JobPlan:
    """Find and validate the job's inputs, cut them into units, and fingerprint the job.

    Reads what the input's reader needs (Parquet: footers in parallel, the id column to
    reject duplicate ids; a batch file: every line once) and hashes the checkpoint's files
    (`hash_cache`: see jobs/plan/fingerprint.py; None hashes them all). Raises InputError
    naming the file and column for anything that stops the job, SpecError for a model path
    that does not exist. Zero-row files are allowed (they yield no units and a warning in
    `plan.warnings` and the log).
    """
    check_model_path(spec)
    check_device(spec)
    check_function_tools(spec)
    scan = reader_for(spec).scan(spec)
    data = fingerprint_data(spec, scan.fingerprint_files, hash_cache, hash_checkpoint=scan.hash_checkpoint)
    outside = None if scan.hash_checkpoint else checkpoint_identity(spec, hash_cache)
    return JobPlan(units=scan.units, files=scan.files, fingerprint=fingerprint_of(data), checkpoint_sha256=outside,
                   num_prompts=sum(f.num_rows for f in scan.files), root=scan.root, fingerprint_data=data,
                   passthrough_fields=scan.passthrough_fields, warnings=scan.warnings,
                   rows_decoded=scan.rows_decoded, expected_rows=scan.expected_rows,
                   reader_state=scan.reader_state)


def with_chat_template_date(spec: Any, manifest: dict | None) -> Any:
    """`spec` with model.chat_template_date set: the config's value when it gives one, else
    the date the existing output was created with (`manifest`, the output's manifest, None
    for a new output or one being overwritten), else today's date in UTC. Every worker,
    retry, second copy and resume of the job then renders chat prompts at that one date (a
    Llama 3.x template prints it), and the fingerprint holds it (for chat formats)."""
    if spec.model.chat_template_date is not None:
        return spec
    kept = ((manifest or {}).get("fingerprint_data") or {}).get("chat_template_date")
    day = kept if isinstance(kept, str) else datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return spec.model_copy(update={"model": spec.model.model_copy(update={"chat_template_date": day})})


def check_model_path(spec: Any) -> None:
    """Raise SpecError naming model.path (or model.tokenizer) when it does not exist on this
    machine (a built-in name resolves to its file first)."""
    from engine.loading.builtin import BUILTIN_NAMES, TINY_RANDOM, resolve_builtin

    mp = spec.model.path
    if mp == "demo":
        raise SpecError(f"{spec.given('model.path')}: model.path: 'demo' is not a model name any more: use 'smollm2' "
                        f"(SmolLM2-135M-Instruct, a real model) or 'tiny-random' (untrained, for tests)")
    try:
        resolved = str(resolve_builtin(mp))
    except FileNotFoundError as e:
        raise SpecError(f"{spec.given('model.path')}: model.path: {e}") from None
    if mp != TINY_RANDOM and not os.path.exists(resolved):
        raise SpecError(f"{spec.given('model.path')}: model.path: {shown(mp)} does not exist (expected a checkpoint directory, "
                        f"a .gguf file, or {' or '.join(map(repr, BUILTIN_NAMES))})")
    if spec.model.tokenizer is not None and not os.path.exists(spec.model.tokenizer):
        raise SpecError(f"{spec.given('model.tokenizer')}: model.tokenizer: {shown(spec.model.tokenizer)} does not exist")


def check_function_tools(spec: Any) -> None:
    """Raise SpecError (exit code 2) naming tools.functions when the job has function tools
    and the model's tokenizer cannot render a tool message: no chat template (tiny-random,
    nanochat, a directory without one), or a template that refuses a tool turn. The workers
    would refuse the tools when their engines start (engine/tool_calls.py ToolResponses,
    the same check), after the output directory was written. Reads the tokenizer the
    workers will (model.tokenizer, else the checkpoint's), only when there are function
    tools; one that does not load is left for the workers to report, as without tools."""
    box = spec.tool_box()
    if box is None:
        return
    from engine.loading.builtin import resolve_builtin
    from engine.loading.checkpoint import checkpoint_tokenizer, detect_format
    from engine.tool_calls import ToolResponses

    try:
        path = resolve_builtin(spec.model.path)
        tok = checkpoint_tokenizer(path, detect_format(path), override=spec.model.tokenizer)
    except Exception:  # noqa: BLE001 - reported by the workers, as for a job without tools
        return
    try:
        ToolResponses(tok, box.schemas())
    except ValueError as e:
        names = ", ".join(t.name for t in box.tools)
        raise SpecError(f"{spec.given('tools.functions')}: tools.functions ({names}): {e}; function tools need a model whose chat "
                        f"template renders tool messages (or model.tokenizer naming one)") from None


def check_device(spec: Any) -> None:
    """Raise SpecError (exit code 2) naming model.device and cluster.gpus_per_worker when the
    workers are to run on CUDA but reserve no GPU: Ray then neither places them by GPU nor
    hides any GPU from them, so every worker would run on the same GPU of its node."""
    device = spec.model.device
    if device.split(":")[0] == "cuda" and not spec.cluster.gpus_per_worker:
        raise SpecError(f"{spec.given('model.device', 'cluster.gpus_per_worker')}: model.device: {shown(device)} with cluster.gpus_per_worker 0: Ray would "
                        f"reserve no GPU for the workers and every worker would run on the same GPU; set "
                        f"cluster.gpus_per_worker (1: a GPU per worker; a fraction shares one) or model.device "
                        f"auto or cpu")


def check_local_gpus(spec: Any) -> None:
    """A local run (cluster.address null) may not ask for more GPUs than this machine has
    (Ray's own detection): otherwise the extra actors would run on CPU, in another dtype.
    Raises SpecError (exit code 2)."""
    c = spec.cluster
    if c.address is not None or not c.gpus_per_worker:
        return
    from cluster.resources import local_gpu_count

    want, have = c.num_workers * c.gpus_per_worker, local_gpu_count()
    if want > have:
        raise SpecError(f"{spec.given('cluster.gpus_per_worker', 'cluster.num_workers')}: cluster.gpus_per_worker: the job asks for {want:g} GPU(s) "
                        f"(num_workers {c.num_workers} x gpus_per_worker {c.gpus_per_worker:g}) but this machine "
                        f"has {have} (a local run; set cluster.address to run on a Ray cluster)")
