"""UnitQueue's books (cluster/unit_queue.py) without Ray: in_flight() is counted as units change
(a progress report counted every unit: quadratic over a run of 100k+ units), so after every
transition (queued, in flight, overdue with two copies, committed, the late copy's return,
failed, lost with its worker, forgotten, added, unsent, a new run while an earlier run's copies
are still out) the counts must equal a brute-force recount over the units.
"""
from __future__ import annotations

import random
from collections import deque

import pytest

from cluster.unit import UnitFailed, WorkUnit
from cluster.unit_queue import UnitQueue, UnitState


class W:
    """A worker as the queue sees one (cluster.health.WorkerRecord): a name."""

    def __init__(self, name: str) -> None:
        self.name = name


def units(lo: int, hi: int) -> list[WorkUnit]:
    return [WorkUnit(index=i, source="f", row_start=i * 10, row_end=i * 10 + 10) for i in range(lo, hi)]


def check(q: UnitQueue) -> None:
    """Every count against a recount over the run's units."""
    live = list(q.units.values())
    assert q.in_flight() == sum(1 for u in live if u.copies and u.state != UnitState.COMMITTED)
    assert q.pending == sum(1 for u in live if u.state != UnitState.COMMITTED)
    assert sorted(id(u) for u in q.queue) == sorted(id(u) for u in live if u.queued)
    assert len(set(map(id, q.queue))) == len(q.queue)


def make(n: int = 6, attempts: int = 3) -> UnitQueue:
    q = UnitQueue(max_unit_attempts=attempts, unit_timeout_s=60.0, events=deque(maxlen=100))
    q.reset(units(0, n))
    check(q)
    return q


def test_every_transition_keeps_the_counts():
    q = make()
    a, b, c = W("a"), W("b"), W("c")
    assert q.in_flight() == 0 and q.pending == 6 and len(q.queue) == 6
    # queued -> in flight
    u0 = q.take(a, 8)
    c0a = q.sent(u0, a, 0.0)
    check(q)
    u1 = q.take(b, 8)
    c1b = q.sent(u1, b, 0.0)
    check(q)
    assert q.in_flight() == 2 and u0.state == UnitState.IN_FLIGHT
    # overdue: a second copy is queued at the front, then sent elsewhere: two copies, counted once
    assert q.overdue(c0a, 100.0)
    check(q)
    assert u0.state == UnitState.OVERDUE and q.queue[0] is u0 and q.in_flight() == 2
    assert q.take(a, 8) is not u0  # never two copies on one worker
    check(q)
    q.enqueue(q.units[2])  # (take removed unit 2 from the queue; put it back)
    u0b = q.take(b, 8)
    assert u0b is u0
    c0b = q.sent(u0, b, 1.0)
    check(q)
    assert len(u0.copies) == 2 and q.in_flight() == 2
    # the second copy commits: the first is orphaned and still counted nowhere
    assert q.commit(c0b, 2.0)
    check(q)
    assert q.in_flight() == 1 and c0a.orphaned_at == 2.0 and q.pending == 5
    # the late first copy returns: a duplicate, ignored
    assert not q.commit(c0a, 3.0)
    check(q)
    assert q.in_flight() == 1 and q.pending == 5
    # a failed copy: charged and queued again
    assert q.drop(c1b) is u1
    check(q)
    assert q.in_flight() == 0
    q.retry(u1, "boom", avoid="b")
    check(q)
    assert u1.state == UnitState.QUEUED and u1.queued and u1.attempts == 1
    # lost with its worker (charged and not): back at the front of the queue
    u1 = q.take(b, 8)  # avoids b if it can, so it may be another unit
    c_lost = q.sent(u1, b, 4.0)
    u3 = q.take(c, 8)
    c_other = q.sent(u3, c, 4.0)
    check(q)
    assert q.in_flight() == 2
    q.lost([c_lost], "worker b died", charge=True)
    check(q)
    assert q.in_flight() == 1 and q.queue[0] is u1 and u1.state == UnitState.QUEUED
    q.lost([c_other], "worker c replaced", charge=False)
    check(q)
    assert q.in_flight() == 0 and u3.attempts == 0
    # a unit that fails max_unit_attempts times: failed, and its other copy still counted
    u = q.take(a, 8)
    ca = q.sent(u, a, 5.0)
    q.overdue(ca, 500.0)
    ua = q.take(b, 8)
    assert ua is u
    cb = q.sent(u, b, 6.0)
    check(q)
    u.attempts = q.max_unit_attempts - 1
    assert q.drop(ca) is u
    with pytest.raises(UnitFailed):
        q.retry(u, "out of memory")
    check(q)
    assert u.state == UnitState.FAILED and q.in_flight() == 1  # cb still out
    assert q.drop(cb) is None  # settled
    check(q)
    assert q.in_flight() == 0


def test_runs_fed_while_running_forget_add_unsent_and_a_new_run():
    q = make(4)
    a, b = W("a"), W("b")
    ca = q.sent(q.take(a, 8), a, 0.0)
    cb = q.sent(q.take(b, 8), b, 0.0)
    q.add(units(4, 7))
    check(q)
    assert q.pending == 7 and q.in_flight() == 2
    with pytest.raises(ValueError):
        q.add(units(5, 6))
    check(q)
    # forgotten while its copy runs: no longer the run's, and its return changes nothing
    q.forget([ca.unit.unit.index, 5])
    check(q)
    assert q.in_flight() == 1 and q.pending == 5
    assert not q.commit(ca, 1.0)
    check(q)
    # a copy waiting as a second copy leaves the queue when its call is aborted
    q.overdue(cb, 100.0)
    check(q)
    assert cb.unit.queued
    assert q.unsent([cb.unit.unit.index, 2, 3]) == [q.units[2].unit, q.units[3].unit]
    check(q)
    assert not cb.unit.queued and q.in_flight() == 1
    # a new run while a copy of the earlier one is still out: the new run counts its own only
    q.reset(units(0, 3))
    check(q)
    assert q.in_flight() == 0
    c_new = q.sent(q.take(a, 8), a, 2.0)
    check(q)
    assert q.in_flight() == 1
    assert not q.commit(cb, 3.0)  # the earlier run's copy returns
    check(q)
    q.lost([cb], "gone", charge=True)  # (already removed: nothing)
    check(q)
    assert q.in_flight() == 1
    assert q.commit(c_new, 4.0)
    check(q)
    assert q.in_flight() == 0 and q.pending == 2


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_keep_the_counts(seed):
    """Random sequences of everything the dispatcher does, the counts checked after each step."""
    rng = random.Random(seed)
    q = make(rng.randint(1, 30), attempts=rng.randint(1, 4))
    workers = [W(f"w{i}") for i in range(4)]
    out: list = []  # copies on workers
    next_index = 1000
    for _ in range(400):
        op = rng.random()
        try:
            if op < 0.3 and q.queue:
                w = rng.choice(workers)
                u = q.take(w, 8)
                if u is not None:
                    out.append(q.sent(u, w, 0.0))
            elif op < 0.45 and out:
                q.commit(out.pop(rng.randrange(len(out))), 1.0)
            elif op < 0.55 and out:
                c = out.pop(rng.randrange(len(out)))
                u = q.drop(c)
                if u is not None:
                    q.retry(u, "failed", avoid=c.worker.name, front=rng.random() < 0.5)
            elif op < 0.65 and out:
                c = rng.choice(out)
                if not c.overdue:
                    q.overdue(c, 100.0)
            elif op < 0.72 and out:
                w = rng.choice(workers)
                mine = [c for c in out if c.worker is w]
                out = [c for c in out if c.worker is not w]
                q.lost(mine, "lost", charge=rng.random() < 0.5)
            elif op < 0.78:
                q.add(units(next_index, next_index + rng.randint(1, 3)))
                next_index += 3
            elif op < 0.84 and q.units:
                q.forget(rng.sample(sorted(q.units), min(len(q.units), rng.randint(1, 3))))
            elif op < 0.9 and q.units:
                q.unsent(rng.sample(sorted(q.units), min(len(q.units), rng.randint(1, 4))))
            elif op < 0.92:
                q.reset(units(0, rng.randint(0, 10)))  # earlier copies stay out and return later
        except UnitFailed:
            pass
        check(q)
