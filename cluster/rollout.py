"""Calls driven from a background thread: units' results as they commit, aborts, pauses.

    runner = RolloutRunner(dispatcher)                  # one per UnitDispatcher (jobs/pool.py)
    call = runner.submit(units, on_result, on_done)     # returns at once
    runner.abort(call)                                  # every unit back within moments, samples "abort"
    runner.pause("keep"); runner.call(lambda: dispatcher.load_weights(path)); runner.resume()

`UnitDispatcher.run` blocks its caller until a batch of units is in. An RL trainer wants
to hand over a call and go on: read each prompt's samples as soon as they are done, end
the call when it has enough (vLLM's abort), stop generation around a weights update
(vLLM's pause_generation / resume_generation). The runner owns the dispatcher from one
thread: every call's units join one queue (`UnitDispatcher.add_units`), the thread runs
`UnitDispatcher.advance` rounds (the same dispatch, deadlines, retries and replacements as
a job) and hands each committed unit to its call's `on_result`; everything else that
touches the dispatcher (submit, abort, pause, weights) is a command run on that thread
between rounds (`call`), so the dispatcher's books have one writer. Rounds wait at most
`poll_s` for a reply, which bounds how long a command waits behind them; a weights swap is
a command too, and may take long (a hung worker is given up only after start_timeout_s):
`submit` only posts its command, and `abort` and `pause` stop waiting at their timeout,
their command still queued, to run once the swap is done. Rounds go on while any worker
holds a copy, after every call has ended too: a copy left by a failed call, or a second
copy whose unit committed, is collected (its result ignored: its unit is settled), so the
worker's slot frees, a broken engine is replaced before the next call, and pause("wait")
sees the workers idle.

Abort (`abort`): every worker is told the call's unit indices (GenerationWorker.abort_units):
units in its engine end at once (Engine.abort: finished samples as they are, the others with
their tokens so far and finish_reason "abort"), units arriving later return such rows
without generating; units that no worker holds are answered by one worker without its
engine (GenerationWorker.aborted_units: no tokens, "abort"). Each unit still commits once
through the dispatcher's books (first copy wins), so no row is lost or duplicated.

Pause modes (vLLM's pause_generation):
- "abort": abort every open call, then hold new units until `resume`;
- "wait": dispatch nothing new; `pause` returns once no unit is on a worker (units already on a
  worker finish; units of a call not yet sent wait for `resume`). While "keep" holds, the
  engines are idle already: `pause` returns at once (the held samples stay held; the units
  holding them cannot finish before `resume`);
- "keep": dispatch nothing new, and every worker's engine aborts its unfinished requests and
  holds their samples (GenerationWorker.pause_engine), so the engines are idle and weights
  can be swapped; `resume` continues them (Engine.continue_request: tokens kept, their KV
  recomputed with the weights then loaded).
Unit deadlines run in "wait" and "abort" (the units on the workers still run, and a hung
worker holding one is replaced as in a run, its units queued for `resume`); while "keep"
holds samples on purpose they do not, and `resume` moves the running copies' start times on
by the time held. A worker that does not answer pause_engine or resume_engine, judged as a
weights swap judges it (cluster/weight_sync.py HangDeadline: no answer within
min(start_timeout_s, 60 s) while its engine stays still, or none to progress()), or that
died or broke meanwhile, is replaced, uncharged: its units go back to the queue, so
`pause` and `resume` never wait on it nor leave it running unpaused.

A call fails (on_done(error)) when the dispatcher raises (a unit failed max_unit_attempts
times, no worker can start): every open call fails then, since one failure can leave
another call's units unaccounted for; the workers stay up for the next call.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from cluster.dispatcher import UnitDispatcher
from cluster.health import WorkerState
from cluster.unit import UnitResult, WorkUnit

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(eq=False)
class RolloutCall:
    """One submitted call: its units, those not in yet, and how it ended.

    on_result(UnitResult) and on_done(error or None) run on the runner's thread."""

    units: dict[int, WorkUnit]
    on_result: Callable[[UnitResult], None]
    on_done: Callable[[BaseException | None], None] | None = None
    remaining: set[int] = field(default_factory=set)
    aborted: bool = False
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once every unit is in (or the call failed: see `error`)."""
        return self.done.wait(timeout_s)


@dataclass(eq=False)
class _Command:
    fn: Callable[[], Any]
    cancel: Callable[[BaseException], None] | None = None  # run instead of fn when the runner closed first
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            self.error = exc
        finally:
            self.done.set()


class RolloutRunner:
    """Drives one UnitDispatcher from a background thread (see the module docstring).

    poll_s: the longest a round waits for a worker's reply, and so about the longest a
    command (submit, abort, pause, weights) waits for its turn.
    """

    def __init__(self, dispatcher: UnitDispatcher, *, poll_s: float = 0.05) -> None:
        self.dispatcher = dispatcher
        self.poll_s = poll_s
        self._cv = threading.Condition()
        self._commands: list[_Command] = []  # guarded by _cv
        self._closed = False
        self._thread: threading.Thread | None = None
        # the loop thread's own state (commands run on it too)
        self._calls: list[RolloutCall] = []
        self._by_index: dict[int, RolloutCall] = {}
        self._paused: str | None = None
        self._paused_at = 0.0
        self._waiters: list[tuple[Callable[[], bool], threading.Event]] = []
        self._refs: list[Any] = []  # fire-and-forget worker calls, collected so Ray does not log them

    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None."""
        return self._paused

    # ------------------------------------------------------------------ commands
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the runner's thread between rounds and return what it returns (or
        raise what it raises): how anything else touches the dispatcher while calls run.
        Raises RuntimeError when closed."""
        if threading.current_thread() is self._thread:
            return fn()
        cmd = self._post(fn)
        cmd.done.wait()
        if cmd.error is not None:
            raise cmd.error
        return cmd.result

    def _post(self, fn: Callable[[], Any], cancel: Callable[[BaseException], None] | None = None) -> _Command:
        """Queue fn() to run on the runner's thread and return its command at once (its
        `done` is set once it ran; cancel(error) runs instead if the runner closes first).
        Raises RuntimeError when closed."""
        cmd = _Command(fn, cancel)
        with self._cv:
            if self._closed:
                raise RuntimeError("this pool is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="batchgen-rollouts", daemon=True)
                self._thread.start()
            self._commands.append(cmd)
            self._cv.notify_all()
        return cmd

    def _call_within(self, fn: Callable[[], Any], end: float | None) -> tuple[bool, Any]:
        """(True, fn()'s result) once fn() ran on the runner's thread (raising what it
        raises), or (False, None) at monotonic time `end` (None: no limit) if it has not run
        by then: it stays queued, and runs once the thread is free (after a weights swap)."""
        if threading.current_thread() is self._thread:
            return True, fn()
        cmd = self._post(fn)
        if not cmd.done.wait(None if end is None else max(0.0, end - time.monotonic())):
            return False, None
        if cmd.error is not None:
            raise cmd.error
        return True, cmd.result

    def submit(self, units: Iterable[WorkUnit], on_result: Callable[[UnitResult], None],
               on_done: Callable[[BaseException | None], None] | None = None) -> RolloutCall:
        """Queue a call's units; returns at once, a weights swap running or not (the call
        starts after it). Raises RuntimeError when closed; a unit index queued already
        (ValueError) fails the call (on_done(error))."""
        units = {u.index: u for u in units}
        call = RolloutCall(units=units, on_result=on_result, on_done=on_done, remaining=set(units))
        if not units:
            with self._cv:
                if self._closed:
                    raise RuntimeError("this pool is closed")
            self._end(call, None)
            return call
        self._post(lambda: self._start(call), lambda exc: self._fail_unstarted(call, exc))
        return call

    def abort(self, call: RolloutCall, timeout_s: float | None = None) -> bool:
        """End `call` (see the module docstring); True once every unit is in, False if
        `timeout_s` passed first (the abort stays under way: behind a weights swap, it runs
        once the swap is done)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._call_within(lambda: self._abort(call), end)[0]:
            return False
        return call.wait(None if end is None else max(0.0, end - time.monotonic()))

    def pause(self, mode: str = "abort", timeout_s: float | None = None) -> bool:
        """Pause generation (see the module docstring for the modes); returns True once the
        pause holds (abort: the open calls ended; wait: no unit on a worker; keep: every
        engine idle, its samples held), False if `timeout_s` passed first (the pause still
        takes hold: behind a weights swap, once the swap is done). Raises ValueError for
        another mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        end = None if timeout_s is None else time.monotonic() + timeout_s
        ran, got = self._call_within(lambda: self._pause(mode), end)
        if not ran:
            return False
        calls, idle = got
        for c in calls:
            if not c.wait(None if end is None else max(0.0, end - time.monotonic())):
                return False
        return idle.wait(None if end is None else max(0.0, end - time.monotonic()))

    def resume(self) -> None:
        """Undo `pause`: held samples continue (keep), queued units are dispatched again."""
        self.call(self._resume)

    def close(self) -> None:
        """Fail the open calls and stop the thread (the dispatcher is the caller's to close)."""
        with self._cv:
            if self._closed:
                return
            thread = self._thread
        if thread is not None and thread.is_alive():
            try:
                self.call(lambda: [self._end(c, RuntimeError("the pool was closed")) for c in list(self._calls)])
            except RuntimeError:
                pass
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if thread is not None:
            thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop thread
    def _copies_out(self) -> bool:
        """Whether a live worker holds a copy of a unit (the loop thread's view)."""
        return any(w.copies for w in self.dispatcher.slots.live())

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._closed and not self._commands and not self._calls and not self._waiters
                       and not self._copies_out()):
                    self._cv.wait()
                if self._closed:
                    for c in self._commands:
                        c.error = RuntimeError("this pool is closed")
                        if c.cancel is not None:
                            c.cancel(c.error)
                        c.done.set()
                    return
                commands, self._commands = self._commands, []
            for c in commands:
                c.run()
            failed = False
            try:
                self._collect_refs()
                if self._calls:
                    self._settle_aborted()
                if self._calls or self._copies_out():  # copies of ended calls are collected too
                    self.dispatcher.advance(self._on_result, self.poll_s, dispatch=self._paused is None,
                                            deadlines=self._paused != "keep")
                self._check_waiters()
            except BaseException as exc:  # noqa: BLE001 - UnitFailed and the like end every open call
                failed = True
                for c in list(self._calls):
                    self._end(c, exc)
            if failed or self._waiters or (self._calls and not self.dispatcher.slots.refs):
                with self._cv:  # nothing to wait on in Ray (paused, or workers gone): no busy loop
                    if not self._commands:
                        self._cv.wait(self.poll_s)

    def _start(self, call: RolloutCall) -> None:
        if call.done.is_set():
            return
        try:
            self.dispatcher.add_units(call.units.values())
        except Exception as exc:  # noqa: BLE001 - a unit index queued already, the dispatcher closed
            call.remaining -= self._by_index.keys()  # another call's units: not this call's to forget
            self._end(call, exc)
            return
        self._calls.append(call)
        for i in call.units:
            self._by_index[i] = call

    def _on_result(self, result: UnitResult) -> None:
        """A unit committed: to its call; the call ends with its last unit."""
        call = self._by_index.pop(result.index, None)
        self.dispatcher.units.forget([result.index])
        if call is None:
            return
        call.remaining.discard(result.index)
        try:
            call.on_result(result)
        except BaseException as exc:  # noqa: BLE001 - the consumer's error ends its call, not the runner
            self._end(call, exc)
            return
        if not call.remaining:
            self._end(call, None)

    def _fail_unstarted(self, call: RolloutCall, error: BaseException) -> None:
        """End a call whose units never reached the dispatcher (the runner closed first): none
        of its indices are in the books, so there is nothing of its own to forget."""
        call.remaining = set()
        self._end(call, error)

    def _end(self, call: RolloutCall, error: BaseException | None) -> None:
        if call.done.is_set():
            return
        if call in self._calls:
            self._calls.remove(call)
        for i in call.remaining:
            self._by_index.pop(i, None)
        self.dispatcher.units.forget(call.remaining)
        call.error = error
        if call.on_done is not None:
            try:
                call.on_done(error)
            except BaseException:  # noqa: BLE001 - a consumer's callback never stops the runner
                pass
        call.done.set()

    def _abort(self, call: RolloutCall) -> None:
        if call.done.is_set() or call.aborted:
            return
        call.aborted = True
        indices = sorted(call.remaining)
        for w in self.dispatcher.slots.live():  # every worker: a copy may be on its way to any of them
            self._refs.append(w.handle.abort_units.remote(indices))
        self._settle_aborted()

    def _settle_aborted(self) -> None:
        """Units of aborted calls that no worker holds get their rows from one worker without
        its engine; second copies waiting in the queue are dropped (the first copy answers).
        A worker that died or hangs meanwhile (no answer within min(start_timeout_s, 60 s)
        while its engine stays still, or no answer to progress(): cluster/weight_sync.py's
        rule) is replaced, uncharged, and the next round asks another."""
        from ray.exceptions import RayTaskError

        from cluster.weight_sync import HangDeadline

        lone: list[WorkUnit] = []
        for call in self._calls:
            if call.aborted:
                lone += self.dispatcher.units.unsent(call.remaining)
        if not lone:
            return
        ready = [w for w in self.dispatcher.slots.live() if w.state == WorkerState.READY]
        if not ready:
            return  # the next round, once a worker is back
        w = ready[0]
        deadline = HangDeadline(min(self.dispatcher.slots.start_timeout_s, HangDeadline.PROGRESS_S), [w])
        try:
            results = deadline.get(w.handle.aborted_units.remote(lone), w)
        except RayTaskError:
            return  # it could not read them: the next round tries again
        except Exception as exc:  # noqa: BLE001 - gone (RayActorError) or hung (GetTimeoutError)
            self.dispatcher._replace(w, deadline.why(w, "aborted_units", exc), charge=False)
            return  # its units are queued again: the next round takes them too, on another worker
        for r in results:
            self._on_result(r)

    def _pause(self, mode: str) -> tuple[list[RolloutCall], threading.Event]:
        if mode == "keep" and self._paused != "keep":
            self._paused_at = time.monotonic()  # the running copies are held from now on
        if self._paused != "keep":
            self._paused = mode
        idle = threading.Event()
        calls: list[RolloutCall] = []
        if mode == "abort":
            calls = list(self._calls)
            for c in calls:
                self._abort(c)
            idle.set()
        elif mode == "wait" and self._paused == "keep":
            idle.set()  # the engines hold their samples, idle: their units finish after resume
        elif mode == "wait":
            self._waiters.append((lambda: not any(w.copies for w in self.dispatcher.slots.live()), idle))
        else:
            self._paused = "keep"
            self._on_every_worker("pause_engine")
            idle.set()
        return calls, idle

    def _on_every_worker(self, method: str) -> None:
        """Call GenerationWorker.`method` on every live worker and wait for each; a worker that
        died, failed (a broken engine) or hangs (HangDeadline, as in a weights swap: no
        answer within min(start_timeout_s, 60 s) while its engine stays still, or none to
        progress()) is replaced, uncharged, its units queued again."""
        from cluster.weight_sync import HangDeadline

        live = self.dispatcher.slots.live()
        deadline = HangDeadline(min(self.dispatcher.slots.start_timeout_s, HangDeadline.PROGRESS_S), live)
        for ref, w in [(getattr(w.handle, method).remote(), w) for w in live]:
            try:
                deadline.get(ref, w)
            except Exception as exc:  # noqa: BLE001 - gone, broken or hung: never paused (or resumed) for sure
                self.dispatcher._replace(w, deadline.why(w, method, exc), charge=False)

    def _resume(self) -> None:
        if self._paused is None:
            return
        if self._paused == "keep":
            self._on_every_worker("resume_engine")
            held = time.monotonic() - self._paused_at
            for w in self.dispatcher.slots.live():  # held samples are not a slow unit, nor a stalled one
                for c in w.copies.values():
                    c.sent += held
                    c.watch_since += held
        self._paused = None

    def _check_waiters(self) -> None:
        for pred, ev in list(self._waiters):
            if pred():
                ev.set()
                self._waiters.remove((pred, ev))

    def _collect_refs(self) -> None:
        if self._refs:
            import ray

            done, self._refs = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - a worker gone meanwhile; its units are requeued
                    pass
