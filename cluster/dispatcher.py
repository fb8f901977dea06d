"""The driver side: work units dispatched to `GenerationWorker` actors, through faults.

    with UnitDispatcher(task, num_workers=2, num_cpus=1) as pool:   # starts the workers
        pool.wait_ready()                                              # optional: engines loaded
        results = pool.run(units, on_result=print)                     # as many runs as wanted
        more = pool.run(other_units)                                   # same workers, same engines
    results = run_units(task, units, num_workers=2)                    # start, one run, close
    pool.load_weights("ckpt/step-200")                                 # between runs: every engine, in place

A dispatcher owns `num_workers` worker *slots*; each holds at most one actor at a time, and a
replaced actor's slot is refilled with a fresh one. Worker management lives on the object,
not in one run: the workers (and their loaded engines) outlive `run` until `close`.

Unit states (`UnitState`):
    queued     waiting for a worker (new, failed, lost with its worker, or a hedge copy)
    in_flight  one copy running on a worker
    overdue    a copy passed its deadline: a second copy is queued or running elsewhere
    committed  a copy returned; later copies are ignored (first commit wins)
    failed     charged `max_unit_attempts` failed attempts: the run raises UnitFailed
Worker states (`WorkerState`):
    starting   actor created, engine loading; gets no units (a start failure is never a unit's)
    ready      takes units, `in_flight_per_worker` at a time (2: its engine never drains at
               a unit boundary)
    suspect    one of its units is overdue: gets no new units, is pinged (`progress()`) until
               it shows progress (generated tokens or finished units grow: back to ready) or
               `suspect_timeout_s` passes (replaced)
    replaced   killed; its in-flight units went back to the queue

Failures (actors run with max_restarts=0, max_task_retries=0: the dispatcher owns retries):
- a unit's call raises (read/write error): the unit is charged one attempt and queued again,
  preferring another worker; a unit charged `max_unit_attempts` times fails the run.
- a worker fails `max_worker_failures` units in a row: it is replaced (the units were
  already charged).
- a worker's engine raises (`EngineLoopError`): every unit it holds is charged and queued,
  and the worker process is replaced (never an in-process engine rebuild).
- a worker dies (RayActorError: killed, OOM, node lost): as an engine failure.
- a unit passes its deadline (`unit_timeout_s`; None derives it: 10x the median time of the
  last committed units, at least 300 s, 1800 s before 3 units have committed): a second copy
  is dispatched to another worker and its worker becomes suspect; a worker still holding a
  copy `suspect_timeout_s` after another copy committed is replaced too (uncharged).
- a worker fails to start (its constructor raised, or its process died before ready): the
  slot is retried; a slot failing `max_start_failures` times in a row is given up while
  other workers run; when no worker runs and every empty slot is given up, the run fails
  with the last start error.
- no alive Ray node can host a worker (its total resources, not what is free now): the run
  fails within seconds, unless `may_add_nodes` (a cluster with an autoscaler), where the
  progress report says it is waiting for nodes; `start_timeout_s` without any ready worker
  fails the run in every case.

Unit commits are idempotent (one file per unit index, first commit wins, deterministic
sampling), so a unit that ran twice yields one committed file.

Weights (`load_weights`, used by cluster.generation_pool.GenerationPool): all workers load
and check a checkpoint, then swap it in, or none does (WeightsRefused); from then on every
worker started in a slot (a replacement) loads it after the task's checkpoint.
"""
from __future__ import annotations

import itertools
import logging
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable

from cluster.unit import UnitResult, UnitTask, WorkUnit

log = logging.getLogger("batchgen.pool")

UNIT_TIMEOUT_FACTOR = 10.0  # derived deadline: this many times the median unit time ...
UNIT_TIMEOUT_FLOOR_S = 300.0  # ... and never less than this
UNIT_TIMEOUT_INITIAL_S = 1800.0  # before MEDIAN_MIN_UNITS units have committed
MEDIAN_MIN_UNITS = 3
MEDIAN_WINDOW = 200  # the median is over the most recent committed units
NODE_CHECK_INTERVAL_S = 2.0


class UnitFailed(Exception):
    """The run cannot finish: a unit failed too often, workers cannot start, or no node can
    host a worker."""


class WeightsRefused(ValueError):
    """`load_weights` was refused: some worker could not load or use the checkpoint (the
    message names the worker and its error); every worker keeps the weights it had."""


class _Refused(RuntimeError):
    """A worker that started but cannot serve this run (its engine resolved another dtype)."""


class UnitState(str, Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    OVERDUE = "overdue"
    COMMITTED = "committed"
    FAILED = "failed"


class WorkerState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    SUSPECT = "suspect"
    REPLACED = "replaced"


@dataclass(slots=True, eq=False)
class _Copy:
    """One dispatched run of a unit on a worker."""

    unit: "_Unit"
    worker: "_Worker"
    sent: float
    overdue: bool = False
    orphaned_at: float | None = None  # another copy committed at this time


@dataclass(slots=True, eq=False)
class _Unit:
    unit: WorkUnit
    state: UnitState = UnitState.QUEUED
    attempts: int = 0  # failed attempts charged
    last_error: str = ""
    copies: list[_Copy] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)  # workers it failed on
    queued: bool = False  # in the dispatch queue now


@dataclass(slots=True, eq=False)
class _Worker:
    name: str
    slot: int
    handle: Any
    ready_ref: Any
    created: float
    state: WorkerState = WorkerState.STARTING
    info: dict = field(default_factory=dict)  # ready(): pid, host, node_id, device, dtype
    copies: dict = field(default_factory=dict)  # ObjectRef -> _Copy
    failures_in_row: int = 0
    progress: dict = field(default_factory=dict)  # the last progress() reply
    poll_ref: Any = None  # a pending progress() call
    poll_sent: float = 0.0
    suspect_since: float = 0.0
    baseline: tuple | None = None  # (generated_tokens, finished_units) at the first reply while suspect
    reason: str = ""  # why it was replaced


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(exc: BaseException | str, limit: int = 2000) -> str:
    text = _ANSI.sub("", str(exc)).strip() or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in _short(exc, 100_000).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _describe(unit: WorkUnit) -> str:
    return f"unit {unit.index} ({unit.source} rows {unit.row_start}-{unit.row_end})"


class UnitDispatcher:
    """Runs batches of work units on a set of `GenerationWorker` actors (module docstring).

    task: the UnitTask every worker loads (its engine_kwargs) and runs units with.
    num_workers: worker slots; num_cpus / num_gpus: Ray resources per actor (num_cpus is
        also the engine's torch thread count); actor_options: more Ray actor options (e.g.
        resources={"gen": 1}).
    max_unit_attempts: failed attempts that fail a unit (and the run).
    unit_timeout_s: seconds a unit copy may run before a second copy is dispatched (None:
        derived from committed units, see the module docstring).
    suspect_timeout_s: how long a suspect worker has to show progress (None: half the unit
        deadline, within [10, 60] s).
    max_start_failures: failed starts in a row before a slot is given up.
    max_worker_failures: units failing in a row on one worker before it is replaced.
    may_add_nodes: an autoscaler may add nodes; when no alive node can host a worker, wait
        (up to start_timeout_s) instead of failing at once.
    """

    def __init__(self, task: UnitTask, *, num_workers: int, num_cpus: float = 1, num_gpus: float = 0,
                 max_unit_attempts: int = 3, unit_timeout_s: float | None = None,
                 suspect_timeout_s: float | None = None, in_flight_per_worker: int = 2,
                 progress_interval_s: float = 1.0, start_timeout_s: float = 900.0, max_start_failures: int = 3,
                 max_worker_failures: int = 3, may_add_nodes: bool = False, actor_options: dict | None = None) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.task = task
        self.num_workers = int(num_workers)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.max_unit_attempts = max(1, int(max_unit_attempts))
        self.unit_timeout_s = unit_timeout_s
        self.suspect_timeout_s = suspect_timeout_s
        self.in_flight_per_worker = max(1, int(in_flight_per_worker))
        self.progress_interval_s = progress_interval_s
        self.start_timeout_s = start_timeout_s
        self.max_start_failures = max(1, int(max_start_failures))
        self.max_worker_failures = max(1, int(max_worker_failures))
        self.may_add_nodes = may_add_nodes
        self.options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)
        self.options.update(actor_options or {})
        self.needs = {"CPU": num_cpus, "GPU": num_gpus, **(self.options.get("resources") or {})}
        self.waiting_for_nodes = ""  # why no worker can start now (when may_add_nodes)
        self.events: deque[tuple[float, str, str]] = deque(maxlen=10_000)  # (time, kind, detail)
        self.auto_dtype: str | None = None  # what the workers resolved model dtype "auto" to
        self.tokens_by_worker: dict[str, int] = {}
        self.progress_by_worker: dict[str, dict] = {}
        self._slots: list[_Worker | None] = [None] * self.num_workers
        self._slot_failures = [0] * self.num_workers
        self._refs: dict[Any, tuple[str, _Worker]] = {}  # pending ObjectRef -> (kind, worker)
        self._dropped: list[Any] = []  # calls of replaced workers: collected so Ray does not log them unhandled
        self._counter = itertools.count()
        self._durations: deque[float] = deque(maxlen=MEDIAN_WINDOW)
        self._timeout_cache: float | None = None
        self._last_start_error = ""
        self._no_worker_since: float | None = None
        self._next_node_check = 0.0
        self._actor_cls = None
        self._units: dict[int, _Unit] = {}
        self._queue: deque[_Unit] = deque()
        self._pending = 0
        self._closed = False
        self.weights: tuple[str, int | None] | None = None  # swapped in by load_weights; None: the task's

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "UnitDispatcher":
        """Create the actor class and start a worker in every slot (returns at once)."""
        from cluster.worker import make_actor_class

        if self._actor_cls is None:
            self._actor_cls = make_actor_class(max_concurrency=self.in_flight_per_worker + 3)
        for slot in range(self.num_workers):
            if self._slots[slot] is None:
                self._start_worker(slot)
        return self

    def wait_ready(self, timeout_s: float | None = None) -> int:
        """Start the workers and block until every slot's worker is ready (failed starts
        are retried as in `run`), or `timeout_s` passes; returns the number of ready
        workers. Raises UnitFailed when workers keep failing to start or no node can host
        one, as `run` does."""
        import ray

        self.start()
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._fill_slots()
            starting = {w.ready_ref: w for w in self._slots if w is not None and w.state == WorkerState.STARTING}
            now = time.monotonic()
            if not starting or (end is not None and now >= end):
                return len(self._live())
            self._check_can_run(now)
            wait = 2.0 if end is None else max(0.01, min(2.0, end - now))
            done, _ = ray.wait(list(starting), num_returns=1, timeout=wait)
            for ref in done:
                self._refs.pop(ref, None)
                self._on_ready(ray, ref, starting[ref])

    def load_weights(self, path: str, *, step: int | None = None) -> list[dict]:
        """Swap checkpoint `path`'s weights into every worker's engine, all or nothing, without
        restarting a worker or reallocating its KV cache (GenerationWorker.stage_weights /
        commit_weights). Call between runs.

        Waits for starting workers first; then every worker loads and checks the checkpoint
        (its engine keeps decoding any late copy of an earlier run meanwhile), and only if
        all succeed does each swap it in, once its engine is idle. Workers started later
        (replacements) load these weights after the task's checkpoint. step: for a
        nanochat directory (default: its highest step, resolved now, so replacements load
        the same one). Returns each worker's engine_state() after the swap.
        Raises WeightsRefused when a worker cannot load the checkpoint or it does not fit
        (naming the worker and the error; every worker keeps its weights), UnitFailed when
        no worker is running. A worker that dies, or fails in the middle of its swap, is
        replaced (with the new weights once the swap was decided).
        """
        import ray
        from ray.exceptions import RayTaskError

        if self._closed:
            raise RuntimeError("this UnitDispatcher is closed")
        self.wait_ready()
        live = self._live()
        if not live:
            raise UnitFailed(f"load_weights({path}): no worker is running; last start error: "
                             f"{self._last_start_error or 'none'}")
        refs = {w.handle.stage_weights.remote(path, step): w for w in live}
        staged: dict[_Worker, dict] = {}
        refused: list[str] = []
        for ref, w in refs.items():
            try:
                staged[w] = ray.get(ref)
            except RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                refused.append(f"{w.name}: {type(cause).__name__}: {_short(cause)}")
            except Exception as exc:  # noqa: BLE001 - RayActorError: the worker is gone
                self._replace(w, f"worker {w.name} died while loading weights: {_short(exc)}", charge=False)
        if refused or not staged:
            for ref in [w.handle.discard_weights.remote() for w in staged]:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - a worker gone meanwhile keeps nothing staged
                    pass
            keeps = f"{self.weights[0]!r}" if self.weights else "the pool's checkpoint"
            why = refused[0] if refused else "every worker died while loading it"
            raise WeightsRefused(f"load_weights({path!r}) refused by {len(refused) or len(live)} of {len(live)} "
                                 f"worker(s); {why}; the workers keep the weights of {keeps}")
        self.weights = (path, next(iter(staged.values()))["step"])
        self._event("weights", f"{path} (step {self.weights[1]})")
        commits = {w.handle.commit_weights.remote(): w for w in staged}
        states = []
        for ref, w in commits.items():
            try:
                states.append(ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - a half-swapped engine: replace the worker
                self._replace(w, f"its weights swap failed: {_short(exc, 300)}", charge=False)
        self._fill_slots()
        return states

    def close(self) -> None:
        """Kill every worker; the dispatcher cannot run again."""
        self._closed = True
        for w in list(self._slots):
            if w is not None:
                self._kill(w)
        self._slots = [None] * self.num_workers
        self._refs.clear()

    def __enter__(self) -> "UnitDispatcher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def workers(self) -> list[dict]:
        """A snapshot of the slots: name, state, info, in-flight units (for reports and tests)."""
        return [{"slot": i, "name": w.name, "state": w.state.value, "info": dict(w.info),
                 "units": sorted(c.unit.unit.index for c in w.copies.values())}
                for i, w in enumerate(self._slots) if w is not None]

    def engine_states(self) -> list[dict]:
        """GenerationWorker.engine_state() of every worker (pid, the weights swapped in last,
        its KV cache), once the starting ones are ready (a replacement started late in a
        run may still be loading). Raises RayActorError for a worker that died since the
        last run, UnitFailed as wait_ready."""
        import ray

        self.wait_ready()
        return ray.get([w.handle.engine_state.remote() for w in self._live()])

    def unit_timeout(self) -> float:
        """The current per-copy deadline in seconds (fixed, or derived from committed units)."""
        if self.unit_timeout_s is not None:
            return float(self.unit_timeout_s)
        if self._timeout_cache is None:
            if len(self._durations) < MEDIAN_MIN_UNITS:
                self._timeout_cache = UNIT_TIMEOUT_INITIAL_S
            else:
                self._timeout_cache = max(UNIT_TIMEOUT_FLOOR_S, UNIT_TIMEOUT_FACTOR * statistics.median(self._durations))
        return self._timeout_cache

    def suspect_timeout(self) -> float:
        if self.suspect_timeout_s is not None:
            return float(self.suspect_timeout_s)
        return min(60.0, max(10.0, 0.5 * self.unit_timeout()))

    # ------------------------------------------------------------------ one run
    def run(self, units: Iterable[WorkUnit], *, on_result: Callable[[UnitResult], None] | None = None,
            on_progress: Callable[[dict], None] | None = None,
            watchdog: Callable[[], None] | None = None) -> list[UnitResult]:
        """Run every unit until one copy of each has committed; results in commit order.

        on_result(result): called for each committed unit (the first copy's result).
        on_progress(info): about every progress_interval_s, with {"generated_tokens": total
            over every worker ever started, "workers": {name: progress()}, "live_workers":
            ready workers, "starting", "suspect", "queued", "in_flight", "done",
            "waiting_for_nodes": "" or why no worker can start}.
        watchdog(): called every loop iteration; whatever it raises ends the run (the job
            runner checks its output lease there).
        Raises UnitFailed (see the module docstring); the workers stay up for another run.
        """
        import ray

        if self._closed:
            raise RuntimeError("this UnitDispatcher is closed")
        self._units = {u.index: _Unit(u) for u in units}
        if not self._units:
            return []
        self._queue = deque()
        for u in sorted(self._units.values(), key=lambda x: x.unit.index):
            self._enqueue(u)
        self._pending = len(self._units)
        self._slot_failures = [0] * self.num_workers  # a new run tries given-up slots again
        self._no_worker_since = None
        self.start()
        results: list[UnitResult] = []
        next_progress = time.monotonic() + self.progress_interval_s
        while self._pending:
            if watchdog is not None:
                watchdog()
            now = time.monotonic()
            self._fill_slots()
            self._dispatch(now)
            self._wait_and_handle(ray, self._wakeup(now, on_progress is not None), results, on_result)
            now = time.monotonic()
            self._check_deadlines(now)
            self._check_suspects(now)
            self._check_can_run(now)
            if on_progress is not None and now >= next_progress:
                next_progress = now + self.progress_interval_s
                self._poll_all(now)
                on_progress(self._report(len(results)))
        if on_progress is not None:
            self._final_progress(ray)
            on_progress(self._report(len(results)))
        return results

    # ------------------------------------------------------------------ workers
    def _start_worker(self, slot: int) -> _Worker:
        name = f"worker-{next(self._counter)}"
        threads = max(1, int(self.num_cpus)) if self.num_cpus else None
        handle = self._actor_cls.options(**self.options).remote(self.task, name, threads, self.weights)
        w = _Worker(name=name, slot=slot, handle=handle, ready_ref=handle.ready.remote(), created=time.monotonic())
        self._refs[w.ready_ref] = ("ready", w)
        self._slots[slot] = w
        self._event("start", f"{name} in slot {slot}")
        return w

    def _fill_slots(self) -> None:
        for slot, w in enumerate(self._slots):
            if w is None and self._slot_failures[slot] < self.max_start_failures:
                self._start_worker(slot)

    def _live(self) -> list[_Worker]:
        return [w for w in self._slots if w is not None and w.state in (WorkerState.READY, WorkerState.SUSPECT)]

    def _kill(self, w: _Worker) -> None:
        import ray

        for ref in [r for r, (_, owner) in self._refs.items() if owner is w]:
            del self._refs[ref]
            self._dropped.append(ref)
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _replace(self, w: _Worker, why: str, *, charge: bool) -> None:
        """Kill `w`, free its slot and queue its units again (charging each one if `charge`)."""
        if w.state == WorkerState.REPLACED:
            return
        started = w.state != WorkerState.STARTING
        w.state, w.reason = WorkerState.REPLACED, why
        self._kill(w)
        if self._slots[w.slot] is w:
            self._slots[w.slot] = None
        copies = list(w.copies.values())
        w.copies.clear()
        if started:
            log.warning("replacing %s: %s", w.name, why)
        self._event("replaced", f"{w.name}: {why}")
        for c in sorted(copies, key=lambda c: c.unit.unit.index, reverse=True):
            u = c.unit
            u.copies = [x for x in u.copies if x is not c]
            if u.state in (UnitState.COMMITTED, UnitState.FAILED) or self._units.get(u.unit.index) is not u:
                continue
            if charge:
                self._charge(u, why)
            if not u.copies:
                u.state = UnitState.QUEUED
                self._enqueue(u, front=True)

    def _start_failed(self, w: _Worker, exc: BaseException) -> None:
        if getattr(exc, "actor_init_failed", False):
            why = f"worker {w.name} could not start: {_last_line(exc)}\n{_short(exc)}"
        elif isinstance(exc, _Refused):
            why = str(exc)
        else:
            why = f"worker {w.name} died before it was ready: {_short(exc)}"
        self._slot_failures[w.slot] += 1
        self._last_start_error = why
        log.warning("%s (attempt %d of %d for slot %d)", why.splitlines()[0], self._slot_failures[w.slot],
                    self.max_start_failures, w.slot)
        self._replace(w, why.splitlines()[0], charge=False)

    # ------------------------------------------------------------------ units
    def _enqueue(self, u: _Unit, front: bool = False) -> None:
        if u.queued:
            return
        u.queued = True
        if front:
            self._queue.appendleft(u)
        else:
            self._queue.append(u)

    def _charge(self, u: _Unit, why: str) -> None:
        u.attempts += 1
        u.last_error = why
        self._event("unit_failed", f"unit {u.unit.index} attempt {u.attempts}: {why.splitlines()[0]}")
        if u.attempts >= self.max_unit_attempts:
            u.state = UnitState.FAILED
            raise UnitFailed(f"{_describe(u.unit)} failed {u.attempts} times "
                             f"(max_unit_attempts={self.max_unit_attempts}); last error: {why}")

    def _dispatch(self, now: float) -> None:
        """Queued units to ready workers with room, the least loaded first. A unit avoids the
        workers it failed on when it can, and two copies of a unit never share a worker."""
        window = 4 * self.num_workers * self.in_flight_per_worker + 8  # scan limit: the queue may be long
        while self._queue:
            ready = sorted((w for w in self._slots if w is not None and w.state == WorkerState.READY
                            and len(w.copies) < self.in_flight_per_worker), key=lambda x: len(x.copies))
            for w in ready:
                i = self._pick(w, window)
                if i is not None:
                    u = self._queue[i]
                    del self._queue[i]
                    u.queued = False
                    self._send(u, w, now)
                    break
            else:
                return

    def _pick(self, w: _Worker, window: int) -> int | None:
        """Index in the queue of the unit `w` should take: the first it has not failed, else
        the first it may take at all (not one it already runs)."""
        fallback = None
        for i, u in enumerate(itertools.islice(self._queue, window)):
            if any(c.worker is w for c in u.copies):
                continue
            if w.name not in u.avoid:
                return i
            if fallback is None:
                fallback = i
        return fallback

    def _send(self, u: _Unit, w: _Worker, now: float) -> None:
        ref = w.handle.run_unit.remote(u.unit)
        c = _Copy(unit=u, worker=w, sent=now)
        w.copies[ref] = c
        u.copies.append(c)
        self._refs[ref] = ("unit", w)
        if u.state != UnitState.OVERDUE:
            u.state = UnitState.IN_FLIGHT
        if len(u.copies) > 1:
            self._event("hedge", f"unit {u.unit.index} second copy on {w.name}")

    # ------------------------------------------------------------------ waiting
    def _wakeup(self, now: float, reporting: bool) -> float:
        t = min(self.progress_interval_s if reporting else 2.0, 2.0)
        if self.unit_timeout_s is not None or self._durations:
            deadline = self.unit_timeout()
            for w in self._slots:
                if w is None:
                    continue
                for c in w.copies.values():
                    if not c.overdue:
                        t = min(t, c.sent + deadline - now)
        return max(0.01, t)

    def _collect_dropped(self, ray: Any) -> None:
        if self._dropped:
            done, self._dropped = ray.wait(self._dropped, num_returns=len(self._dropped), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - the worker was replaced; its reply no longer matters
                    pass

    def _wait_and_handle(self, ray: Any, timeout: float, results: list, on_result: Callable | None) -> None:
        self._collect_dropped(ray)
        refs = list(self._refs)
        if not refs:  # no worker at all: _check_can_run explains why, or the slots refill next round
            self._check_can_run(time.monotonic())
            return
        done, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if done and rest:  # collect everything already finished, not just one
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            done = list(done) + list(more)
        for ref in done:
            entry = self._refs.pop(ref, None)
            if entry is None:
                continue
            kind, w = entry
            if w.state == WorkerState.REPLACED:
                continue
            if kind == "ready":
                self._on_ready(ray, ref, w)
            elif kind == "poll":
                self._on_poll(ray, ref, w)
            else:
                self._on_unit(ray, ref, w, results, on_result)

    def _on_ready(self, ray: Any, ref: Any, w: _Worker) -> None:
        try:
            w.info = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - any failure before ready is a start failure
            self._start_failed(w, exc)
            return
        refused = self._check_auto_dtype(w)
        if refused:
            self._start_failed(w, _Refused(refused))
            return
        w.state = WorkerState.READY
        self._slot_failures[w.slot] = 0
        self._event("ready", f"{w.name} pid {w.info.get('pid')} on {w.info.get('host')}")

    def _check_auto_dtype(self, w: _Worker) -> str | None:
        """With model dtype "auto", every worker's engine resolves it for its own machine
        (bfloat16 only where it is native and faster: GPUs of compute capability 8.0 and up,
        CPUs with AVX-512 BF16; engine/checkpoint.py): the first ready worker's choice is the
        run's, and a worker that resolved another (a GPU of another generation, a CPU of
        another kind) is refused, so that one run never mixes dtypes. Returns why, or None."""
        if self.task.engine_kwargs.get("dtype") != "auto" or not w.info.get("dtype"):
            return None
        got = w.info["dtype"]
        if self.auto_dtype is None:
            self.auto_dtype = got
            return None
        if got == self.auto_dtype:
            return None
        return (f"worker {w.name} on {w.info.get('host')} ({w.info.get('device')}) resolved model.dtype auto to "
                f"{got}, but this run's workers use {self.auto_dtype}: set model.dtype to one of them explicitly "
                f"to run on mixed machines")

    def _on_poll(self, ray: Any, ref: Any, w: _Worker) -> None:
        from ray.exceptions import RayTaskError

        w.poll_ref = None
        try:
            info = ray.get(ref)
        except RayTaskError:
            return  # progress is best effort
        except Exception as exc:  # noqa: BLE001 - RayActorError and other system errors: the worker is gone
            self._replace(w, f"worker {w.name} died: {_short(exc)}", charge=True)
            return
        w.progress = info
        self.progress_by_worker[w.name] = info
        self.tokens_by_worker[w.name] = max(self.tokens_by_worker.get(w.name, 0), int(info.get("generated_tokens", 0)))
        if w.state == WorkerState.SUSPECT:
            mark = (int(info.get("generated_tokens", 0)), int(info.get("finished_units", 0)))
            if w.baseline is None:
                w.baseline = mark
            elif mark[0] > w.baseline[0] or mark[1] > w.baseline[1]:
                w.state = WorkerState.READY
                log.info("%s is slow but alive (progress since its unit passed the deadline)", w.name)
                self._event("alive", w.name)

    def _on_unit(self, ray: Any, ref: Any, w: _Worker, results: list, on_result: Callable | None) -> None:
        from ray.exceptions import RayTaskError

        from cluster.worker import EngineLoopError

        c = w.copies.get(ref)
        if c is None:
            return
        try:
            result = ray.get(ref)
        except RayTaskError as exc:
            w.copies.pop(ref, None)
            u = c.unit
            u.copies = [x for x in u.copies if x is not c]
            if u.state in (UnitState.COMMITTED, UnitState.FAILED) or self._units.get(u.unit.index) is not u:
                return  # a copy of a unit already committed (or of an earlier run)
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            why = f"on {w.name}: {_short(cause)}"
            if isinstance(cause, EngineLoopError) or isinstance(exc, EngineLoopError):
                self._charge(u, why)
                if not u.copies:
                    u.state = UnitState.QUEUED
                    self._enqueue(u, front=True)
                self._replace(w, f"its engine failed: {_short(cause, 300)}", charge=True)
                return
            w.failures_in_row += 1
            u.avoid.add(w.name)
            self._charge(u, why)
            if not u.copies:
                u.state = UnitState.QUEUED
                self._enqueue(u)
            if w.failures_in_row >= self.max_worker_failures:
                self._replace(w, f"{w.failures_in_row} units failed in a row on it", charge=False)
            return
        except Exception as exc:  # noqa: BLE001 - RayActorError and other system errors: the worker is gone
            self._replace(w, f"worker {w.name} died: {_short(exc)}", charge=True)
            return
        w.copies.pop(ref, None)
        u = c.unit
        u.copies = [x for x in u.copies if x is not c]
        w.failures_in_row = 0
        if w.state == WorkerState.SUSPECT:
            w.state = WorkerState.READY  # it committed: alive
        if u.state in (UnitState.COMMITTED, UnitState.FAILED) or self._units.get(u.unit.index) is not u:
            self._event("duplicate", f"unit {u.unit.index} second copy done on {w.name}")
            return
        now = time.monotonic()
        u.state = UnitState.COMMITTED
        if u.queued:  # a second copy was waiting for a worker: not needed any more
            self._queue.remove(u)
            u.queued = False
        for other in u.copies:
            other.orphaned_at = now
        self._pending -= 1
        self._durations.append(now - c.sent)
        self._timeout_cache = None
        results.append(result)
        if on_result is not None:
            on_result(result)

    # ------------------------------------------------------------------ health checks
    def _check_deadlines(self, now: float) -> None:
        if not any(w is not None and w.copies for w in self._slots):
            return
        deadline = self.unit_timeout()
        for w in list(self._slots):
            if w is None or w.state not in (WorkerState.READY, WorkerState.SUSPECT):
                continue
            for c in list(w.copies.values()):
                if c.overdue or now - c.sent <= deadline:
                    continue
                c.overdue = True
                u = c.unit
                if u.state in (UnitState.COMMITTED, UnitState.FAILED) or self._units.get(u.unit.index) is not u:
                    continue
                u.state = UnitState.OVERDUE
                log.warning("unit %d passed its deadline on %s (%.0fs > %.0fs): dispatching a second copy",
                            u.unit.index, w.name, now - c.sent, deadline)
                self._event("overdue", f"unit {u.unit.index} on {w.name}")
                if len(u.copies) < 2:
                    self._enqueue(u, front=True)
                if w.state == WorkerState.READY:
                    w.state, w.suspect_since, w.baseline = WorkerState.SUSPECT, now, None
                    self._event("suspect", w.name)
                    self._poll(w, now)

    def _check_suspects(self, now: float) -> None:
        limit = self.suspect_timeout()
        for w in list(self._slots):
            if w is None:
                continue
            orphan = [c for c in w.copies.values() if c.orphaned_at is not None
                      and now - c.orphaned_at > limit]
            if orphan:
                self._replace(w, f"still running unit {orphan[0].unit.unit.index} {now - orphan[0].orphaned_at:.0f}s "
                                 f"after another copy committed it", charge=False)
                continue
            if w.state != WorkerState.SUSPECT:
                continue
            if now - w.suspect_since > limit:
                stuck = sorted(c.unit.unit.index for c in w.copies.values() if c.overdue)
                self._replace(w, f"stalled: no progress within {limit:.0f}s after unit(s) {stuck} passed the "
                                 f"deadline of {self.unit_timeout():.0f}s", charge=True)
            elif w.poll_ref is None and now - w.poll_sent >= limit / 5:
                self._poll(w, now)

    def _check_can_run(self, now: float) -> None:
        """Fail the run when no worker can ever run a unit; see the module docstring."""
        if self._live():
            self._no_worker_since = None
            self.waiting_for_nodes = ""
            return
        if self._no_worker_since is None:
            self._no_worker_since = now
        starting = any(w is not None and w.state == WorkerState.STARTING for w in self._slots)
        refillable = any(w is None and f < self.max_start_failures for w, f in zip(self._slots, self._slot_failures))
        if not starting and not refillable:
            raise UnitFailed(f"workers keep failing to start ({self.max_start_failures} attempts in a row for each "
                             f"of {self.num_workers} worker slot(s)); last error: {self._last_start_error or 'none'}")
        if now >= self._next_node_check:
            self._next_node_check = now + NODE_CHECK_INTERVAL_S
            from cluster.resources import feasibility

            f = feasibility(self.needs)
            if f.ok:
                self.waiting_for_nodes = ""
            elif not self.may_add_nodes:
                cause = ("the Ray node this job runs on died (its raylet exited: killed, out of memory, or the "
                         "machine failed)" if f.alive == 0 and f.dead else
                         "nothing can run it, and no autoscaler can add a node to this Ray instance")
                raise UnitFailed(f"no Ray node can host a worker: {f.why}; {cause}")
            else:
                if not self.waiting_for_nodes:
                    log.warning("waiting for nodes: %s", f.why)
                self.waiting_for_nodes = f.why
        if now - self._no_worker_since > self.start_timeout_s:
            raise UnitFailed(
                f"no worker became ready within {self.start_timeout_s:.0f}s (resources per worker: {self.needs}"
                + (f"; {self.waiting_for_nodes}" if self.waiting_for_nodes else "")
                + (f"; last error: {self._last_start_error}" if self._last_start_error else "") + ")")

    # ------------------------------------------------------------------ progress
    def _poll(self, w: _Worker, now: float) -> None:
        if w.poll_ref is None and w.state in (WorkerState.READY, WorkerState.SUSPECT):
            w.poll_ref = w.handle.progress.remote()
            w.poll_sent = now
            self._refs[w.poll_ref] = ("poll", w)

    def _poll_all(self, now: float) -> None:
        for w in self._slots:
            if w is not None:
                self._poll(w, now)

    def _final_progress(self, ray: Any) -> None:
        """A last, complete report (workers are idle now)."""
        live = self._live()
        final = {w: w.handle.progress.remote() for w in live}
        ok, _ = ray.wait(list(final.values()), num_returns=len(final), timeout=10) if final else ([], [])
        for w, ref in final.items():
            if ref in ok:
                try:
                    info = ray.get(ref)
                except Exception:  # noqa: BLE001 - best effort
                    continue
                self.progress_by_worker[w.name] = info
                self.tokens_by_worker[w.name] = max(self.tokens_by_worker.get(w.name, 0),
                                                    int(info.get("generated_tokens", 0)))

    def _report(self, done: int) -> dict:
        states = [w.state for w in self._slots if w is not None]
        return {
            "generated_tokens": sum(self.tokens_by_worker.values()),
            "workers": dict(self.progress_by_worker),
            "live_workers": states.count(WorkerState.READY),
            "starting": states.count(WorkerState.STARTING),
            "suspect": states.count(WorkerState.SUSPECT),
            "queued": len(self._queue),
            "in_flight": sum(1 for u in self._units.values() if u.copies and u.state != UnitState.COMMITTED),
            "done": done,
            "waiting_for_nodes": self.waiting_for_nodes,
        }

    def _event(self, kind: str, detail: str) -> None:
        self.events.append((time.time(), kind, detail))


def run_units(task: UnitTask, units: list[WorkUnit], *, num_workers: int, num_cpus: float = 1, num_gpus: float = 0,
              max_unit_attempts: int = 3, on_result: Callable[[UnitResult], None] | None = None,
              on_progress: Callable[[dict], None] | None = None, watchdog: Callable[[], None] | None = None,
              **options: Any) -> list[UnitResult]:
    """Run every unit once on `num_workers` actors (at most one per unit) and stop them;
    results in commit order. `options`: the other UnitDispatcher arguments. Raises UnitFailed."""
    units = list(units)
    if not units:
        return []
    with UnitDispatcher(task, num_workers=min(num_workers, len(units)), num_cpus=num_cpus, num_gpus=num_gpus,
                        max_unit_attempts=max_unit_attempts, **options) as pool:
        return pool.run(units, on_result=on_result, on_progress=on_progress, watchdog=watchdog)
