"""The dispatcher's workers: slots, starts, pings, suspects, replacement, node loss.

`WorkerSlots` holds `num_workers` slots, each with at most one `GenerationWorker` actor at a
time; a replaced actor's slot is refilled with a fresh one. The UnitDispatcher
(cluster/dispatcher.py) owns the units and asks the slots for workers; what a replaced
worker held of its units comes back to it (`remove`) to queue again.

Worker states (`WorkerState`):
    starting   actor created, engine loading; gets no units (a start failure is never a unit's)
    ready      takes units, `in_flight_per_worker` at a time (2: its engine never drains at
               a unit boundary)
    suspect    one of its units is overdue: gets no new units, is pinged (`progress()`) until
               each overdue unit it holds shows progress of its own (back to ready) or one
               shows none for the suspect timeout (replaced, its units charged)
    replaced   killed; its in-flight units went back to the queue

- pings: progress() replies are kept per worker for the progress report; a worker found dead
  is replaced;
- suspects: `check_suspects` pings workers holding overdue copies and says which to
  replace: one whose overdue copy showed no progress for the suspect timeout (charged), a
  worker still holding a copy that long after another copy of its unit committed
  (uncharged). Progress is the copy's own, from the worker's progress() "units": the unit
  moving on (read, in the engine, written) or the engine stepping while it is in it; other
  units finishing on the same worker prove nothing about it (a read stuck on a filesystem
  leaves the engine free for them). An overdue copy stays watched after the worker is back
  to ready, so a unit that moved once and then stopped is caught too, and a pool of one
  worker, where no second copy can run, gets the unit back through the replacement;
- starts: a failed start (the constructor raised, the process died before ready, the
  engine resolved model dtype "auto" to another dtype than the run's, `refuse_dtype`, or
  it was not ready within `start_timeout_s`: Ray had no room to place it, or its load hung)
  costs the slot one attempt; a slot failing `max_start_failures` times in a row is given
  up while other workers run;
- nodes: when no worker runs, `check_can_run` fails the run once every empty slot is given
  up, or when no alive Ray node can host a worker (cluster/resources.py) unless
  `may_add_nodes` (then it is "waiting for nodes"), and after `start_timeout_s` in any case.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from cluster.unit import UnitFailed, UnitTask

log = logging.getLogger("batchgen.pool")

NODE_CHECK_INTERVAL_S = 2.0


class WorkerState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    SUSPECT = "suspect"
    REPLACED = "replaced"


@dataclass(slots=True, eq=False)
class WorkerRecord:
    """The driver's record of one GenerationWorker actor in a slot."""

    name: str
    slot: int
    handle: Any
    ready_ref: Any
    created: float
    state: WorkerState = WorkerState.STARTING
    info: dict = field(default_factory=dict)  # ready(): pid, host, node_id, device, dtype
    copies: dict = field(default_factory=dict)  # ObjectRef -> the dispatcher's copy of a unit
    failures_in_row: int = 0
    progress: dict = field(default_factory=dict)  # the last progress() reply
    poll_ref: Any = None  # a pending progress() call
    poll_sent: float = 0.0
    reason: str = ""  # why it was replaced

    @property
    def live(self) -> bool:
        """Started and not replaced: it runs units (ready) or may again (suspect)."""
        return self.state in (WorkerState.READY, WorkerState.SUSPECT)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def short_error(exc: BaseException | str, limit: int = 2000) -> str:
    """An error's text for a message: colour codes removed, cut at `limit` characters."""
    text = _ANSI.sub("", str(exc)).strip() or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def last_error_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in short_error(exc, 100_000).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


class WorkerSlots:
    """The worker slots of a UnitDispatcher and their health (see the module docstring).

    task, num_workers, num_cpus, num_gpus, in_flight_per_worker, actor_options and the
    timeouts: as UnitDispatcher's. events: the dispatcher's event log, (time, kind, detail).
    refs: every pending Ray call to a worker, ObjectRef -> (kind, worker), kind "ready",
    "poll" or "unit" (the dispatcher's run_unit calls, registered with `track`).
    weights: the weights swapped in last (cluster.weight_buckets.PoolWeights), which workers
    started from now on load.
    """

    def __init__(self, task: UnitTask, *, num_workers: int, num_cpus: float, num_gpus: float,
                 in_flight_per_worker: int, actor_options: dict | None, suspect_timeout_s: float | None,
                 start_timeout_s: float, max_start_failures: int, may_add_nodes: bool, events: deque,
                 on_auto_dtype: Callable[[str], None] | None = None, kernels: str | None = None,
                 on_kernels: Callable[[str], None] | None = None) -> None:
        self.task = task
        self.num_workers = num_workers
        self.num_cpus = num_cpus
        self.in_flight_per_worker = in_flight_per_worker
        self.options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)
        self.options.update(actor_options or {})
        self.needs = {"CPU": num_cpus, "GPU": num_gpus, **(self.options.get("resources") or {})}
        self.suspect_timeout_s = suspect_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_start_failures = max(1, int(max_start_failures))
        self.may_add_nodes = may_add_nodes
        self.events = events
        self.weights: Any = None  # cluster.weight_buckets.PoolWeights of the last swap; None: the task's
        self.weights_lost = ""  # why the last update's weights are gone (every holder died); "" normally
        self.waiting_for_nodes = ""  # why no worker can start now (when may_add_nodes)
        self.auto_dtype: str | None = None  # what the workers resolved model dtype "auto" to
        self.on_auto_dtype = on_auto_dtype
        # which CPU kernels the run's rows are computed with ("compiled" or "torch"; None:
        # not bound yet): given when resuming an output that recorded it, else the first
        # ready CPU worker's (refuse_kernels)
        self.kernels, self.kernels_given, self.on_kernels = kernels, kernels is not None, on_kernels
        self.tokens_by_worker: dict[str, int] = {}
        self.progress_by_worker: dict[str, dict] = {}
        self.last_start_error = ""
        self.slots: list[WorkerRecord | None] = [None] * num_workers
        self.refs: dict[Any, tuple[str, WorkerRecord]] = {}
        self._dropped: list[Any] = []  # calls of replaced workers: collected so Ray does not log them unhandled
        self._counter = itertools.count()
        self._actor_cls = None
        self._slot_failures = [0] * num_workers
        self._late = [False] * num_workers  # the slot's last start was not ready within start_timeout_s
        self._no_worker_since: float | None = None
        self._next_node_check = 0.0

    def event(self, kind: str, detail: str) -> None:
        self.events.append((time.time(), kind, detail))

    # ------------------------------------------------------------------ slots
    def start(self) -> None:
        """Create the actor class and start a worker in every empty slot."""
        from cluster.worker import make_actor_class

        if self._actor_cls is None:
            self._actor_cls = make_actor_class(max_concurrency=self.in_flight_per_worker + 3)
        for slot in range(self.num_workers):
            if self.slots[slot] is None:
                self._start_worker(slot)

    def _start_worker(self, slot: int) -> WorkerRecord:
        name = f"worker-{next(self._counter)}"
        threads = max(1, int(self.num_cpus)) if self.num_cpus else None
        handle = self._actor_cls.options(**self.options).remote(self.task, name, threads, self._weights_to_start())
        w = WorkerRecord(name=name, slot=slot, handle=handle, ready_ref=handle.ready.remote(),
                         created=time.monotonic())
        self.refs[w.ready_ref] = ("ready", w)
        self.slots[slot] = w
        self.event("start", f"{name} in slot {slot}")
        return w

    def _weights_to_start(self) -> Any:
        """What a worker started now loads: self.weights, with the live workers as peers to
        copy from after an update from memory. With none left (all died since), the update's
        weights are lost: the worker loads the pool's checkpoint and `weights_lost` says so
        (`check_weights` then fails runs until the next swap)."""
        w = self.weights
        if w is None or not w.from_memory:
            return w
        peers = tuple(r.handle for r in self.live())
        if peers:
            return dataclasses.replace(w, peers=peers)
        self.weights = dataclasses.replace(w, from_memory=False)
        self.weights_lost = (f"the weights of update_weights (weight version {w.version}) were lost with every "
                             f"worker that held them; the workers now hold "
                             f"{w.path or 'the pool checkpoint'}: call update_weights or load_weights again")
        self.event("weights", self.weights_lost)
        return self.weights

    def check_weights(self) -> None:
        """Raise UnitFailed while the pool's weights are lost (see `_weights_to_start`)."""
        if self.weights_lost:
            raise UnitFailed(self.weights_lost)

    def fill(self) -> None:
        """A worker in every empty slot that is not given up."""
        for slot, w in enumerate(self.slots):
            if w is None and self._slot_failures[slot] < self.max_start_failures:
                self._start_worker(slot)

    def live(self) -> list[WorkerRecord]:
        return [w for w in self.slots if w is not None and w.live]

    def new_run(self) -> None:
        """A new run tries given-up slots again and restarts the start timeout."""
        self._slot_failures = [0] * self.num_workers
        self._no_worker_since = None

    def track(self, ref: Any, kind: str, w: WorkerRecord) -> None:
        self.refs[ref] = (kind, w)

    def remove(self, w: WorkerRecord, why: str) -> list[Any]:
        """Kill `w` and free its slot; returns the copies of units it held (the dispatcher
        queues them again), [] if it was replaced already."""
        if w.state == WorkerState.REPLACED:
            return []
        started = w.state != WorkerState.STARTING
        w.state, w.reason = WorkerState.REPLACED, why
        self._kill(w)
        if self.slots[w.slot] is w:
            self.slots[w.slot] = None
        copies = list(w.copies.values())
        w.copies.clear()
        if started:
            log.warning("replacing %s: %s", w.name, why)
        self.event("replaced", f"{w.name}: {why}")
        return copies

    def _kill(self, w: WorkerRecord) -> None:
        import ray

        for ref in [r for r, (_, owner) in self.refs.items() if owner is w]:
            del self.refs[ref]
            self._dropped.append(ref)
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def collect_dropped(self, ray: Any) -> None:
        if self._dropped:
            done, self._dropped = ray.wait(self._dropped, num_returns=len(self._dropped), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - the worker was replaced; its reply no longer matters
                    pass

    def close(self) -> None:
        for w in list(self.slots):
            if w is not None:
                self._kill(w)
        self.slots = [None] * self.num_workers
        self.refs.clear()

    def snapshot(self) -> list[dict]:
        """Name, state, info and in-flight units of each slot's worker."""
        return [{"slot": i, "name": w.name, "state": w.state.value, "info": dict(w.info),
                 "units": sorted(c.unit.unit.index for c in w.copies.values())}
                for i, w in enumerate(self.slots) if w is not None]

    # ------------------------------------------------------------------ starts
    def wait_ready(self, timeout_s: float | None = None) -> int:
        """Start the workers and block until every slot's worker is ready or given up, or
        `timeout_s` passes; returns the number of ready workers. While some worker is ready
        it does not wait for a slot whose last start was not ready within start_timeout_s
        (`check_starts`; Ray had no room for it, say): that slot goes on starting in the
        background, as in a run, instead of holding every caller (the pool's constructor,
        each weights swap) until it is given up. Raises UnitFailed as check_can_run."""
        import ray

        self.start()
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            self.check_can_run(now)  # first: a start past start_timeout_s fails and its slot refills
            self.fill()
            starting = {w.ready_ref: w for w in self.slots if w is not None and w.state == WorkerState.STARTING}
            if not starting or (end is not None and now >= end):
                return len(self.live())
            if self.live() and all(self._late[w.slot] for w in starting.values()):
                return len(self.live())
            wake = min([2.0] + [w.created + self.start_timeout_s - now for w in starting.values()]
                       + ([] if end is None else [end - now]))
            done, _ = ray.wait(list(starting), num_returns=1, timeout=max(0.01, wake))
            for ref in done:
                if self.refs.pop(ref, None) is not None:  # not if its worker was removed meanwhile
                    self.on_ready(ray, ref, starting[ref])

    def on_ready(self, ray: Any, ref: Any, w: WorkerRecord) -> None:
        """`w`'s ready() call returned: it takes units, or its start failed."""
        try:
            w.info = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - any failure before ready is a start failure
            self._start_failed(w, exc)
            return
        refused = self.refuse_kernels(w) or self.refuse_dtype(w)
        if refused:
            self._start_failed(w, refused)
            return
        self._bind(w)
        w.state = WorkerState.READY
        self._slot_failures[w.slot] = 0
        self._late[w.slot] = False
        self.event("ready", f"{w.name} pid {w.info.get('pid')} on {w.info.get('host')}")

    def refuse_dtype(self, w: WorkerRecord) -> str | None:
        """With model dtype "auto" each worker's engine resolves it for its own machine
        (engine/loading/checkpoint.py): the first ready worker's choice is the run's, and a worker that
        resolved another (a GPU of another generation, a CPU of another kind) is refused, so
        that one run never mixes dtypes. Returns why, or None.

        The binding (`_bind`) is passed to `on_auto_dtype` before the worker is ready, so
        before any unit runs (the job runner records it in the output's manifest, for resumes:
        a resume on another kind of machine runs in the dtype the output began in)."""
        if self.task.engine_kwargs.get("dtype") != "auto" or not w.info.get("dtype"):
            return None
        got = w.info["dtype"]
        if self.auto_dtype is None or got == self.auto_dtype:
            return None
        return (f"worker {w.name} on {w.info.get('host')} ({w.info.get('device')}) resolved model.dtype auto to "
                f"{got}, but this run's workers use {self.auto_dtype}: set model.dtype to one of them explicitly "
                f"to run on mixed machines")

    def refuse_kernels(self, w: WorkerRecord) -> str | None:
        """A CPU worker computes with batchgen's compiled kernels where their library builds
        and loads (engine/kernels/native.py), else with torch's, whose rows differ in their
        last bits (and are not batch-invariant): the first ready CPU worker's kind binds the
        run (or the output's record, on a resume), and a worker of the other kind is refused,
        so that one run, and one output, never mixes them. Returns why, or None."""
        got = w.info.get("kernels")
        if got is None or self.kernels is None or got == self.kernels:
            return None
        whose = "this output's rows were" if self.kernels_given else "this run's workers are"
        if got == "torch":
            return (f"worker {w.name} on {w.info.get('host')} has no compiled kernels (their library did not build "
                    f"or load there: a C++ compiler missing, or BATCHGEN_NATIVE=0; its log says why), but {whose} "
                    f"computed with them: its samples would differ. Give that machine a C++ compiler (README), "
                    f"or start the output over (--overwrite)")
        return (f"worker {w.name} on {w.info.get('host')} has batchgen's compiled kernels, but {whose} computed "
                f"with torch's (machines without a compiler, or BATCHGEN_NATIVE=0): its samples would differ. Set "
                f"BATCHGEN_NATIVE=0 for the workers to go on with torch's, or start the output over (--overwrite)")

    def _bind(self, w: WorkerRecord) -> None:
        """A worker passed refuse_kernels and refuse_dtype: what it resolved binds the run
        where nothing is bound yet, passed to on_auto_dtype / on_kernels first (what they
        raise ends the run before any unit)."""
        dtype, kernels = w.info.get("dtype"), w.info.get("kernels")
        if self.task.engine_kwargs.get("dtype") == "auto" and dtype and self.auto_dtype is None:
            if self.on_auto_dtype is not None:
                self.on_auto_dtype(dtype)
            self.auto_dtype = dtype
        if kernels is not None and self.kernels is None:
            if self.on_kernels is not None:
                self.on_kernels(kernels)
            self.kernels = kernels
            if kernels == "torch":
                log.warning("worker %s on %s computes with torch's CPU kernels, not batchgen's compiled ones "
                            "(their library did not build or load there: its log says why): samples are not "
                            "batch-invariant, and differ from a machine with them", w.name, w.info.get("host"))

    def _start_failed(self, w: WorkerRecord, exc: BaseException | str) -> None:
        """`w` failed to start (`exc`: what ready() raised, or why it was refused): its slot
        loses one attempt and `w` is removed (a starting worker holds no units)."""
        if isinstance(exc, str):
            why = exc
        elif getattr(exc, "actor_init_failed", False):
            why = f"worker {w.name} could not start: {last_error_line(exc)}\n{short_error(exc)}"
        else:
            why = f"worker {w.name} died before it was ready: {short_error(exc)}"
        self._slot_failures[w.slot] += 1
        self.last_start_error = why
        log.warning("%s (attempt %d of %d for slot %d)", why.splitlines()[0], self._slot_failures[w.slot],
                    self.max_start_failures, w.slot)
        self.remove(w, why.splitlines()[0])

    # ------------------------------------------------------------------ pings
    def poll(self, w: WorkerRecord, now: float) -> None:
        if w.poll_ref is None and w.live:
            w.poll_ref = w.handle.progress.remote()
            w.poll_sent = now
            self.refs[w.poll_ref] = ("poll", w)

    def poll_all(self, now: float) -> None:
        for w in self.slots:
            if w is not None:
                self.poll(w, now)

    def on_poll(self, ray: Any, ref: Any, w: WorkerRecord) -> str | None:
        """`w`'s progress() call returned; returns why to replace it (charged: it died), or None.
        Each overdue copy's mark (its entry in the reply's "units") is compared with the last
        one: a change is progress of that copy (the first reply after its deadline sets the
        mark). A suspect whose overdue copies have all shown progress takes units again."""
        from ray.exceptions import RayTaskError

        w.poll_ref = None
        try:
            info = ray.get(ref)
        except RayTaskError:
            return None  # progress is best effort
        except Exception as exc:  # noqa: BLE001 - RayActorError and other system errors: the worker is gone
            return f"worker {w.name} died: {short_error(exc)}"
        w.progress = info
        self._record(w.name, info)
        now = time.monotonic()
        marks = info.get("units") or {}
        for c in w.copies.values():
            mark = marks.get(c.unit.unit.index) if c.overdue else None
            if mark is None:  # not overdue, or not on the worker any more (its reply is on its way)
                continue
            mark = tuple(mark)
            if c.mark is not None and mark != c.mark:
                c.progressed, c.watch_since = True, now
            c.mark = mark
        if self.recheck(w):
            log.info("%s is slow but alive (its overdue units progress)", w.name)
            self.event("alive", w.name)
        return None

    def recheck(self, w: WorkerRecord) -> bool:
        """A suspect `w` whose overdue copies have each shown progress since their deadline,
        or left it, is ready again (returns True then)."""
        if w.state != WorkerState.SUSPECT or not all(c.progressed for c in w.copies.values() if c.overdue):
            return False
        w.state = WorkerState.READY
        return True

    def _record(self, name: str, info: dict) -> None:
        self.progress_by_worker[name] = info
        self.tokens_by_worker[name] = max(self.tokens_by_worker.get(name, 0), int(info.get("generated_tokens", 0)))

    def final_progress(self, ray: Any) -> None:
        """A last, complete report (workers are idle now)."""
        final = {w: w.handle.progress.remote() for w in self.live()}
        ok, _ = ray.wait(list(final.values()), num_returns=len(final), timeout=10) if final else ([], [])
        for w, ref in final.items():
            if ref in ok:
                try:
                    info = ray.get(ref)
                except Exception:  # noqa: BLE001 - best effort
                    continue
                self._record(w.name, info)

    # ------------------------------------------------------------------ suspects
    def suspect_timeout(self, unit_timeout: float) -> float:
        if self.suspect_timeout_s is not None:
            return float(self.suspect_timeout_s)
        return min(60.0, max(10.0, 0.5 * unit_timeout))

    def watch(self, w: WorkerRecord, c: Any, now: float, *, open_unit: bool) -> None:
        """Copy `c` on `w` passed its deadline: it is watched from now on (`check_suspects`);
        when its unit is still open (`open_unit`), a ready `w` gets no new units until the
        copy shows progress."""
        c.watch_since, c.mark, c.progressed = now, None, False
        if open_unit and w.state == WorkerState.READY:
            w.state = WorkerState.SUSPECT
            self.event("suspect", w.name)
        self.poll(w, now)

    def check_suspects(self, now: float, unit_timeout: float,
                       settled: Callable[[Any], bool]) -> list[tuple[WorkerRecord, str, bool]]:
        """Pings workers holding overdue copies when due another progress() call; returns the
        workers to replace, in slot order, as (worker, why, charge its units). An overdue
        copy without progress for the suspect timeout replaces its worker, charged when the
        copy's unit is still open (`settled(c.unit)` false): a stuck copy of a unit already
        settled (an earlier run's, an ended call's) costs the worker's other units nothing."""
        limit = self.suspect_timeout(unit_timeout)
        out: list[tuple[WorkerRecord, str, bool]] = []
        for w in list(self.slots):
            if w is None:
                continue
            orphan = [c for c in w.copies.values() if c.orphaned_at is not None
                      and now - c.orphaned_at > limit]
            if orphan:
                out.append((w, f"still running unit {orphan[0].unit.unit.index} "
                               f"{now - orphan[0].orphaned_at:.0f}s after another copy committed it", False))
                continue
            # orphaned copies are the rule above's, measured from the other copy's commit
            watched = [c for c in w.copies.values() if c.overdue and c.orphaned_at is None]
            stuck = [c for c in watched if now - c.watch_since > limit]
            if stuck:
                out.append((w, f"stalled: no progress within {limit:.0f}s after unit(s) "
                               f"{sorted(c.unit.unit.index for c in stuck)} passed the deadline of "
                               f"{unit_timeout:.0f}s", any(not settled(c.unit) for c in stuck)))
            elif ((watched or w.state == WorkerState.SUSPECT) and w.poll_ref is None
                  and now - w.poll_sent >= limit / 5):
                self.poll(w, now)
        return out

    def next_check(self, now: float, unit_timeout: float) -> float:
        """Seconds until `check_suspects` has something to do: an overdue copy passing the
        suspect timeout, or its worker due another ping (inf: nothing watched)."""
        limit = self.suspect_timeout(unit_timeout)
        times = []
        for w in self.slots:
            watched = [c for c in w.copies.values() if c.overdue and c.orphaned_at is None] if w is not None else []
            times += [c.watch_since + limit - now for c in watched]
            if watched and w.poll_ref is None:
                times.append(w.poll_sent + limit / 5 - now)
        return min(times, default=float("inf"))

    # ------------------------------------------------------------------ nodes
    def check_can_run(self, now: float) -> None:
        """Fail the starts that took longer than start_timeout_s (`check_starts`), then raise
        UnitFailed when no worker can ever run a unit; see the module docstring."""
        self.check_starts(now)
        if self.live():
            self._no_worker_since = None
            self.waiting_for_nodes = ""
            return
        if self._no_worker_since is None:
            self._no_worker_since = now
        starting = any(w is not None and w.state == WorkerState.STARTING for w in self.slots)
        refillable = any(w is None and f < self.max_start_failures for w, f in zip(self.slots, self._slot_failures))
        if not starting and not refillable:
            raise UnitFailed(f"workers keep failing to start ({self.max_start_failures} attempts in a row for each "
                             f"of {self.num_workers} worker slot(s)); last error: {self.last_start_error or 'none'}")
        if now >= self._next_node_check:
            self._next_node_check = now + NODE_CHECK_INTERVAL_S
            self._check_nodes()
        if now - self._no_worker_since > self.start_timeout_s:
            raise UnitFailed(
                f"no worker became ready within {self.start_timeout_s:.0f}s (resources per worker: {self.needs}"
                + (f"; {self.waiting_for_nodes}" if self.waiting_for_nodes else "")
                + (f"; last error: {self.last_start_error}" if self.last_start_error else "") + ")")

    def check_starts(self, now: float) -> None:
        """A worker starting for longer than start_timeout_s failed to start: its slot loses
        an attempt (given up after max_start_failures in a row) and is filled again. Without
        this a slot Ray can never place (too few resources for num_workers) would stay
        "starting" for ever: nothing else times out while another worker runs."""
        for w in list(self.slots):
            if w is not None and w.state == WorkerState.STARTING and now - w.created > self.start_timeout_s:
                self._late[w.slot] = True  # wait_ready waits for it no more while others run
                self._start_failed(w, f"worker {w.name} was not ready within {self.start_timeout_s:.0f}s "
                                      f"(resources per worker: {self.needs}; Ray had no room to place it, "
                                      f"or its engine load hung)")

    def _check_nodes(self) -> None:
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
