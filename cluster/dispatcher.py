"""The driver side: work units dispatched to `GenerationWorker` actors, through faults.

    with UnitDispatcher(task, num_workers=2, num_cpus=1) as pool:   # starts the workers
        pool.wait_ready()                                              # optional: engines loaded
        results = pool.run(units, on_result=print)                     # as many runs as wanted
        more = pool.run(other_units)                                   # same workers, same engines
    results = run_units(task, units, num_workers=2)                    # start, one run, close
    pool.load_weights("ckpt/step-200")                                 # between runs: every engine, in place
    pool.update_weights(list(model.state_dict().items()))              # or a trainer's tensors, in buckets

A dispatcher sends copies of units to workers and hears back. Its collaborators keep the
books: `UnitQueue` (cluster/unit_queue.py) the units' states and copies, the queue, attempts
and the deadline; `WorkerSlots` (cluster/health.py) the `num_workers` worker slots, their
starts, pings, suspects and replacements, and whether any node can host a worker. The
workers (and their loaded engines) outlive `run` until `close`.

Failures (actors run with max_restarts=0, max_task_retries=0: the dispatcher owns retries):
- a unit's call raises (read/write error): the unit is charged one attempt and queued again,
  preferring another worker; a unit charged `max_unit_attempts` times fails the run.
- a worker fails `max_worker_failures` units in a row: it is replaced (the units were
  already charged).
- a worker's engine raises (`EngineLoopError`): every unit it holds is charged and queued,
  and the worker process is replaced (never an in-process engine rebuild).
- a worker dies (RayActorError: killed, OOM, node lost): as an engine failure.
- a unit passes its deadline (`unit_timeout_s`, or derived from committed units): a second
  copy is dispatched to another worker and its worker becomes suspect (replaced, its units
  charged, if that copy shows no progress of its own within `suspect_timeout_s`; with one
  worker the replacement runs the unit again); a worker still holding a copy
  `suspect_timeout_s` after another copy committed is replaced too (uncharged).
- a worker fails to start, or is not ready within `start_timeout_s`: the slot is retried,
  and given up after `max_start_failures` in a row while other workers run; when no worker
  can ever start, or no alive Ray node can host one (unless `may_add_nodes`: then it waits
  for nodes, up to `start_timeout_s`), the run fails (cluster/health.py).

Unit commits are idempotent (one file per unit index, first commit wins, deterministic
sampling), so a unit that ran twice yields one committed file.

Weights (`load_weights` and `update_weights`, used by jobs.pool.GenerationPool): all workers
check a checkpoint or a trainer's tensors, then swap them in, or none does
(cluster/weight_sync.py); from then on every worker started in a slot (a replacement)
loads them after the task's checkpoint.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable

from cluster.health import WorkerRecord, WorkerSlots, WorkerState, short_error
from cluster.unit import UnitFailed, UnitResult, UnitTask, WorkUnit
from cluster.unit_queue import Copy, UnitQueue
from cluster.weight_sync import PoolWeights, HangDeadline, commit_everywhere, stage_everywhere, update_everywhere


class UnitDispatcher:
    """Runs batches of work units on a set of `GenerationWorker` actors (module docstring).

    task: the UnitTask every worker loads (its engine_kwargs) and runs units with.
    num_workers: worker slots; num_cpus / num_gpus: Ray resources per actor (num_cpus is
        also the engine's torch thread count); actor_options: more Ray actor options (e.g.
        resources={"gen": 1}).
    max_unit_attempts: failed attempts that fail a unit (and the run).
    unit_timeout_s: seconds a unit copy may run before a second copy is dispatched (None:
        10x the median time of the last committed units, at least 300 s; 1800 s before 3
        units have committed).
    suspect_timeout_s: how long a suspect worker has to show progress (None: half the unit
        deadline, within [10, 60] s).
    max_start_failures: failed starts in a row before a slot is given up.
    max_worker_failures: units failing in a row on one worker before it is replaced.
    may_add_nodes: an autoscaler may add nodes; when no alive node can host a worker, wait
        (up to start_timeout_s) instead of failing at once.
    on_auto_dtype(dtype): called once, with what the first ready worker resolved model dtype
        "auto" to, before that worker gets a unit (cluster/health.py refuse_dtype); what it
        raises ends the run.
    kernels: "compiled" or "torch": the CPU kernels the workers must compute with (a resumed
        output's); None: the first ready CPU worker's, passed to on_kernels as on_auto_dtype
        (cluster/health.py refuse_kernels).
    """

    def __init__(self, task: UnitTask, *, num_workers: int, num_cpus: float = 1, num_gpus: float = 0,
                 max_unit_attempts: int = 3, unit_timeout_s: float | None = None,
                 suspect_timeout_s: float | None = None, in_flight_per_worker: int = 2,
                 progress_interval_s: float = 1.0, start_timeout_s: float = 900.0, max_start_failures: int = 3,
                 max_worker_failures: int = 3, may_add_nodes: bool = False, actor_options: dict | None = None,
                 on_auto_dtype: Callable[[str], None] | None = None, kernels: str | None = None,
                 on_kernels: Callable[[str], None] | None = None) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.task = task
        self.num_workers = int(num_workers)
        self.in_flight_per_worker = max(1, int(in_flight_per_worker))
        self.progress_interval_s = progress_interval_s
        self.max_worker_failures = max(1, int(max_worker_failures))
        self.events: deque[tuple[float, str, str]] = deque(maxlen=10_000)  # (time, kind, detail)
        self.units = UnitQueue(max_unit_attempts=max_unit_attempts, unit_timeout_s=unit_timeout_s,
                               events=self.events)
        self.slots = WorkerSlots(task, num_workers=self.num_workers, num_cpus=num_cpus, num_gpus=num_gpus,
                                 in_flight_per_worker=self.in_flight_per_worker, actor_options=actor_options,
                                 suspect_timeout_s=suspect_timeout_s, start_timeout_s=start_timeout_s,
                                 max_start_failures=max_start_failures, may_add_nodes=may_add_nodes,
                                 events=self.events, on_auto_dtype=on_auto_dtype, kernels=kernels,
                                 on_kernels=on_kernels)
        self._closed = False

    # what the collaborators know, as the dispatcher's own (reports, tests)
    @property
    def weights(self) -> PoolWeights | None:
        """The weights swapped in last (a checkpoint's path and step, whether an update from
        memory came since) and the count of swaps; None: the task's checkpoint."""
        return self.slots.weights

    @property
    def auto_dtype(self) -> str | None:
        """What the workers resolved model dtype "auto" to (None before the first is ready)."""
        return self.slots.auto_dtype

    @property
    def waiting_for_nodes(self) -> str:
        """Why no worker can start now (when may_add_nodes), else ""."""
        return self.slots.waiting_for_nodes

    def unit_timeout(self) -> float:
        """The current per-copy deadline in seconds (fixed, or derived from committed units)."""
        return self.units.deadline()

    def suspect_timeout(self) -> float:
        return self.slots.suspect_timeout(self.unit_timeout())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "UnitDispatcher":
        """Create the actor class and start a worker in every slot (returns at once)."""
        self.slots.start()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> int:
        """Start the workers and block until every slot's worker is ready (failed starts
        are retried as in `run`), or `timeout_s` passes; returns the number of ready
        workers. Once some worker is ready it waits at most `start_timeout_s` for the
        others (a slot Ray cannot place keeps starting in the background). Raises
        UnitFailed when workers keep failing to start or no node can host one, as `run`
        does."""
        return self.slots.wait_ready(timeout_s)

    def load_weights(self, path: str, *, step: int | None = None) -> list[dict]:
        """Swap checkpoint `path`'s weights into every worker's engine, all or nothing, without
        restarting a worker or reallocating its KV cache (cluster/weight_sync.py). Call
        between runs. Waits for starting workers first. step: for a nanochat directory
        (default: its highest step, resolved now, so replacements load the same one).
        Returns each worker's engine_state() after the swap.
        Raises WeightsRefused when a worker cannot load the checkpoint or it does not fit
        (naming the worker and the error; every worker keeps its weights), UnitFailed when
        no worker is running. A worker that dies, fails in the middle of its swap, or hangs (no
        answer within `start_timeout_s` while its engine stays still: cluster/weight_sync.py)
        is replaced (with the new weights once the swap was decided)."""
        live, replace, keeps = self._swap_start(f"load_weights({path})")
        staged = stage_everywhere(live, path, step, keeps, replace, self.slots.start_timeout_s)
        version = self._version() + 1
        # decided: the workers get known weights again (a refused swap, raising above, left a
        # lost update's failure standing: runs must not go on under its weight_version)
        self.slots.weights_lost = ""
        self.slots.weights = PoolWeights(version=version, path=path, step=next(iter(staged.values()))["step"])
        self._event("weights", f"{path} (step {self.weights.step})")
        states = commit_everywhere(staged, replace, version, self.slots.start_timeout_s)
        self.slots.fill()
        return states

    def update_weights(self, pairs: list[tuple[str, Any]], *, bucket_bytes: int) -> list[dict]:
        """Swap a trainer's tensors ((name, tensor) pairs) into every worker's engine, all or
        nothing, in buckets of about `bucket_bytes` through the object store, without
        restarting a worker or reallocating its KV cache (cluster/weight_sync.py
        `update_everywhere`). Call between runs. Returns each worker's engine_state().
        Raises WeightsRefused naming the worker and every difference (every worker keeps its
        weights), TypeError for an entry that is not a (name, tensor) pair, UnitFailed when
        no worker is running. A worker that dies, fails in the middle, or hangs (as in
        load_weights) is replaced, with the new weights (copied from a live worker); if the
        driver fails while sending, every worker it sent to is replaced."""
        live, replace, keeps = self._swap_start("update_weights")
        version = self._version() + 1
        base = self.slots.weights or PoolWeights(version=0)
        failed: list[tuple[WorkerRecord, str]] = []
        try:
            states = update_everywhere(live, pairs, int(bucket_bytes), version, keeps,
                                       lambda w, why: failed.append((w, why)), self.slots.start_timeout_s)
        except BaseException:
            for w, why in failed:  # refused, or the driver failed: replacements get the pool's old weights
                replace(w, why)
            raise
        self.slots.weights_lost = ""  # decided, as in load_weights
        self.slots.weights = PoolWeights(version=version, path=base.path, step=base.step, from_memory=True)
        self._event("weights", f"{len(pairs)} tensors from memory (version {version})")
        for w, why in failed:  # replaced only now, to copy the new weights from a live worker
            replace(w, why)
        self.slots.fill()
        return states

    def _swap_start(self, what: str) -> tuple[list[WorkerRecord], Callable[[WorkerRecord, str], None], str]:
        """The live workers for a weights swap (after waiting for starting ones), the
        uncharged replace function, and what the workers keep if it is refused."""
        if self._closed:
            raise RuntimeError("this UnitDispatcher is closed")
        self.wait_ready()
        for w in [w for w in self.slots.slots if w is not None and w.state == WorkerState.STARTING]:
            # still starting (wait_ready stopped waiting for it): it was created with the old
            # weights and the swap will not reach it; the fill after the swap starts it again
            # with the new ones (it holds no units, and its slot is not charged)
            self.slots.remove(w, "restarted: the pool's weights are swapped while it starts")
        live = self.slots.live()
        if not live:
            raise UnitFailed(f"{what}: no worker is running; last start error: "
                             f"{self.slots.last_start_error or 'none'}")

        def replace(w: WorkerRecord, why: str) -> None:
            self._replace(w, why, charge=False)

        w = self.weights
        keeps = ("the pool's checkpoint" if w is None else f"update {w.version} (from memory)" if w.from_memory
                 else f"{w.path!r}" if w.path else "the pool's checkpoint")
        return live, replace, keeps

    def _version(self) -> int:
        return 0 if self.weights is None else self.weights.version

    def close(self) -> None:
        """Kill every worker; the dispatcher cannot run again."""
        self._closed = True
        self.slots.close()

    def __enter__(self) -> "UnitDispatcher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def workers(self) -> list[dict]:
        """A snapshot of the slots: name, state, info, in-flight units (for reports and tests)."""
        return self.slots.snapshot()

    def engine_states(self) -> list[dict]:
        """GenerationWorker.engine_state() of every worker (pid, the weights swapped in last,
        its KV cache), once the starting ones are ready (a replacement started late in a
        run may still be loading). A worker that died, or hangs (no answer within
        min(start_timeout_s, 60 s) while its engine stays still, or no answer to a progress
        query: a stopped process; as a weights swap judges it, cluster/weight_sync.py), is
        replaced, uncharged, and left out. Raises UnitFailed as wait_ready."""
        self.wait_ready()
        live = self.slots.live()
        deadline = HangDeadline(min(self.slots.start_timeout_s, HangDeadline.PROGRESS_S), live)
        states = []
        for ref, w in [(w.handle.engine_state.remote(), w) for w in live]:
            try:
                states.append(deadline.get(ref, w))
            except Exception as exc:  # noqa: BLE001 - gone (RayActorError) or hung (GetTimeoutError)
                self._replace(w, deadline.why(w, "engine_state", exc), charge=False)
        self.slots.fill()
        return states

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
        self.units.reset(units)
        if not self.units.pending:
            return []
        self.slots.new_run()
        self.start()
        results: list[UnitResult] = []
        next_progress = time.monotonic() + self.progress_interval_s
        while self.units.pending:
            self.slots.check_weights()
            if watchdog is not None:
                watchdog()
            now = time.monotonic()
            self.slots.fill()
            self._dispatch(now)
            self._wait_and_handle(ray, self._wakeup(now, on_progress is not None), results, on_result)
            now = time.monotonic()
            self._check_deadlines(now)
            for w, why, charge in self.slots.check_suspects(now, self.unit_timeout(), self.units.settled):
                self._replace(w, why, charge=charge)
            self.slots.check_can_run(now)
            if on_progress is not None and now >= next_progress:
                next_progress = now + self.progress_interval_s
                self.slots.poll_all(now)
                on_progress(self._report(len(results)))
        if on_progress is not None:
            self.slots.final_progress(ray)
            on_progress(self._report(len(results)))
        return results

    def _dispatch(self, now: float) -> None:
        """Queued units to ready workers with room, the least loaded first. A unit avoids the
        workers it failed on when it can, and two copies of a unit never share a worker."""
        window = 4 * self.num_workers * self.in_flight_per_worker + 8  # scan limit: the queue may be long
        while self.units.queue:
            ready = sorted((w for w in self.slots.slots if w is not None and w.state == WorkerState.READY
                            and len(w.copies) < self.in_flight_per_worker), key=lambda x: len(x.copies))
            for w in ready:
                u = self.units.take(w, window)
                if u is not None:
                    ref = w.handle.run_unit.remote(u.unit)
                    w.copies[ref] = self.units.sent(u, w, now)
                    self.slots.track(ref, "unit", w)
                    break
            else:
                return

    def _replace(self, w: WorkerRecord, why: str, *, charge: bool) -> None:
        """Kill `w`, free its slot and queue its units again (charging each one if `charge`)."""
        self.units.lost(self.slots.remove(w, why), why, charge=charge)

    # ------------------------------------------------------------------ waiting
    def _wakeup(self, now: float, reporting: bool) -> float:
        t = min(self.progress_interval_s if reporting else 2.0, 2.0)
        if self.units.deadline_known():
            deadline = self.unit_timeout()
            for w in self.slots.slots:
                if w is None:
                    continue
                for c in w.copies.values():
                    if not c.overdue:
                        t = min(t, c.sent + deadline - now)
            t = min(t, self.slots.next_check(now, deadline))  # a stalled overdue copy is replaced on time
        return max(0.01, t)

    def _wait_and_handle(self, ray: Any, timeout: float, results: list, on_result: Callable | None) -> None:
        self.slots.collect_dropped(ray)
        refs = list(self.slots.refs)
        if not refs:  # no worker at all: check_can_run explains why, or the slots refill next round
            self.slots.check_can_run(time.monotonic())
            return
        done, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if done and rest:  # collect everything already finished, not just one
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            done = list(done) + list(more)
        for ref in done:
            entry = self.slots.refs.pop(ref, None)
            if entry is None:
                continue
            kind, w = entry
            if w.state == WorkerState.REPLACED:
                continue
            if kind == "ready":
                self.slots.on_ready(ray, ref, w)
            elif kind == "poll":
                died = self.slots.on_poll(ray, ref, w)
                if died:
                    self._replace(w, died, charge=True)
            else:
                self._on_unit(ray, ref, w, results, on_result)

    def _on_unit(self, ray: Any, ref: Any, w: WorkerRecord, results: list, on_result: Callable | None) -> None:
        """A copy's run_unit call returned: the first copy of a unit to return commits it."""
        from ray.exceptions import RayTaskError

        c = w.copies.get(ref)
        if c is None:
            return
        try:
            result = ray.get(ref)
        except RayTaskError as exc:
            self._on_unit_error(w, ref, c, exc)
            return
        except Exception as exc:  # noqa: BLE001 - RayActorError and other system errors: the worker is gone
            self._replace(w, f"worker {w.name} died: {short_error(exc)}", charge=True)
            return
        w.copies.pop(ref, None)
        w.failures_in_row = 0
        # Ready again only if this was its last overdue copy without progress: another unit
        # committing says nothing about a copy stuck beside it (a hung read, say).
        self.slots.recheck(w)
        if self.units.commit(c, time.monotonic()):
            results.append(result)
            if on_result is not None:
                on_result(result)

    def _on_unit_error(self, w: WorkerRecord, ref: Any, c: Copy, exc: Any) -> None:
        """A copy's run_unit call raised (RayTaskError `exc`): the unit is charged and queued
        again; an engine failure replaces the worker, and so do too many failures in a row.

        The worker is taken out before the unit is charged: the charge raises UnitFailed on
        the unit's last attempt, and a broken worker left ready would fail the next run's
        units. An engine failure replaces the worker even when the copy's unit is settled
        (committed elsewhere, an earlier run's, an ended call's): the worker is broken all
        the same."""
        from cluster.worker import EngineLoopError

        w.copies.pop(ref, None)
        u = self.units.drop(c)
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        why = f"on {w.name}: {short_error(cause)}"
        if isinstance(cause, EngineLoopError) or isinstance(exc, EngineLoopError):
            reason = f"its engine failed: {short_error(cause, 300)}"
            held = self.slots.remove(w, reason)
            if u is not None:
                self.units.retry(u, why, front=True)
            self.units.lost(held, reason, charge=True)
            return
        if u is None:
            return  # a copy of a unit already committed (or of an earlier run)
        w.failures_in_row += 1
        if w.failures_in_row < self.max_worker_failures:
            self.units.retry(u, why, avoid=w.name)
            self.slots.recheck(w)
            return
        reason = f"{w.failures_in_row} units failed in a row on it"
        held = self.slots.remove(w, reason)
        self.units.retry(u, why, avoid=w.name)
        self.units.lost(held, reason, charge=False)

    def _check_deadlines(self, now: float) -> None:
        """A copy past the unit deadline: its unit gets a second copy, its worker becomes suspect."""
        if not any(w is not None and w.copies for w in self.slots.slots):
            return
        deadline = self.unit_timeout()
        for w in list(self.slots.slots):
            if w is None or not w.live:
                continue
            for c in list(w.copies.values()):
                if c.overdue or now - c.sent <= deadline:
                    continue
                self.slots.watch(w, c, now, open_unit=self.units.overdue(c, now))

    # ------------------------------------------------------------------ progress
    def _report(self, done: int) -> dict:
        states = [w.state for w in self.slots.slots if w is not None]
        return {
            "generated_tokens": sum(self.slots.tokens_by_worker.values()),
            "workers": dict(self.slots.progress_by_worker),
            "live_workers": states.count(WorkerState.READY),
            "starting": states.count(WorkerState.STARTING),
            "suspect": states.count(WorkerState.SUSPECT),
            "queued": len(self.units.queue),
            "in_flight": self.units.in_flight(),
            "done": done,
            "waiting_for_nodes": self.slots.waiting_for_nodes,
        }

    def _event(self, kind: str, detail: str) -> None:
        self.events.append((time.time(), kind, detail))

    # ------------------------------------------------------------------ runs driven from outside
    def add_units(self, units: Iterable[WorkUnit]) -> None:
        """Queue units into a run driven by `advance` (cluster/rollout.py), which may already
        be under way. Raises ValueError for a unit index queued already."""
        if self._closed:
            raise RuntimeError("this UnitDispatcher is closed")
        if not self.units.pending:
            self.slots.new_run()
        self.units.add(units)
        self.start()

    def advance(self, on_result: Callable[[UnitResult], None], timeout_s: float, *, dispatch: bool = True,
                deadlines: bool = True) -> None:
        """One round of `run`'s loop over the queued units, waiting at most `timeout_s` for a
        reply: refill slots, dispatch (unless `dispatch` is False: paused), handle replies
        (on_result for each committed unit), then deadlines and suspects (unless
        `deadlines` is False: a pause holds units on purpose). Raises UnitFailed as `run`."""
        import ray

        self.slots.check_weights()
        now = time.monotonic()
        self.slots.fill()
        if dispatch:
            self._dispatch(now)
        self._wait_and_handle(ray, min(timeout_s, self._wakeup(now, False)), [], on_result)
        now = time.monotonic()
        if deadlines:
            self._check_deadlines(now)
            for w, why, charge in self.slots.check_suspects(now, self.unit_timeout(), self.units.settled):
                self._replace(w, why, charge=charge)
        self.slots.check_can_run(now)


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
