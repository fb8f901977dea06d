"""A GenerationWorker's part in a pool's calls being aborted and paused (cluster/rollout.py).

`RolloutMethods` is mixed into GenerationWorker (cluster/worker.py) and uses its state: the
lock `_cv`, the inbox of posted units, the request owners, and three fields of its own,
`_aborted` (indices of aborted units), `_paused` and `_held` (see pause_engine). Whatever
touches the engine runs on the engine-loop thread, as an op (`_ops`: a function of the
engine, run at the top of the loop's next round whether the engine is busy or not), so the
engine keeps its one thread.

- `abort_units(indices)`: units still in the inbox end at once without the engine; units in
  the engine end through Engine.abort on the loop thread (finished samples as they are, the
  others with their tokens so far, finish_reason "abort"); units arriving later end at
  once (run_unit checks `_aborted`). Each request is delivered once, through the owners
  map, so a unit's rows are neither lost nor duplicated.
- `aborted_units(units)`: the rows of units no worker ever received (no tokens, "abort").
- `pause_engine()` / `resume_engine()`: vLLM's pause_generation(mode="keep"). The loop
  aborts every request in the engine and holds the outputs; the engine is idle, so a
  weights swap (commit_weights) runs; new requests stay in the inbox. On resume each held
  request is continued (Engine.continue_request: tokens kept, KV recomputed with the
  weights then loaded).
"""
from __future__ import annotations

import threading
from typing import Any

from cluster.unit import UnitResult, WorkUnit


class RolloutMethods:
    """Actor methods of GenerationWorker for aborted and paused calls (module docstring)."""

    def abort_units(self, indices: list[int]) -> int:
        """End every request of units `indices` (an aborted call): their `run_unit` calls
        return at once, each prompt with its finished samples as they are and the others
        with their tokens so far and finish_reason "abort" (Engine.abort), every sample once.
        Units that arrive later return such rows without generating. Returns how many of the
        units this worker holds now."""
        idx = set(indices)
        with self._cv:
            self._aborted |= idx
            keep = []
            for state, reqs in self._inbox:  # posted, not in the engine yet
                if state.unit.index in idx:
                    for rid, _ in reqs:
                        self._owners.pop(rid, None)
                    self._units.discard(state)
                    fill_aborted(state, reqs, self.task.params)
                else:
                    keep.append((state, reqs))
            self._inbox = keep
            held = {s for s in self._units if s.unit.index in idx}
            rids = [rid for rid, (s, _) in self._owners.items() if s in held]
            if rids:
                self._ops.append(lambda eng: self._abort_requests(eng, rids))
                self._cv.notify_all()
        return len(held)

    def aborted_units(self, units: list[WorkUnit]) -> list[UnitResult]:
        """The rows of units of an aborted call that never reached a worker: every sample with
        no tokens and finish_reason "abort" (the prompts read and tokenized as `run_unit`
        reads them; a bad row is its error row as there); the engine is not touched."""
        from engine.params import aborted_output, error_output

        results = []
        for unit in units:
            requests = self.task.read_unit(unit, self.tokenizer)
            outputs = []
            for row, req in enumerate(requests):
                params = req.params or self.task.params
                if req.prompt_tokens is None:
                    outputs.append(error_output((unit.index, row), req.prompt_id, None, params,
                                                req.error or "invalid prompt"))
                else:
                    outputs.append(aborted_output((unit.index, row), req.prompt_id, req.prompt_tokens, params))
            result = self.task.write_unit(unit, requests, outputs, self.tokenizer)
            result.worker = result.worker or self.name
            results.append(result)
        return results

    def pause_engine(self) -> int:
        """vLLM's pause_generation(mode="keep"): the engine loop aborts every unfinished
        request and holds its samples (tokens so far), admits nothing more, and so is idle
        (a weights swap can run); `resume_engine` continues them. Returns once the engine
        loop has done so: the number of requests held."""
        done = threading.Event()
        count: list[int] = []

        def pause(eng: Any) -> None:
            with self._cv:
                rids = [rid for rid, (s, _) in self._owners.items() if s.in_engine]
            outs = eng.abort(rids)
            with self._cv:
                self._held.extend(outs)
                count.append(len(self._held))
            done.set()

        with self._cv:
            self._paused = True  # set here: the loop round that runs `pause` takes nothing from the inbox
            self._ops.append(pause)
            self._cv.notify_all()
        self._wait(done)
        return count[0] if count else 0

    def resume_engine(self) -> int:
        """Continue the requests `pause_engine` held (Engine.continue_request: their prompt and
        tokens so far prefilled again with the weights now loaded) and admit new ones again.
        Returns the number of requests continued."""
        done = threading.Event()
        count: list[int] = []

        def resume(eng: Any) -> None:
            with self._cv:
                held, self._held = self._held, []
                self._paused = False
                owners = {out.request_id: self._owners.get(out.request_id) for out in held}
            for out in held:
                owner = owners[out.request_id]
                if owner is None:  # its unit was aborted meanwhile (delivered already)
                    continue
                state, row = owner
                eng.continue_request(out, state.requests[row].params or self.task.params)
            count.append(len(held))
            done.set()

        with self._cv:
            self._ops.append(resume)
            self._cv.notify_all()
        self._wait(done)
        return count[0] if count else 0

    def _abort_requests(self, eng: Any, rids: list[Any]) -> None:
        """On the engine loop: end requests `rids`, held ones included, and deliver them."""
        ids = set(rids)
        with self._cv:
            held = [out for out in self._held if out.request_id in ids]
            self._held = [out for out in self._held if out.request_id not in ids]
        self._deliver(held + eng.abort(rids))


def fill_aborted(state: Any, reqs: list[tuple[Any, Any]], params: Any) -> None:
    """Requests `reqs` of unit `state` (cluster.worker._UnitState) end before the engine saw
    them: every sample "abort", no tokens; the unit is done. params: the task's, for
    requests without their own."""
    from engine.params import aborted_output

    for rid, req in reqs:
        state.outputs[rid[1]] = aborted_output(rid, req.prompt_id, req.prompt_tokens, req.params or params)
    state.remaining = 0
    state.done.set()
