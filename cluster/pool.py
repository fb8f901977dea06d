"""The driver side: a queue of work units dispatched to `GenerationWorker` actors.

    results = run_units(task, units, num_workers=2, num_cpus=1, num_gpus=0,
                        max_unit_attempts=3, on_result=print, on_progress=None)

Scheduling: every worker keeps `in_flight_per_worker` units (default 2) so its engine never
drains at a unit boundary; whichever worker finishes a unit gets the next one, so a fast
worker takes more. The driver blocks in `ray.wait` on all in-flight calls; its timeout only
paces progress polling.

Failures (the pool owns retries: actors run with max_restarts=0, max_task_retries=0):
- a unit's call raises (read/write/engine error): the unit goes back to the queue; after
  `max_unit_attempts` failed attempts the run fails with `UnitFailed`.
- a worker dies (RayActorError: process killed, node lost, OOM): its in-flight units go
  back to the front of the queue, each charged one attempt, and the worker is replaced by a
  fresh actor while units remain.
- a worker fails to start: a Python exception in its constructor (model cannot load) fails
  the run at once with that message; a worker process that dies before it is ready (units
  are dispatched only to ready workers, so no unit is charged) counts as a start failure, and `max_unit_attempts` start failures in a row (no worker becoming
  ready in between) fail the run. No ready worker for `start_timeout_s` (e.g. no node can
  host one) also fails it: the pool never waits forever.

Unit commits are idempotent (one file per unit index, atomic rename, deterministic sampling),
so a unit that ran twice — say on a worker presumed dead — yields the same file once.
"""
from __future__ import annotations

import itertools
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.task import UnitResult, UnitTask, WorkUnit


class UnitFailed(Exception):
    """The run cannot finish: a unit failed too often, or workers cannot start."""


@dataclass(eq=False)
class _Worker:
    name: str
    handle: Any
    ready_ref: Any
    created: float
    ready: bool = False
    info: dict = field(default_factory=dict)
    in_flight: dict = field(default_factory=dict)  # ObjectRef -> WorkUnit
    progress_ref: Any = None
    dead: bool = False


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in _short(exc, 100_000).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _describe(unit: WorkUnit) -> str:
    return f"unit {unit.index} ({unit.source} rows {unit.row_start}-{unit.row_end})"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(exc: BaseException, limit: int = 2000) -> str:
    text = _ANSI.sub("", str(exc)).strip() or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def run_units(
    task: UnitTask,
    units: list[WorkUnit],
    *,
    num_workers: int,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_unit_attempts: int = 3,
    on_result: Callable[[UnitResult], None] | None = None,
    on_progress: Callable[[dict], None] | None = None,
    in_flight_per_worker: int = 2,
    progress_interval_s: float = 1.0,
    start_timeout_s: float = 900.0,
    actor_options: dict | None = None,
) -> list[UnitResult]:
    """Run every unit once on `num_workers` actors; results in completion order.

    on_result(result): called in the driver for each committed unit.
    on_progress(info): called about every `progress_interval_s` with
        {"generated_tokens": total over all workers ever started, "workers": {name: progress},
         "live_workers": n, "queued": n, "in_flight": n, "done": n}.
    actor_options: extra Ray actor options (e.g. resources={"gen": 1} to pin workers).
    Raises UnitFailed (see the module docstring).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from cluster.worker import make_actor_class

    if not units:
        return []
    if num_workers < 1:
        raise ValueError("num_workers must be >= 1")
    max_unit_attempts = max(1, int(max_unit_attempts))
    in_flight_per_worker = max(1, int(in_flight_per_worker))
    num_workers = min(num_workers, len(units))  # no idle actors loading models for nothing
    actor_cls = make_actor_class(max_concurrency=in_flight_per_worker + 3)
    threads = max(1, int(num_cpus)) if num_cpus else None
    options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)
    options.update(actor_options or {})

    queue: deque[WorkUnit] = deque(sorted(units, key=lambda u: u.index))
    attempts: dict[int, int] = {}
    last_error: dict[int, str] = {}
    results: list[UnitResult] = []
    refs: dict[Any, _Worker] = {}  # every pending ObjectRef -> its worker
    workers: list[_Worker] = []
    counter = itertools.count()
    tokens_by_worker: dict[str, int] = {}
    progress_by_worker: dict[str, dict] = {}
    start_failures = 0
    last_start_error = ""
    last_ready_time = time.time()
    next_progress = time.time() + progress_interval_s

    def start_worker() -> _Worker:
        name = f"worker-{next(counter)}"
        handle = actor_cls.options(**options).remote(task, name, threads)
        w = _Worker(name=name, handle=handle, ready_ref=handle.ready.remote(), created=time.time())
        refs[w.ready_ref] = w
        workers.append(w)
        return w

    def kill(w: _Worker) -> None:
        w.dead = True
        for ref in [r for r, owner in refs.items() if owner is w]:
            del refs[ref]
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def fail_unit(unit: WorkUnit, why: str) -> None:
        attempts[unit.index] = attempts.get(unit.index, 0) + 1
        last_error[unit.index] = why
        if attempts[unit.index] >= max_unit_attempts:
            raise UnitFailed(
                f"{_describe(unit)} failed {attempts[unit.index]} times "
                f"(max_unit_attempts={max_unit_attempts}); last error: {why}"
            )

    def worker_died(w: _Worker, exc: BaseException) -> None:
        nonlocal start_failures, last_start_error
        if w.dead:
            return
        lost = list(w.in_flight.values())
        w.in_flight.clear()
        kill(w)
        if not w.ready:
            if isinstance(exc, RayActorError) and exc.actor_init_failed:
                raise UnitFailed(f"worker {w.name} could not start: {_last_line(exc)}\n{_short(exc)}")
            start_failures += 1
            last_start_error = _short(exc)
            if start_failures >= max_unit_attempts:
                raise UnitFailed(
                    f"workers keep dying before they are ready ({start_failures} in a row); "
                    f"last error: {last_start_error}"
                )
        else:
            why = f"worker {w.name} died: {_short(exc)}"
            for unit in lost:
                fail_unit(unit, why)
        for unit in sorted(lost, key=lambda u: u.index, reverse=True):
            queue.appendleft(unit)

    def live() -> list[_Worker]:
        return [w for w in workers if not w.dead]

    def top_up() -> None:
        # replace dead workers while there is work for them
        while queue and len(live()) < num_workers:
            start_worker()
        for w in live():  # units go only to started workers: a start failure is never a unit's fault
            while w.ready and queue and len(w.in_flight) < in_flight_per_worker:
                unit = queue.popleft()
                ref = w.handle.run_unit.remote(unit)
                w.in_flight[ref] = unit
                refs[ref] = w

    def poll_progress(final: bool = False) -> None:
        nonlocal next_progress
        now = time.time()
        if on_progress is None or (now < next_progress and not final):
            return
        next_progress = now + progress_interval_s
        for w in live() if not final else ():
            if w.ready and w.progress_ref is None:
                w.progress_ref = w.handle.progress.remote()
                refs[w.progress_ref] = w
        on_progress({
            "generated_tokens": sum(tokens_by_worker.values()),
            "workers": dict(progress_by_worker),
            "live_workers": sum(1 for w in live() if w.ready),
            "queued": len(queue),
            "in_flight": sum(len(w.in_flight) for w in live()),
            "done": len(results),
        })

    try:
        top_up()
        while queue or any(w.in_flight for w in live()):
            top_up()
            if not refs:  # cannot happen while work remains; guard against a silent hang
                raise UnitFailed("no worker is running and none can be started")
            timeout = progress_interval_s if on_progress is not None else 5.0
            done, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
            # collect everything already finished, not just one
            rest = [r for r in refs if r not in done] if done else []
            if rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                done = list(done) + list(more)
            for ref in done:
                w = refs.pop(ref, None)
                if w is None or w.dead:
                    continue
                if ref is w.ready_ref or ref == w.ready_ref:
                    try:
                        w.info = ray.get(ref)
                        w.ready = True
                        start_failures = 0
                        last_ready_time = time.time()
                    except RayActorError as exc:
                        worker_died(w, exc)
                    continue
                if w.progress_ref is not None and ref == w.progress_ref:
                    w.progress_ref = None
                    try:
                        info = ray.get(ref)
                    except RayActorError as exc:
                        worker_died(w, exc)
                        continue
                    except Exception:  # noqa: BLE001 - progress is best effort
                        continue
                    progress_by_worker[w.name] = info
                    tokens_by_worker[w.name] = max(tokens_by_worker.get(w.name, 0), int(info.get("generated_tokens", 0)))
                    continue
                unit = w.in_flight.pop(ref)
                try:
                    result = ray.get(ref)
                except RayActorError as exc:
                    w.in_flight[ref] = unit  # lost with the worker's other units
                    worker_died(w, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - the unit failed, the worker lives
                    cause = getattr(exc, "cause", None) or exc
                    fail_unit(unit, f"on {w.name}: {_short(cause)}")
                    queue.append(unit)
                    continue
                results.append(result)
                if on_result is not None:
                    on_result(result)
            if not any(w.ready for w in live()) and (queue or any(w.in_flight for w in live())):
                if time.time() - last_ready_time > start_timeout_s:
                    raise UnitFailed(
                        f"no worker became ready within {start_timeout_s:.0f}s "
                        f"(not enough resources for num_cpus={num_cpus}, num_gpus={num_gpus}?)"
                        + (f"; last error: {last_start_error}" if last_start_error else "")
                    )
            else:
                last_ready_time = time.time()
            poll_progress()
        if on_progress is not None:  # a last, complete report (workers are idle now)
            final = {w: w.handle.progress.remote() for w in live() if w.ready}
            ok, _ = ray.wait(list(final.values()), num_returns=len(final), timeout=10)
            for w, ref in final.items():
                if ref in ok:
                    try:
                        info = ray.get(ref)
                    except Exception:  # noqa: BLE001 - best effort
                        continue
                    progress_by_worker[w.name] = info
                    tokens_by_worker[w.name] = max(tokens_by_worker.get(w.name, 0), int(info.get("generated_tokens", 0)))
            poll_progress(final=True)
        return results
    except GetTimeoutError as exc:  # pragma: no cover - ray.get is only called on finished refs
        raise UnitFailed(str(exc)) from exc
    finally:
        for w in workers:
            if not w.dead:
                kill(w)
