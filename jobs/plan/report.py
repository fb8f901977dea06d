"""`batchgen plan`: what `run` would do, without Ray, without a model, without writing.

    batchgen plan configs/job.yaml [--set KEY=VALUE ...]

Validates the config and the inputs exactly as `run` does (exit 2 on a bad one), then prints
the input files, prompts, units, the input rows the units will decode, the output's state
(new, resuming with N units committed, or one `run` refuses with exit 2: another job's
output, a directory of other files, a file: the read-only checks of
OutputDir.check_can_be_directory and check_no_unrelated_files), the output lease and the
fingerprint. Reads the checkpoint hash cache of the output directory but never writes it.
"""
from __future__ import annotations

from typing import Any

from jobs import uri
from jobs.outputs.lease import OutputLease
from jobs.outputs.output_dir import OutputDir, describe_differences, weights_problem
from jobs.plan.fingerprint import load_hash_cache
from jobs.plan.planner import check_local_gpus, plan_job, with_chat_template_date

SHOW_FILES = 10


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def describe_plan(spec: Any) -> tuple[str, int]:
    """(the report, exit code): 0, or 2 when `run` would refuse the output directory.

    Raises SpecError / InputError (exit code 2) as `run` does."""
    out = OutputDir(spec.output.path)
    spec = with_chat_template_date(spec, out.manifest_or_none())
    plan = plan_job(spec, hash_cache=load_hash_cache(out))
    check_local_gpus(spec)
    lines = [f"config:        {spec.source}",
             f"input:         {uri.redact(spec.input.path)} ({_n(len(plan.files), 'file')}, {_n(plan.num_prompts, 'prompt')})"]
    for f in plan.files[:SHOW_FILES]:
        lines.append(f"  {f.name}: {_n(f.num_rows, 'row')} in {_n(len(f.row_groups), 'row group')}"
                     + (" (staged: row groups larger than 2 x unit_rows)" if f.staged else ""))
    if len(plan.files) > SHOW_FILES:
        lines.append(f"  ... {len(plan.files) - SHOW_FILES:,} more files")
    staged = plan.staged_files
    ratio = plan.rows_decoded / plan.num_prompts if plan.num_prompts else 0.0
    lines.append(f"units:         {len(plan.units):,} (cluster.unit_rows {spec.cluster.unit_rows})")
    lines.append(f"rows decoded:  {plan.rows_decoded:,} for {plan.num_prompts:,} prompts ({ratio:.2f}x)"
                 + (f"; {_n(len(staged), 'file')} re-chunked into output.path/_batchgen/staged first" if staged else ""))
    lines.append(f"model:         {spec.model.path} ({spec.resolved_device()}, {spec.resolved_dtype()})")
    if spec.input.format in ("chat", "openai_batch"):
        lines.append(f"chat date:     {spec.model.chat_template_date} (model.chat_template_date: chat templates "
                     f"render at this day)")
    lines.append(f"fingerprint:   {plan.fingerprint}")
    code = 0
    manifest = None
    try:
        # what `run` checks before it writes (ensure_writable, prepare), without writing
        out.check_can_be_directory()
        manifest = out.read_manifest()
        if manifest is None:
            out.check_no_unrelated_files()
    except Exception as e:  # noqa: BLE001 - reported, as `run` would refuse it
        lines.append(f"output:        {e}; `run` refuses it (exit 2)")
        code = 2
    if manifest is not None:
        if manifest.get("fingerprint") == plan.fingerprint and (why := weights_problem(manifest, plan)):
            lines.append(f"output:        {out.shown}: {why}; `run` refuses it without --overwrite")
            code = 2
        elif manifest.get("fingerprint") == plan.fingerprint:
            done, damaged = out.check_parts()
            done &= {u.index for u in plan.units}  # a part of another index is not one of this job's units
            lines.append(f"output:        {out.shown}: resume, {len(done):,} of {len(plan.units):,} units committed"
                         + (f"; {len(damaged):,} part file(s) damaged, which `run` removes and runs again: "
                            + ", ".join(f"{rel} ({why})" for rel, why in damaged[:5])
                            + (", ..." if len(damaged) > 5 else "") if damaged else ""))
            if spec.resolved_dtype() == "auto" and manifest.get("auto_dtype"):
                lines.append(f"dtype:         {manifest['auto_dtype']} (model.dtype auto: the dtype this output's "
                             f"rows were computed in, kept for the rest)")
            if manifest.get("kernels"):
                lines.append(f"kernels:       {manifest['kernels']} (the CPU kernels this output's rows were computed "
                             f"with: workers with the other kind are refused)")
        else:
            diffs = describe_differences(manifest.get("fingerprint_data") or {}, plan.fingerprint_data)
            lines.append(f"output:        {out.shown}: holds another job's output (fingerprint "
                         f"{str(manifest.get('fingerprint'))[:12]}); `run` refuses it without --overwrite; "
                         f"differences: {'; '.join(diffs[:10]) or '(none recorded)'}")
            code = 2
    elif code == 0:
        lines.append(f"output:        {out.shown}: new")
    lease = OutputLease(out, plan.fingerprint, spec.output.lease_timeout_s)
    current = lease.read()
    if current is None:
        lines.append("lease:         free")
    else:
        verdict, why = lease.judge(current)
        held = f"lease:         held by {current.get('holder')} (job {str(current.get('fingerprint'))[:12]})"
        if verdict == "stale":
            lines.append(f"{held}; stale ({why}): `run` would take it over")
        elif verdict == "live":
            lines.append(f"{held}; live ({why}): `run` would stop (exit 2)")
            code = 2
        else:
            lines.append(f"{held}, {why}: `run` would watch it, then stop (exit 2) if it changes or take it "
                         f"over if not")
    return "\n".join(lines), code
