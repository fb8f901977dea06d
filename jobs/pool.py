"""`GenerationPool`: Ray workers and their engines kept alive across calls, from Python.

    from jobs import GenerationPool
    with GenerationPool("configs/rl.yaml", {"cluster.num_workers": 2}) as pool:
        table = pool.generate(["What is 2+2?", "Name a prime."], {"temperature": 0.7})  # fresh noise each call
        pool.load_weights("ckpt/step-200")          # every worker, in place
        pool.update_weights(trainer.state_dict())    # or the trainer's tensors from memory, in buckets
        table = pool.generate(prompts)               # now from step-200's weights
        handle = pool.submit(prompts)                # returns at once (jobs/rollout_handle.py)
        for group in handle.results(): ...           # each prompt's samples as soon as they are all done
        pool.pause("keep"); pool.load_weights(path); pool.resume()   # held samples go on, new weights

A pool is a UnitDispatcher (cluster/dispatcher.py: the same GenerationWorker actors, deadlines,
retries and worker replacement as a job) started once and fed with the units of each call.
The prompts travel inside their units and the rows come back through Ray, never through
files. What the prompts and rows are is the task's business (cluster.unit.PromptTask): here
jobs.pool_task.PoolTask, which reads and writes them exactly as a job does, so a call's rows
equal, bit for bit, what `run_job` writes for the same prompts, ids, parameters (the seed
given explicitly: a call without one draws fresh noise) and checkpoint. Every call,
`generate` included, is driven by one background thread (cluster/rollout.py:
RolloutRunner), which also runs the pool's weights swaps, so calls may overlap, be aborted,
and pause around a swap.

`from cluster import GenerationPool` still works for one release, with a DeprecationWarning
(cluster/ never imports jobs/ otherwise).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from cluster.dispatcher import UnitDispatcher
from cluster.rollout import RolloutRunner
from cluster.unit import PromptTask
from jobs.config import load_job_spec
from jobs.plan.planner import (check_device, check_function_tools, check_local_gpus, check_model_path,
                               with_chat_template_date)
from jobs.pool_task import PoolTask
from jobs.rollout_handle import RolloutHandle
from jobs.runner import connect_ray

DEFAULT_BUCKET_BYTES = 512 << 20  # update_weights' bucket size (slime's ~512 MB buckets)


# Units a pool keeps on each worker: submit() cuts calls into small units (see `submit`) so
# that prompts come back early, and the engine still holds this many of them at once.
POOL_UNITS_IN_FLIGHT = 16


@dataclass(slots=True)
class PoolSetup:
    """What a GenerationPool built from a job config runs: the task, the most prompts per
    unit, UnitDispatcher arguments, and whether this call started Ray (close shuts it down)."""

    task: PoolTask
    unit_rows: int
    dispatcher_options: dict[str, Any]
    ray_started: bool


def pool_setup(config: Any, overrides: Iterable[str] | Mapping[str, Any] = (), *,
               model: str | None = None, tools: Iterable[Any] | None = None) -> PoolSetup:
    """Validate a job config for a GenerationPool and connect Ray as a job would (a local
    instance when cluster.address is null). Raises SpecError naming the key (bad config,
    a model path or tokenizer that does not exist, a CUDA device without
    cluster.gpus_per_worker, more GPUs than a local machine has, function tools on a model
    whose tokenizer cannot render tool messages)."""
    spec = load_job_spec({} if config is None else config, overrides)
    if model is not None:
        spec = load_job_spec(spec, {"model.path": str(model)})
    if tools:
        spec = spec.with_python_tools(tools)  # Python tools beside the config's (run_job's rules)
    check_model_path(spec)
    check_device(spec)
    check_local_gpus(spec)
    check_function_tools(spec)
    spec = with_chat_template_date(spec, None)  # the pool's creation date, for all its calls
    task = PoolTask(spec)
    c = spec.cluster
    options = dict(num_workers=int(c.num_workers), num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_worker,
                   max_unit_attempts=int(c.max_unit_attempts), unit_timeout_s=c.unit_timeout_s,
                   may_add_nodes=c.address is not None, in_flight_per_worker=POOL_UNITS_IN_FLIGHT)
    return PoolSetup(task=task, unit_rows=int(c.unit_rows), dispatcher_options=options,
                     ray_started=connect_ray(spec))


class GenerationPool:
    """Long-lived generation workers (see the module docstring).

    GenerationPool(config=None, overrides=(), *, model=None, tools=None): config is a job config as
    `run_job` takes it (a YAML path, a dict of sections or a JobSpec; None: the defaults),
    overrides "section.key=value" strings or a {"section.key": value} mapping, and `model`
    a shorthand for model.path, `tools` Python tools as run_job takes them. The `output`
    section is not used. `cluster` sets the
    workers (num_workers, cpus_per_worker, gpus_per_worker, address: a local Ray instance is
    started for the pool and shut down by `close()`, an initialised one is used as is),
    unit_rows (most prompts per unit; below it, `generate` gives each unit about 1/(16 x
    workers) of the call, 16 being POOL_UNITS_IN_FLIGHT, at least one prompt; `submit` half that),
    max_unit_attempts and unit_timeout_s. The workers start, and their engines load, in the
    constructor.
    Raises SpecError / InputError for a bad config (naming the key) and
    cluster.unit.UnitFailed when workers cannot start.
    """

    def __init__(self, config: Any = None, overrides: Iterable[str] | Mapping[str, Any] = (), *,
                 model: str | None = None, tools: Iterable[Any] | None = None) -> None:
        setup = pool_setup(config, overrides, model=model, tools=tools)
        self.task: PromptTask = setup.task
        self.unit_rows = max(1, int(setup.unit_rows))
        self._ray_started = setup.ray_started
        self._next_index = 0  # unit indices count up over the pool's life (late copies never collide)
        self.num_calls = 0  # calls made; a call without an explicit seed mixes its number into its seed
        # submit() may be called from several threads: a call's number and unit indices are
        # taken and advanced together, or two calls could share them (and each other's rows)
        self._numbering = threading.Lock()
        self.dispatcher = UnitDispatcher(setup.task, **setup.dispatcher_options)
        self._runner = RolloutRunner(self.dispatcher)  # owns the dispatcher from its thread (cluster/rollout.py)
        try:
            self.dispatcher.wait_ready()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ calls
    def generate(self, prompts: Any, params: Any = None, *, prompt_ids: Any = None) -> Any:
        """Generate for `prompts` and return their rows (for a job config: a pyarrow.Table
        with the job's output schema, one row per sample, in prompt order then sample index).

        prompts, params, prompt_ids: as the task takes them (jobs.pool_task.PoolTask: a list
        of strings, token-id lists or chat message lists, or a pyarrow.Table with the job's
        input columns; params an engine SamplingParams or a dict of `sampling` keys over
        the config's; prompt_ids one id per prompt, default "0", "1", ...).
        Noise: without an explicit `seed` in params, the call's seed is derived from the
        config's and the pool's call count (jobs.pool_task.call_seed), so each call draws
        fresh samples; the rows' `seed` column holds it, and `{"seed": that}` (same prompts,
        ids and other params) gives the same rows again. An explicit seed is used as is.
        Raises ValueError (SpecError, InputError) for input the task refuses, before any
        work, and cluster.unit.UnitFailed when the call cannot finish (a unit failing
        max_unit_attempts times, no worker able to start); the workers stay up. Interrupted
        while it waits (KeyboardInterrupt, or any exception raised into the waiting thread),
        it aborts its call before raising, so the workers are free for the next one.
        """
        if not hasattr(prompts, "__len__"):
            prompts = list(prompts)
        n = len(prompts)
        per_unit = max(1, min(self.unit_rows, math.ceil(n / (self.dispatcher.num_workers
                                                             * self.dispatcher.in_flight_per_worker))))
        handle = self._submit(prompts, params, prompt_ids, per_unit)
        try:
            return handle.result()
        except BaseException:
            if not handle.done():  # interrupted: nobody will read this call, end it
                try:
                    handle.abort()
                except Exception:  # noqa: BLE001 - the pool closed meanwhile: the call ended with it
                    pass
            raise

    def submit(self, prompts: Any, params: Any = None, *, prompt_ids: Any = None,
               unit_rows: int | None = None) -> RolloutHandle:
        """Start generating for `prompts` and return at once (prompts, params, prompt_ids as
        `generate` takes them): `handle.results()` yields each prompt's group of rows as soon
        as all its samples are done, `handle.result()` every row (what `generate` returns),
        `handle.abort()` ends the call (jobs/rollout_handle.py). Calls may overlap; while the
        pool is paused a call's units wait for `resume`, and during a weights swap the call
        starts after it (submit still returns at once).
        Units are small, so that groups come back early: about 1/(2 x workers x units in
        flight) of the call each (one prompt for 64 prompts on 2 workers), at most
        cluster.unit_rows; `unit_rows` sets it (bench/bench_rollouts.py measures the choice).
        Raises as `generate` does for input it refuses, before any work."""
        if not hasattr(prompts, "__len__"):
            prompts = list(prompts)
        n = len(prompts)
        slots = self.dispatcher.num_workers * self.dispatcher.in_flight_per_worker
        per_unit = unit_rows or max(1, min(self.unit_rows, math.ceil(n / (2 * slots))))
        return self._submit(prompts, params, prompt_ids, max(1, int(per_unit)))

    def _submit(self, prompts: Any, params: Any, prompt_ids: Any, per_unit: int) -> RolloutHandle:
        with self._numbering:
            call_number, self.num_calls = self.num_calls, self.num_calls + 1
            units, call = self.task.make_units(prompts, params, prompt_ids, self._next_index, per_unit,
                                               call_number=call_number)
            self._next_index += len(units)
        return RolloutHandle(self._runner, self.task, call, len(prompts))._start(units)

    def pause(self, mode: str = "abort", timeout_s: float | None = None) -> bool:
        """Pause generation, as vLLM's pause_generation (cluster/rollout.py):
        "abort" ends every open call (their handles get every sample, unfinished ones
        "abort"); "wait" lets the units on the workers finish and sends no more; "keep"
        stops every engine at once, holding its unfinished samples (their tokens; the KV is
        recomputed on resume, with the weights then loaded). In every mode nothing new
        starts until `resume()`; calls submitted meanwhile wait. "wait" while "keep" holds
        returns at once. Returns True once the pause holds (False if `timeout_s` passed
        first, behind a weights swap too: the pause then takes hold after it). Raises
        ValueError for another mode."""
        return self._runner.pause(mode, timeout_s)

    def resume(self) -> None:
        """End a pause: held samples continue where they stopped (each new token's
        `weight_version` says which weights sampled it), waiting units are dispatched."""
        self._runner.resume()

    def load_weights(self, checkpoint_path: str, *, step: int | None = None) -> list[dict]:
        """Load checkpoint `checkpoint_path`'s weights into every worker's engine, in place:
        same actors (same pids), same KV cache, all workers or none (UnitDispatcher.load_weights).
        The checkpoint needs the same architecture and shapes (engine/loading/weight_swap.py),
        checked from its files' headers before any worker swaps; each worker then reads it
        tensor by tensor (a GGUF file: whole). Its tokenizer is not read (the pool keeps the
        config's). Afterwards `generate` equals a job on the new checkpoint, bit for bit;
        workers replaced later load it too; weight_version counts one more.
        step: for a nanochat directory (default: its highest step now; every worker loads
            the same one, the newest any of them found, even while a trainer saves another).
        Returns each worker's state ({"worker", "pid", "weights", "kv_cache_ptr", ...}).
        Raises cluster.weight_sync.WeightsRefused naming the worker and what does not fit (every
        worker keeps its weights) and UnitFailed when no worker runs."""
        return self._runner.call(lambda: self.dispatcher.load_weights(str(checkpoint_path), step=step))

    def update_weights(self, named_tensors: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[dict]:
        """Swap a trainer's tensors from memory into every worker's engine, in place: same
        actors, same KV cache, all workers or none (UnitDispatcher.update_weights,
        cluster/weight_sync.py).

        named_tensors: a state dict or an iterable of (name, tensor), named as the trainer's
            model names them: transformers' names for Llama-family models (a GGUF-loaded one
            too) and GPT-2, nanochat's own for nanochat; any floating dtype, on any device.
            Every tensor of the model must be named once, in its shape; each is cast to the
            engine's dtype and fused or transposed as the loaders do
            (engine/loading/weight_map.py). The tensors are referenced, not copied, until
            packed (a generator's tensors are all held until the call ends).
        bucket_bytes: about how many bytes are packed into one buffer and put into Ray's
            object store at once (default 512 MiB); at most two buckets are in flight.
        Afterwards `generate` equals a pool started on a checkpoint of those tensors, bit for
        bit; a worker replaced later copies them from a live one (nothing is kept in the
        object store; if every worker died at once, calls raise UnitFailed naming the lost
        update until the next swap). Returns each worker's state (its "weight_version" one more than before).
        Raises cluster.weight_sync.WeightsRefused naming the worker and every difference
        (missing or unknown names, shapes; every worker keeps its weights), TypeError for an
        entry that is not a (name, tensor) pair or a tensor without data (on the meta device,
        sparse; before any worker is asked), UnitFailed when no worker runs."""
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        return self._runner.call(lambda: self.dispatcher.update_weights(pairs, bucket_bytes=bucket_bytes))

    def workers(self) -> list[dict]:
        """The worker slots: name, state, info from when it started (pid, host, device, dtype)."""
        return self._runner.call(self.dispatcher.workers)

    def engine_states(self) -> list[dict]:
        """Each worker's engine_state() (pid, weights swapped in last, KV cache), after any
        starting worker is ready."""
        return self._runner.call(self.dispatcher.engine_states)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the workers (and the Ray instance the pool started). Idempotent."""
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.close()
        dispatcher = getattr(self, "dispatcher", None)
        if dispatcher is not None:
            dispatcher.close()
        if self._ray_started:
            import ray

            self._ray_started = False
            ray.shutdown()

    def __enter__(self) -> "GenerationPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
