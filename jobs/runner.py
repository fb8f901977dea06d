"""`run_job(spec)`: plan, resume, run the units on Ray workers, progress bar, summary.

    from jobs.config import load_spec
    from jobs.runner import run_job
    run_job(load_spec("configs/demo.yaml"))      # 0 on success

Order of work (every check that can refuse the job happens before Ray starts):
1. the day chat templates render at (the config's, the existing output's, or today in UTC),
   then plan_job (jobs/plan/planner.py): input files, schemas, units, fingerprint with the
   checkpoint's content hashes (cached in the output directory) (SpecError / InputError,
   exit 2); a local run asking for more GPUs than the machine has is refused (SpecError,
   exit 2);
2. the output lease (jobs/outputs/lease.py): another live driver on the same output stops
   this one (OutputError, exit 2) before it touches anything;
3. OutputDir.prepare: new / resume / overwrite, fingerprint check (OutputError, exit 2);
4. skip committed units (resume), remove temp files and probes of interrupted writes and
   damaged part files (empty or cut short, as a power loss can leave them: their units run
   again), remove a _SUCCESS of an earlier run when units remain, stage input files whose
   row groups are too large for their units (jobs/inputs/staging.py);
5. connect Ray: cluster.address None starts a private local instance sized for the workers
   with the GPUs Ray detects (shut down at the end); "auto", "host:port" or "ray://..."
   joins a cluster (left running). A Ray instance already initialised in this process is
   reused as is.
6. cluster.dispatcher.UnitDispatcher with a tqdm bar over rows (unit deadlines from
   cluster.unit_timeout_s; the lease checked every loop, and before staging and every write of
   the driver's own: a lost lease, taken over or whose heartbeats keep failing, stops the job
   with JobFailed, exit 1, and its workers); UnitFailed becomes JobFailed (exit 1);
7. summary (from the output directory, so it covers every run of a resumed job) printed
   and written to _SUCCESS; the lease is released.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

from jobs import uri
from jobs.errors import JobFailed

log = logging.getLogger(__name__)

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a cluster run ships when the driver is not inside a `ray job submit` job (Ray Client).
SHIP_EXCLUDES = [".git", ".venv", "out", "**/__pycache__", "*.parquet", "bench", "tests"]


def _runtime_env(address: str | None) -> dict | None:
    """How workers import batchgen: see the module docstring of jobs.submit for clusters."""
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return None  # inside `ray job submit`: the job's runtime_env (working_dir) already ships the code
    if address is not None and address.startswith("ray://"):
        # Ray Client: the cluster does not share our filesystem; ship the packages.
        return {"py_modules": [os.path.join(PROJECT_ROOT, p) for p in ("engine", "cluster", "jobs")],
                "excludes": ["**/__pycache__"]}
    # local instance, or a cluster whose nodes share this checkout / have batchgen installed
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": PROJECT_ROOT + (os.pathsep + path if path else "")}}


def connect_ray(spec: Any) -> bool:
    """Initialise Ray for `spec`; returns True if this call started it (caller shuts it down).
    A local instance gets the CPUs the workers need and the GPUs Ray detects."""
    import ray

    if ray.is_initialized():
        return False
    c = spec.cluster
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=True,
                                  logging_level=logging.WARNING)
    env = _runtime_env(c.address)
    if env is not None:
        kwargs["runtime_env"] = env
    if c.address is None:
        # "local": always a new private instance, even when `ray start` left an address in
        # /tmp/ray/ray_current_cluster (a plain ray.init() would join that cluster)
        kwargs["address"] = "local"
        kwargs["num_cpus"] = max(1, int(c.num_workers * c.cpus_per_worker + 0.999))
    else:
        kwargs["address"] = c.address
        kwargs.pop("include_dashboard")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    ray.init(**kwargs)
    return True


class _Progress:
    """tqdm bar over output rows; postfix: generated tokens/s of this run."""

    def __init__(self, total_rows: int, done_rows: int, disable: bool | None = None):
        from tqdm import tqdm

        self.start = time.time()
        self.bar = tqdm(total=total_rows, initial=done_rows, unit="row", dynamic_ncols=True, smoothing=0.1,
                        desc="batchgen", disable=disable, file=sys.stderr, mininterval=0.5)
        self.tokens_committed = 0
        self.tokens_live = 0
        self.waiting = ""
        self.next_log = self.start + 30.0
        self.rows, self.total_rows = done_rows, total_rows  # a disabled tqdm does not count

    def on_result(self, r: Any) -> None:
        self.tokens_committed += r.generated_tokens
        self.rows += r.rows
        self.bar.update(r.rows)
        self._postfix()

    def on_progress(self, info: dict) -> None:
        self.tokens_live = int(info.get("generated_tokens", 0))
        self.waiting = info.get("waiting_for_nodes") or ""
        self._postfix()

    def tokens(self) -> int:
        return max(self.tokens_live, self.tokens_committed)

    def _postfix(self) -> None:
        now = time.time()
        dt = max(1e-6, now - self.start)
        wait = f", waiting for nodes: {self.waiting}" if self.waiting else ""
        self.bar.set_postfix_str(f"{self.tokens():,} tok, {self.tokens() / dt:,.0f} tok/s{wait}", refresh=False)
        if self.bar.disable and now >= self.next_log:  # no terminal (e.g. `ray job logs`): a line now and then
            self.next_log = now + 30.0
            log.info("progress: %s rows, %s generated tokens (%.0f tok/s), %.0fs elapsed%s",
                     f"{self.rows:,}/{self.total_rows:,}", f"{self.tokens():,}", self.tokens() / dt, dt, wait)

    def close(self) -> None:
        self.bar.close()


def run_job(spec: Any, overwrite: bool = False, *, progress: bool | None = None,
            task_factory: Callable[..., Any] | None = None, echo: bool = True) -> int:
    """Run (or resume) the job; returns 0 when every unit is committed.

    Raises SpecError / InputError / OutputError (exit code 2) before any work starts and
    JobFailed (exit code 1) when a unit keeps failing, workers cannot start, no node can
    host a worker, or the output lease is lost. `progress=False` hides the bar (None: shown
    only when stderr is a terminal). task_factory(spec, plan, staged=...): the UnitTask to
    run (default jobs.task.JobTask; tests inject faults through it).
    echo=False: no summary and examples on stdout (the Python API, jobs.api.run_job).
    """
    from jobs.outputs.lease import OutputLease
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.fingerprint import load_hash_cache, save_hash_cache
    from jobs.plan.planner import check_local_gpus, plan_job, with_chat_template_date

    t0 = time.time()
    out = OutputDir(spec.output.path)
    cache = load_hash_cache(out)
    spec = with_chat_template_date(spec, None if overwrite else out.manifest_or_none())
    plan = plan_job(spec, hash_cache=cache)
    check_local_gpus(spec)
    out.ensure_writable()
    if not overwrite and not out.has_manifest():
        # before the lease: a directory run refuses (prepare's check) keeps no _batchgen/ of ours
        out.check_no_unrelated_files()
    lease = OutputLease(out, plan.fingerprint, spec.output.lease_timeout_s)
    lease.acquire()
    try:
        lease.start()  # heartbeats from now on: preparing (an --overwrite on a store) may take a while
        mode = out.prepare(plan, spec, overwrite=overwrite)
        save_hash_cache(out, cache)
        out.cleanup_temp_files()
        # a part with no Parquet footer (e.g. linked before a power loss dropped its data) is
        # not committed, and must go for its unit's commit (a link) to succeed again
        committed = out.committed_units(remove_damaged=True)
        todo = [u for u in plan.units if u.index not in committed]
        if todo:
            # a _SUCCESS of an earlier run (a part since deleted or found damaged) would claim
            # the output whole while this run is under way, and after it if it stops
            out.clear_success()
        log.info("job %s: %d prompts, %d units (%d committed, %d to run), output %s (%s)%s", plan.fingerprint[:12],
                 plan.num_prompts, len(plan.units), len(plan.units) - len(todo), len(todo), out.shown, mode,
                 f"; took over the output lease of {lease.took_over}" if lease.took_over else "")
        results, tokens_this_run, staged_rows = [], 0, 0
        if todo:
            results, tokens_this_run, staged_rows = _run_units(spec, plan, out, todo, lease, t0, progress,
                                                               task_factory)
        # nothing more is written once the lease is lost (taken over, or our heartbeats fail)
        lease.check()
        # a worker killed while writing leaves a temporary file; no writer is left now
        out.cleanup_temp_files()
        lease.check()
        summary = _finish(out, plan, len(results), tokens_this_run, staged_rows, t0)
    finally:
        lease.release()
    if echo:
        print(format_summary(summary))
        examples = show_examples(spec, plan, out)
        if examples:
            print(examples)
    return 0


def _run_units(spec: Any, plan: Any, out: Any, todo: list, lease: Any, t0: float, progress: bool | None,
               task_factory: Callable[..., Any] | None) -> tuple[list, int, int]:
    """Stage what needs staging, then run the units still to do on Ray workers with a
    progress bar; returns (the results, tokens generated, input rows decoded while staging).
    UnitFailed becomes JobFailed."""
    from cluster.dispatcher import UnitDispatcher
    from cluster.unit import UnitFailed
    from jobs.inputs.prompts import RowLayout
    from jobs.inputs.staging import stage_inputs
    from jobs.task import JobTask

    n = spec.sampling.num_samples
    total_rows = sum(plan.unit_rows(u, n) for u in plan.units)
    done_rows = total_rows - sum(plan.unit_rows(u, n) for u in todo)
    c = spec.cluster
    lease.check()
    # a staged copy holds exactly the columns a unit's rows are read from
    todo, staged, staged_rows = stage_inputs(plan, out, c.unit_rows, RowLayout.of(spec).columns(), todo)
    lease.check()
    task = (task_factory or JobTask)(spec, plan, staged=staged)
    recorded = out.recorded()  # what a resumed output's rows are bound to
    bind_auto_dtype(task, out, recorded["auto_dtype"])
    started = connect_ray(spec)
    bar = _Progress(total_rows, done_rows, disable=None if progress is None else not progress)
    try:
        with UnitDispatcher(task, num_workers=min(int(c.num_workers), len(todo)), num_cpus=c.cpus_per_worker,
                            num_gpus=c.gpus_per_worker, max_unit_attempts=int(c.max_unit_attempts),
                            unit_timeout_s=c.unit_timeout_s, may_add_nodes=c.address is not None,
                            on_auto_dtype=recorder(out.record_auto_dtype, out, "model.dtype auto resolved to"),
                            kernels=recorded["kernels"],  # cluster/health.py refuse_kernels
                            on_kernels=recorder(out.record_kernels, out, "the workers' CPU kernels are")) as pool:
            results = pool.run(todo, on_result=bar.on_result, on_progress=bar.on_progress, watchdog=lease.check)
        return results, bar.tokens_committed, staged_rows
    except UnitFailed as e:
        why = str(e)
        # cluster/ names a unit by its source as given: an input URI, or a staged copy under
        # the output's, may carry credentials (s3://KEY:SECRET@bucket/...)
        for source in sorted({u.source for u in todo} | {f.path for f in plan.files}, key=len, reverse=True):
            why = why.replace(source, uri.redact(source))
        raise JobFailed(f"job failed after {time.time() - t0:.0f}s: {why}. Committed units are kept; "
                        f"rerun the same command to resume.") from None
    finally:
        bar.close()
        if started:
            import ray

            ray.shutdown()


def bind_auto_dtype(task: Any, out: Any, bound: str | None) -> str | None:
    """With model.dtype "auto", a resumed output's rows must not mix dtypes when this run's
    machines would resolve auto otherwise (an output begun on an AMX Xeon, in bfloat16,
    resumed on an AVX2 EPYC, which picks float32): the dtype its first run resolved (the
    manifest's auto_dtype, `bound`: OutputDir.recorded) becomes the workers' dtype, set in
    `task.engine_kwargs`. Returns it, or None when nothing is bound (a dtype set explicitly,
    or none recorded: a new output, whose first ready worker binds it)."""
    if task.engine_kwargs.get("dtype") != "auto":
        return None
    if bound is not None:
        task.engine_kwargs["dtype"] = bound
        log.info("model.dtype auto: %s holds rows computed in %s, so this run's workers use %s whatever "
                 "their machines would pick", out.shown, bound, bound)
    return bound


def recorder(write: Callable[[str], None], out: Any, what: str) -> Callable[[str], None]:
    """The dispatcher's on_auto_dtype / on_kernels: `write` (OutputDir.record_auto_dtype,
    record_kernels), whose failure (the output's store refusing the write at that moment)
    is a JobFailed naming the output, not the store's bare exception out of the dispatcher."""
    def record(value: str) -> None:
        try:
            write(value)
        except Exception as e:  # noqa: BLE001 - any failure to write is this run's end
            raise JobFailed(f"cannot record in {out.shown}'s manifest that {what} {value} "
                            f"({type(e).__name__}: {e}); nothing was generated by this run. Rerun to resume.") from None
    return record


def _finish(out: Any, plan: Any, units_this_run: int, tokens_this_run: int, staged_rows: int,
            t0: float) -> dict[str, Any]:
    """The summary (from the output directory, so it covers every run of a resumed job),
    written to _SUCCESS. Raises JobFailed if a unit is missing."""
    wall = time.time() - t0
    st = out.status()
    summary = {
        "output": out.shown,
        "fingerprint": plan.fingerprint,
        "prompts": st["prompts"],
        "samples": st["rows"],
        "generated_tokens": st["generated_tokens"],
        "prompt_tokens": st["prompt_tokens"],
        "tool_calls": st["tool_calls"],
        "tool_errors": st["tool_errors"],
        "error_rows": st["error_rows"],
        "units": st["units_total"],
        "units_this_run": units_this_run,
        "generated_tokens_this_run": tokens_this_run,
        "input_rows_decoded": st["input_rows_decoded"],
        "staging_rows_decoded_this_run": staged_rows,
        "wall_s": round(wall, 3),
        "tokens_per_s_this_run": round(tokens_this_run / wall, 1) if wall > 0 else 0.0,
    }
    if st["units_done"] != st["units_total"]:
        # parts the start of the run took for committed (they end in a Parquet footer) that
        # status cannot read: name them, since a rerun alone would not rewrite them
        bad = st["unreadable_units"]
        missing = st["units_total"] - st["units_done"]
        if bad:
            shown = "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else "")
            raise JobFailed(f"{missing} units missing after the run: {len(bad)} part files cannot be read "
                            f"({shown}). A part that is damaged, not merely unreachable, can be deleted: a rerun "
                            f"then runs its unit again")
        raise JobFailed(f"{missing} units missing after the run; rerun to resume")
    out.mark_success(summary)
    return summary


def show_examples(spec: Any, plan: Any, out: Any, n: int = 2, width: int = 600) -> str:
    """A couple of generated answers (sample 0 of the first prompts of the first unit) next to
    their prompts, so a person sees what the model wrote. Nothing for the untrained
    "tiny-random" model (its text is noise) or when the first unit holds only errors."""
    from engine.loading.builtin import TINY_RANDOM
    from jobs.inputs.parquet import column_pylist, read_rows  # examples are shown for Parquet inputs only

    if spec.model.path == TINY_RANDOM or not plan.units or spec.input.format == "openai_batch":
        return ""
    unit = plan.units[0]
    rows = out.read_part(unit.index, ["sample_index", "text", "finish_reason"]).to_pylist()
    # (column_pylist: a prompt that is not valid UTF-8 was an error row, skipped below, not a crash here)
    prompts = column_pylist(read_rows(unit.source, unit.row_start, unit.row_end, [spec.input.column]).column(0))
    firsts = [r for r in rows if r["sample_index"] == 0]  # sample 0 of each prompt, in prompt order
    lines = []
    for j, prompt in enumerate(prompts):
        row = firsts[j] if j < len(firsts) else None
        if row is None or row["finish_reason"] == "error" or not row["text"]:
            continue
        if spec.input.format == "chat":
            prompt = next((m["content"] for m in reversed(prompt or []) if m.get("role") == "user"), "")
        elif spec.input.format == "tokens":
            prompt = f"<{len(prompt or [])} token ids>"
        lines.append(f"\nprompt: {_clip(str(prompt), width)}\nanswer ({row['finish_reason']}): "
                     f"{_clip(row['text'], width)}")
        if len(lines) == n:
            break
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    text = text.strip()
    return text if len(text) <= width else text[:width].rstrip() + " [...]"


def format_summary(s: dict) -> str:
    return "\n".join([
        f"done: {s['output']}",
        f"  prompts:          {s['prompts']:,}",
        f"  samples (rows):   {s['samples']:,} ({s['error_rows']:,} error rows)",
        f"  generated tokens: {s['generated_tokens']:,} ({s['generated_tokens_this_run']:,} this run, "
        f"{s['tokens_per_s_this_run']:,.1f} tok/s)",
        f"  tool calls:       {s['tool_calls']:,} ({s['tool_errors']:,} with errors)",
        f"  units:            {s['units']:,} ({s['units_this_run']:,} run now)",
        f"  wall time:        {s['wall_s']:.1f}s",
    ])
