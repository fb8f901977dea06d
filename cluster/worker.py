"""The `GenerationWorker` Ray actor: one long-lived engine fed by several units at once.

Threads inside one worker (a threaded actor, `max_concurrency` >= 3):

- one *engine-loop* thread owns the engine: it is the only thread that calls
  `add_request`, `step` and `has_unfinished_requests`. It drains an inbox of requests that
  `run_unit` calls post, steps while anything is unfinished, and hands each finished
  `RequestOutput` to the unit that owns it (keyed by request_id = (unit.index, row)).
  It sleeps on a Condition when the engine is idle and the inbox empty.
- one thread per in-flight `run_unit` (the driver keeps 2 units in flight per worker): it
  reads the unit, posts its prompts, waits on the unit's Event, writes the unit file. While
  unit A's last requests decode, unit B's prompts are already in the engine, so a unit
  boundary never drains the batch.
- `progress()` / `pid()` / `ready()` / `engine_state()` answer from any thread without
  touching the engine.

Weights swap in two halves, so a pool can make it all-or-nothing across workers:
`stage_weights(path)` checks the checkpoint in the calling thread (the engine is only read;
decoding goes on), `commit_weights(version)` hands the copy to the engine-loop thread,
which runs it once the engine has no unfinished requests (new prompts wait meanwhile), and
`discard_weights()` drops a staged checkpoint. Weights from memory likewise:
`check_update(index)` checks a trainer's (name, dtype, shape) list, then `apply_bucket(b)`
copies one bucket's tensors in place on the engine-loop thread (from the first bucket on,
new prompts wait), and `finish_update(version)` ends the swap. A worker started with
`weights` (cluster.weight_buckets.PoolWeights) loads the engine as the task says, then those
weights (a replacement for a worker of a pool whose weights were swapped).

An exception raised by the engine fails every unit the worker holds (their `run_unit`
raises `EngineLoopError`) and breaks the worker: it drops its engine and refuses new units,
and the driver replaces the whole process (cluster/dispatcher.py). An engine is never
rebuilt in the same process, where the failed one may still hold its KV cache and device
memory.

A pool's calls can abort a worker's units and pause its engine (vLLM's "keep" mode): those
methods are in cluster/worker_rollout.py, mixed in.

Ray is imported only by `make_actor_class`: this module's logic runs (and is unit-tested)
without it. engine/ is imported lazily, when a worker starts.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.unit import UnitResult, UnitTask, WorkUnit
from cluster.worker_rollout import RolloutMethods, fill_aborted


class EngineLoopError(RuntimeError):
    """The worker's engine raised (while this unit was held, or before it arrived): the
    worker is broken and must be replaced; the unit itself may be fine."""


@dataclass(slots=True, eq=False)
class _Control:
    """Work for the engine-loop thread to run while the engine is idle (a weights swap)."""

    fn: Any
    hold: bool | None = None  # True: from now on new prompts wait; False: they may run again
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class _UnitState:
    unit: WorkUnit
    outputs: list[Any]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    in_engine: bool = False  # its requests were handed to the engine (guarded by _cv)
    requests: list[Any] | None = None  # the unit's UnitRequests (their params, to continue them)


def _load_engine(task: UnitTask, num_threads: int | None) -> Any:
    # A task may build its own engine (tests use tiny fakes); the default is engine.load_engine.
    factory = getattr(task, "load_engine", None)
    if callable(factory):
        return factory()
    from engine import load_engine

    return load_engine(**task.engine_kwargs, num_threads=num_threads, kv_share=node_share())


def node_share() -> float:
    """This actor's share of its node, for its engine's default KV budget: the fraction of a
    GPU it was given (0.5 when two workers share one; 1 for a whole GPU), else its CPUs over
    the node's (1/8 for one of eight one-CPU workers on an 8-CPU node). 1 outside Ray, or
    where Ray does not say."""
    try:
        import ray

        if not ray.is_initialized():
            return 1.0
        ctx = ray.get_runtime_context()
        assigned = ctx.get_assigned_resources()
        if assigned.get("GPU"):
            return min(1.0, float(assigned["GPU"]))
        node = next((n for n in ray.nodes() if n.get("NodeID") == ctx.get_node_id()), None)
        total = float((node or {}).get("Resources", {}).get("CPU", 0.0))
        cpus = float(assigned.get("CPU", 0.0))
        return min(1.0, cpus / total) if cpus > 0 and total > 0 else 1.0
    except Exception:  # noqa: BLE001 - a budget for one worker is the old behaviour, never a failed start
        return 1.0


class GenerationWorker(RolloutMethods):
    """Loads the engine once and runs units through it (see the module docstring); aborts
    and pauses its units for a pool's calls (cluster/worker_rollout.py)."""

    def __init__(self, task: UnitTask, worker_name: str, num_threads: int | None = None,
                 weights: Any = None) -> None:
        self.task = task
        self.name = worker_name
        self.num_threads = num_threads
        self.engine = _load_engine(task, num_threads)
        self.weights: dict | None = None  # the last swap: {"path", "step", "description", "weight_version"}
        if weights is not None:
            from cluster.weight_buckets import load_pool_weights

            self.weights = load_pool_weights(self.engine, weights)
        self.tokenizer = self.engine.tokenizer
        self._cv = threading.Condition()
        self._inbox: list[tuple[_UnitState, list[tuple[Any, Any]]]] = []  # guarded by _cv
        self._control: list[_Control] = []  # guarded by _cv; run by the engine loop when idle
        self._staged: Any = None  # a checkpoint staged by stage_weights; guarded by _cv
        # the weight map of the update from memory under way, shared by its buckets (a default a
        # nanochat map writes is written once per update, not over a tensor an earlier bucket
        # copied); made by its first bucket, dropped by check_update and finish_update
        self._update_map: Any = None
        self._holding = False  # a swap from memory is under way: new prompts wait; guarded by _cv
        self._owners: dict[Any, tuple[_UnitState, int]] = {}  # request_id -> (unit, row); _cv
        self._units: set[_UnitState] = set()  # units with requests posted or in the engine; _cv
        self._stopped = False
        self._finished_requests = 0
        self._finished_units = 0
        self._steps = 0  # engine steps taken (counted by the engine-loop thread)
        # unit index -> [stage, its _UnitState once posted], for progress(); guarded by _cv
        self._stages: dict[int, list[Any]] = {}
        self._tokens = 0  # generated tokens, kept when the engine is dropped
        self._broken: BaseException | None = None  # the engine raised; guarded by _cv
        self._started = time.time()
        self._node = _node_id()
        self._ops: list[Any] = []  # fn(engine) for the engine loop's next round, busy or not (cluster/rollout.py)
        self._aborted: set[int] = set()  # units of aborted calls: their requests end at once
        self._paused = False  # pause_engine: unfinished requests held, none admitted until resume_engine
        self._held: list[Any] = []  # RequestOutputs that pause_engine aborted, to continue on resume
        self._thread = threading.Thread(target=self._engine_loop, name=f"{worker_name}-engine", daemon=True)
        self._thread.start()

    # ---- actor methods -------------------------------------------------------------
    def ready(self) -> dict:
        """Answers once the engine is loaded: where this worker runs, and the device and dtype
        its engine resolved (None for engines without them, e.g. test fakes)."""
        dev, dt = getattr(self.engine, "device", None), getattr(self.engine, "dtype", None)
        return {"worker": self.name, "pid": os.getpid(), "host": socket.gethostname(), "node_id": self._node,
                "device": None if dev is None else str(dev), "dtype": None if dt is None else str(dt).replace("torch.", ""),
                "kernels": getattr(self.engine, "cpu_kernels", None)}

    def pid(self) -> int:
        return os.getpid()

    def progress(self) -> dict:
        """Counters of the whole worker, and under "units" where each unit it runs is:
        {index: [stage, count]}, stage "reading" (task.read_unit), "waiting" (posted, not in
        the engine yet), "generating" (count: the engine steps taken so far, so it grows
        while the engine runs) or "writing" (task.write_unit). The driver tells from this
        whether an overdue unit still moves (cluster/health.py): a worker whose other units
        progress may still have one stuck in a read or a write."""
        with self._cv:
            active = len(self._units)
            engine = self.engine
            broken = self._broken
            units = {i: (["generating", self._steps] if state.in_engine else ["waiting", 0])
                     if stage == "engine" else [stage, 0] for i, (stage, state) in self._stages.items()}
        tokens = self._tokens if engine is None else int(getattr(engine, "num_generated_tokens", 0))
        return {
            "worker": self.name,
            "pid": os.getpid(),
            "node_id": self._node,
            "broken": None if broken is None else repr(broken),
            "generated_tokens": tokens,
            "finished_requests": self._finished_requests,
            "finished_units": self._finished_units,
            "active_units": active,
            "units": units,
        }

    def engine_state(self) -> dict:
        """What this worker's engine holds now: pid, the weights swapped in last (None: the
        task's checkpoint), and its KV cache (storage address and slots, which a weights
        swap leaves in place, and the budget it was sized from, in bytes)."""
        with self._cv:
            engine, weights = self.engine, self.weights
        kv = getattr(engine, "kv", None)
        k = getattr(kv, "k", None)
        return {"worker": self.name, "pid": os.getpid(), "weights": weights,
                "weight_version": getattr(engine, "weight_version", None),
                "kv_cache_ptr": None if k is None else k.data_ptr(),
                "kv_cache_slots": getattr(kv, "num_slots", None),
                "kv_budget_bytes": getattr(engine, "kv_budget_bytes", None)}

    def stage_weights(self, path: str, step: int | None = None) -> dict:
        """Load checkpoint `path` and check it fits this worker's model (Engine.stage_weights),
        keeping it for `commit_weights`; the engine goes on decoding meanwhile. Returns
        {"worker", "pid", "path", "step", "description"}. Raises what the engine raises
        (FileNotFoundError, CheckpointError, WeightsMismatch), or EngineLoopError on a broken
        worker; the engine's weights are unchanged either way."""
        with self._cv:
            engine, broken = self.engine, self._broken
        if broken is not None or engine is None:
            raise EngineLoopError(f"worker {self.name}: engine failed earlier: {broken!r}")
        staged = engine.stage_weights(path, step=step)
        with self._cv:
            self._staged = staged
        return {"worker": self.name, "pid": os.getpid(), "path": staged.path, "step": staged.step,
                "description": staged.description}

    def commit_weights(self, version: int | None = None) -> dict:
        """Swap the staged checkpoint in (Engine.apply_weights, taking weight_version
        `version`) on the engine-loop thread, as soon as the engine has no unfinished
        requests; returns `engine_state()`. Raises RuntimeError when nothing is staged,
        EngineLoopError when the swap failed (the worker is then broken: its weights may be
        half swapped)."""
        with self._cv:
            staged, self._staged = self._staged, None
            if staged is None:
                raise RuntimeError(f"worker {self.name}: commit_weights without stage_weights")
        self.weights = self._run_control(lambda eng: eng.apply_weights(staged, version=version), "swapping the weights")
        return self.engine_state()

    def check_update(self, index: list) -> dict:
        """Check a trainer's tensors, (name, dtype name, shape) each, against this worker's
        model (engine.loading.weight_swap.check_tensors); changes nothing. Returns {"worker",
        "pid"}. Raises WeightsMismatch naming every difference, EngineLoopError on a broken
        worker."""
        from engine.loading.weight_swap import check_tensors

        with self._cv:
            engine, broken = self.engine, self._broken
        if broken is not None or engine is None:
            raise EngineLoopError(f"worker {self.name}: engine failed earlier: {broken!r}")
        check_tensors(engine.model, index)
        self._update_map = None  # a new update: its first bucket makes its map
        return {"worker": self.name, "pid": os.getpid()}

    def apply_bucket(self, bucket: Any) -> int:
        """Copy one bucket's tensors (cluster.weight_buckets.pack_buckets; Ray hands it over
        from the object store without a copy) into the model in place, on the engine-loop
        thread once the engine has no unfinished requests; new prompts wait from then until
        `finish_update`. Returns how many tensors were copied. Raises EngineLoopError when
        a copy failed (the worker is broken: its weights are half swapped)."""
        from cluster.weight_buckets import copy_bucket
        from engine.loading.weight_swap import weight_map

        def copy(eng):
            if self._update_map is None:
                self._update_map = weight_map(eng.model)
            return copy_bucket(eng, bucket, wmap=self._update_map)

        return self._run_control(copy, "copying a bucket of weights", hold=True)

    def export_weights(self, number: int, bucket_bytes: int) -> Any:
        """Bucket `number` of this worker's weights as they are now, under the model's own
        names (cluster.weight_buckets.export_bucket), for a new worker of the pool to copy;
        None past the last. Only reads the model (no swap runs while workers start)."""
        from cluster.weight_buckets import export_bucket

        with self._cv:
            engine, broken = self.engine, self._broken
        if broken is not None or engine is None:
            raise EngineLoopError(f"worker {self.name}: engine failed earlier: {broken!r}")
        return export_bucket(engine, number, bucket_bytes)

    def finish_update(self, version: int) -> dict:
        """End a swap from memory: the engine drops what it derived from its old weights and
        takes weight_version `version`, and new prompts may run again. Returns
        `engine_state()`."""
        from engine.loading.weight_swap import MEMORY

        def finish(eng):
            self._update_map = None
            eng.model.weights_changed()
            return eng.weights_swapped(MEMORY, None, eng.model.info.description, version)

        self.weights = self._run_control(finish, "finishing the weights swap", hold=False)
        return self.engine_state()

    def _run_control(self, fn: Any, what: str, hold: bool | None = None) -> Any:
        """Run fn(engine) on the engine-loop thread once the engine is idle; its result.
        hold: True / False sets whether new prompts wait after it (None: unchanged)."""
        with self._cv:
            if self._broken is not None:
                raise EngineLoopError(f"worker {self.name}: engine failed earlier: {self._broken!r}")
            control = _Control(fn=fn, hold=hold)
            self._control.append(control)
            self._cv.notify_all()
        self._wait(control.done)
        if control.error is not None:
            raise EngineLoopError(f"worker {self.name}: {what} failed: {control.error!r}") from control.error
        return control.result

    def discard_weights(self) -> None:
        """Drop a staged checkpoint (another worker refused it)."""
        with self._cv:
            self._staged = None

    def _wait(self, event: threading.Event) -> None:
        # Event.wait with a timeout only to notice a dead loop thread; completion is signalled.
        while not event.wait(timeout=5.0):
            if not self._thread.is_alive():
                raise EngineLoopError(f"worker {self.name}: engine loop thread died")

    def run_unit(self, unit: WorkUnit) -> UnitResult:
        stage: list[Any] = ["reading", None]  # what progress() reports for this unit
        with self._cv:
            self._stages[unit.index] = stage
        try:
            return self._run_unit(unit, stage)
        finally:
            with self._cv:
                if self._stages.get(unit.index) is stage:
                    del self._stages[unit.index]

    def _run_unit(self, unit: WorkUnit, stage: list[Any]) -> UnitResult:
        t0 = time.time()
        requests = self.task.read_unit(unit, self.tokenizer)
        params = self.task.params
        outputs: list[Any] = [None] * len(requests)
        good: list[tuple[Any, Any]] = []
        state = _UnitState(unit=unit, outputs=outputs, remaining=0, requests=requests)
        for row, req in enumerate(requests):
            rid = (unit.index, row)
            if req.prompt_tokens is None:
                from engine.params import error_output

                outputs[row] = error_output(rid, req.prompt_id, None, req.params or params, req.error or "invalid prompt")
            else:
                good.append((rid, req))
        state.remaining = len(good)
        if good:
            with self._cv:
                if self._broken is not None:
                    raise EngineLoopError(f"worker {self.name}: engine failed earlier: {self._broken!r}")
                if unit.index in self._aborted:  # its call was aborted before the unit arrived
                    fill_aborted(state, good, self.task.params)
                else:
                    for rid, _ in good:
                        if rid in self._owners:
                            raise RuntimeError(f"unit {unit.index} is already running on worker {self.name}")
                    for rid, _ in good:
                        self._owners[rid] = (state, rid[1])
                    self._units.add(state)
                    self._inbox.append((state, good))
                    self._cv.notify_all()
                stage[:] = ["engine", state]
            self._wait(state.done)
            if state.error is not None:
                raise EngineLoopError(
                    f"worker {self.name}: engine failed while running unit {unit.index}: {state.error!r}"
                ) from state.error
        with self._cv:
            stage[:] = ["writing", None]
        result = self.task.write_unit(unit, requests, outputs, self.tokenizer)
        if not result.worker:
            result.worker = self.name
        if not result.wall_s:
            result.wall_s = time.time() - t0
        with self._cv:
            self._finished_units += 1
        return result

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    # ---- the engine loop -----------------------------------------------------------
    def _engine_loop(self) -> None:
        eng = self.engine
        busy = False
        while True:
            control = None
            with self._cv:
                while not (self._stopped or busy or self._control or self._ops
                           or (self._inbox and not self._paused and not self._holding)):
                    self._cv.wait()
                if self._stopped:
                    return
                if self._control:
                    # the engine drains first; new prompts wait until the control has run
                    inbox = []
                    if not busy:
                        control = self._control.pop(0)
                        if control.hold is not None:
                            self._holding = control.hold
                elif self._paused or self._holding:
                    inbox = []  # held until resume_engine, or until a swap from memory ends
                else:
                    inbox, self._inbox = self._inbox, []
                    for state, _ in inbox:
                        state.in_engine = True
                ops = []
                if control is None:  # a control runs alone; the ops run in the next round
                    ops, self._ops = self._ops, []
            if control is not None:
                try:
                    control.result = control.fn(eng)
                except BaseException as exc:  # noqa: BLE001 - a half-done swap: the worker is broken
                    control.error = exc
                    self._break(eng, exc)
                    return
                finally:
                    control.done.set()
                continue
            try:
                for op in ops:
                    op(eng)
                for state, reqs in inbox:
                    for rid, req in reqs:
                        eng.add_request(req.prompt_tokens, req.params or self.task.params, req.prompt_id, request_id=rid)
                finished = []
                if eng.has_unfinished_requests():
                    finished = eng.step()
                    self._steps += 1
                busy = eng.has_unfinished_requests()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the units
                self._break(eng, exc)
                return
            if finished:
                self._deliver(finished)

    def _break(self, eng: Any, exc: BaseException) -> None:
        """The engine raised: fail every unit held, refuse new ones, drop the engine."""
        with self._cv:
            self._broken = exc
            self._tokens = int(getattr(eng, "num_generated_tokens", 0))
            self.engine = None  # the driver kills this process; drop the KV cache meanwhile
        self._fail_all(exc)

    def _deliver(self, finished: list[Any]) -> None:
        with self._cv:
            for out in finished:
                owner = self._owners.pop(out.request_id, None)
                if owner is None:  # not ours (a unit that already failed): drop it
                    continue
                state, row = owner
                state.outputs[row] = out
                state.remaining -= 1
                self._finished_requests += 1
                if state.remaining == 0:
                    self._units.discard(state)
                    state.done.set()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            units = list(self._units)
            self._inbox = []
            controls, self._control = self._control, []
            for state in units:
                self._units.discard(state)
            for rid in [rid for rid, (s, _) in self._owners.items() if s in units]:
                del self._owners[rid]
        for c in controls:
            c.error = exc
            c.done.set()
        for state in units:
            if not state.done.is_set():
                state.error = exc
                state.done.set()


def _node_id() -> str | None:
    try:
        import ray

        if not ray.is_initialized():  # in-process use (tests); never start or join Ray here
            return None
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - informational only
        return None


def make_actor_class(max_concurrency: int = 4):
    """GenerationWorker as a Ray actor class (threaded; the pool sets resources per actor)."""
    import ray

    return ray.remote(max_concurrency=max(3, max_concurrency))(GenerationWorker)
