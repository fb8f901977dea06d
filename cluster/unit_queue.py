"""The units of one dispatcher run: their states and copies, the queue, attempts, the deadline.

Unit states (`UnitState`):
    queued     waiting for a worker (new, failed, lost with its worker, or a second copy)
    in_flight  one copy running on a worker
    overdue    a copy passed its deadline: a second copy is queued or running elsewhere
    committed  a copy returned; later copies are ignored (first commit wins)
    failed     charged `max_unit_attempts` failed attempts: the run raises UnitFailed

A unit may run as two copies at once (a second copy after its deadline); the first to
return commits it (`commit`), and the copies still running are marked orphaned: a worker
that holds one too long is replaced (cluster/health.py). The deadline of a copy is
`unit_timeout_s`, or when None 10x the median time of the last committed units, at least
300 s (1800 s before 3 units have committed).

The UnitDispatcher (cluster/dispatcher.py) sends the copies and hears back; the queue keeps
the books. Both append to the dispatcher's event log, (time, kind, detail).
"""
from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from cluster.unit import UnitFailed, WorkUnit

log = logging.getLogger("batchgen.pool")

UNIT_TIMEOUT_FACTOR = 10.0  # derived deadline: this many times the median unit time ...
UNIT_TIMEOUT_FLOOR_S = 300.0  # ... and never less than this
UNIT_TIMEOUT_INITIAL_S = 1800.0  # before MEDIAN_MIN_UNITS units have committed
MEDIAN_MIN_UNITS = 3
MEDIAN_WINDOW = 200  # the median is over the most recent committed units


class UnitState(str, Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    OVERDUE = "overdue"
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class Copy:
    """One dispatched run of a unit on a worker (a cluster.health.WorkerRecord)."""

    unit: "UnitEntry"
    worker: Any
    sent: float
    overdue: bool = False
    orphaned_at: float | None = None  # another copy committed at this time
    # while overdue (cluster/health.py): its worker's last progress() mark for it, whether
    # that mark changed since the deadline, and when it last changed (or the deadline passed)
    mark: Any = None
    progressed: bool = False
    watch_since: float = 0.0


@dataclass(slots=True, eq=False)
class UnitEntry:
    """A unit of the run and its books."""

    unit: WorkUnit
    state: UnitState = UnitState.QUEUED
    attempts: int = 0  # failed attempts charged
    last_error: str = ""
    copies: list[Copy] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)  # workers it failed on
    queued: bool = False  # in the dispatch queue now


def describe(unit: WorkUnit) -> str:
    return f"unit {unit.index} ({unit.source} rows {unit.row_start}-{unit.row_end})"


class UnitQueue:
    """The books of a run's units (see the module docstring)."""

    def __init__(self, *, max_unit_attempts: int, unit_timeout_s: float | None, events: deque) -> None:
        self.max_unit_attempts = max(1, int(max_unit_attempts))
        self.unit_timeout_s = unit_timeout_s
        self.events = events
        self.units: dict[int, UnitEntry] = {}
        self.queue: deque[UnitEntry] = deque()
        self.pending = 0  # units not committed yet
        # units of this run with a copy out and not committed (what in_flight counts), kept by
        # _book at every change of a unit's copies, state or membership: a progress report
        # counted them over every unit (7 ms a report at 200,000 units)
        self._flying: set[UnitEntry] = set()
        self._durations: deque[float] = deque(maxlen=MEDIAN_WINDOW)
        self._timeout_cache: float | None = None

    def _event(self, kind: str, detail: str) -> None:
        self.events.append((time.time(), kind, detail))

    def reset(self, units: Iterable[WorkUnit]) -> None:
        """A new run: every unit queued, in index order."""
        self.units = {u.index: UnitEntry(u) for u in units}
        self.queue = deque()
        self._flying = set()  # an earlier run's units are not this run's (_book)
        for u in sorted(self.units.values(), key=lambda x: x.unit.index):
            self.enqueue(u)
        self.pending = len(self.units)

    # ------------------------------------------------------------------ deadline
    def deadline(self) -> float:
        """The current per-copy deadline in seconds (fixed, or derived from committed units)."""
        if self.unit_timeout_s is not None:
            return float(self.unit_timeout_s)
        if self._timeout_cache is None:
            if len(self._durations) < MEDIAN_MIN_UNITS:
                self._timeout_cache = UNIT_TIMEOUT_INITIAL_S
            else:
                self._timeout_cache = max(UNIT_TIMEOUT_FLOOR_S, UNIT_TIMEOUT_FACTOR * statistics.median(self._durations))
        return self._timeout_cache

    def deadline_known(self) -> bool:
        """Whether the deadline is fixed or measured (not the initial guess)."""
        return self.unit_timeout_s is not None or bool(self._durations)

    def overdue(self, c: Copy, now: float) -> bool:
        """Copy `c` passed the deadline: its unit is overdue and gets a second copy, unless it
        is settled. Returns whether the unit was still open."""
        c.overdue = True
        u = c.unit
        if self.settled(u):
            return False
        u.state = UnitState.OVERDUE
        self._book(u)
        log.warning("unit %d passed its deadline on %s (%.0fs > %.0fs): dispatching a second copy",
                    u.unit.index, c.worker.name, now - c.sent, self.deadline())
        self._event("overdue", f"unit {u.unit.index} on {c.worker.name}")
        if len(u.copies) < 2:
            self.enqueue(u, front=True)
        return True

    # ------------------------------------------------------------------ the queue
    def settled(self, u: UnitEntry) -> bool:
        """Committed, failed, or a unit of an earlier run: its copies' results no longer count."""
        return u.state in (UnitState.COMMITTED, UnitState.FAILED) or self.units.get(u.unit.index) is not u

    def enqueue(self, u: UnitEntry, front: bool = False) -> None:
        if u.queued:
            return
        u.queued = True
        if front:
            self.queue.appendleft(u)
        else:
            self.queue.append(u)

    def take(self, worker: Any, window: int) -> UnitEntry | None:
        """The queued unit `worker` should run, out of the queue: among the first `window`,
        the first it has not failed, else the first it may take at all (not one it already
        runs); None if there is none."""
        pick = fallback = None
        for i, u in enumerate(itertools.islice(self.queue, window)):
            if any(c.worker is worker for c in u.copies):
                continue
            if worker.name not in u.avoid:
                pick = i
                break
            if fallback is None:
                fallback = i
        if pick is None:
            pick = fallback
        if pick is None:
            return None
        u = self.queue[pick]
        del self.queue[pick]
        u.queued = False
        return u

    def sent(self, u: UnitEntry, worker: Any, now: float) -> Copy:
        """A copy of `u` was sent to `worker`."""
        c = Copy(unit=u, worker=worker, sent=now)
        u.copies.append(c)
        if u.state != UnitState.OVERDUE:
            u.state = UnitState.IN_FLIGHT
        self._book(u)
        if len(u.copies) > 1:
            self._event("hedge", f"unit {u.unit.index} second copy on {worker.name}")
        return c

    def in_flight(self) -> int:
        """Units of this run with a copy on a worker, not committed (overdue and failed ones
        included): O(1), counted as they change (_book)."""
        return len(self._flying)

    def _book(self, u: UnitEntry) -> None:
        """Keep in_flight's count after a change of `u`'s copies, state or membership of the run."""
        if u.copies and u.state != UnitState.COMMITTED and self.units.get(u.unit.index) is u:
            self._flying.add(u)
        else:
            self._flying.discard(u)

    # ------------------------------------------------------------------ outcomes
    def commit(self, c: Copy, now: float) -> bool:
        """Copy `c` returned: it commits its unit if it is the first (returns True); a later
        copy, or one of an earlier run, is ignored (False)."""
        u = c.unit
        u.copies = [x for x in u.copies if x is not c]
        self._book(u)
        if self.settled(u):
            self._event("duplicate", f"unit {u.unit.index} second copy done on {c.worker.name}")
            return False
        u.state = UnitState.COMMITTED
        self._book(u)
        if u.queued:  # a second copy was waiting for a worker: not needed any more
            self.queue.remove(u)
            u.queued = False
        for other in u.copies:
            other.orphaned_at = now
        self.pending -= 1
        self._durations.append(now - c.sent)
        self._timeout_cache = None
        return True

    def drop(self, c: Copy) -> UnitEntry | None:
        """Copy `c` failed: its unit, or None when the unit is settled."""
        u = c.unit
        u.copies = [x for x in u.copies if x is not c]
        self._book(u)
        return None if self.settled(u) else u

    def retry(self, u: UnitEntry, why: str, *, avoid: str | None = None, front: bool = False) -> None:
        """Charge `u` one failed attempt (it avoids worker `avoid` from now on) and queue it
        again unless another copy runs. Raises UnitFailed at max_unit_attempts."""
        if avoid is not None:
            u.avoid.add(avoid)
        self.charge(u, why)
        if not u.copies:
            u.state = UnitState.QUEUED
            self._book(u)
            self.enqueue(u, front=front)

    def lost(self, copies: list[Copy], why: str, *, charge: bool) -> None:
        """The copies of a replaced worker: their units go back to the front of the queue
        (each charged one attempt if `charge`)."""
        for c in sorted(copies, key=lambda c: c.unit.unit.index, reverse=True):
            u = c.unit
            u.copies = [x for x in u.copies if x is not c]
            self._book(u)
            if self.settled(u):
                continue
            if charge:
                self.charge(u, why)
            if not u.copies:
                u.state = UnitState.QUEUED
                self._book(u)
                self.enqueue(u, front=True)

    def charge(self, u: UnitEntry, why: str) -> None:
        u.attempts += 1
        u.last_error = why
        self._event("unit_failed", f"unit {u.unit.index} attempt {u.attempts}: {why.splitlines()[0]}")
        if u.attempts >= self.max_unit_attempts:
            u.state = UnitState.FAILED
            self._book(u)
            raise UnitFailed(f"{describe(u.unit)} failed {u.attempts} times "
                             f"(max_unit_attempts={self.max_unit_attempts}); last error: {why}")

    # ------------------------------------------------------------------ runs fed while running (cluster/rollout.py)
    def add(self, units: Iterable[WorkUnit]) -> None:
        """Queue more units into the run under way, in index order after those waiting.
        Raises ValueError for an index the run holds already."""
        new = sorted((UnitEntry(u) for u in units), key=lambda x: x.unit.index)
        for u in new:
            if u.unit.index in self.units:
                raise ValueError(f"unit {u.unit.index} is in the run already")
        for u in new:
            self.units[u.unit.index] = u
            self.enqueue(u)
        self.pending += len(new)

    def forget(self, indices: Iterable[int]) -> None:
        """Drop units from the run's books: committed ones (a long-lived run stays small) or
        ones whose call ended otherwise (failed, or answered without a worker); copies still
        running are ignored when they return (`settled`)."""
        for i in indices:
            u = self.units.pop(i, None)
            if u is None:
                continue
            self._book(u)  # no longer the run's
            if u.queued:
                self.queue.remove(u)
                u.queued = False
            if u.state != UnitState.COMMITTED:
                self.pending -= 1

    def unsent(self, indices: Iterable[int]) -> list[WorkUnit]:
        """Of units `indices` (an aborted call's), those waiting with no copy on a worker, in
        index order; they stay queued until answered. Queued second copies of the others
        leave the queue: the copy on a worker answers."""
        out = []
        for i in sorted(indices):
            u = self.units.get(i)
            if u is None or not u.queued:
                continue
            if u.copies:
                self.queue.remove(u)
                u.queued = False
            else:
                out.append(u.unit)
        return out
