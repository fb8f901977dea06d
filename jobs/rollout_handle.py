"""`RolloutHandle`: one submitted GenerationPool call, read as its prompts finish.

    handle = pool.submit(prompts, {"seed": step})     # returns at once
    for group in handle.results():                    # one pyarrow.RecordBatch per prompt, as each completes
        score(group)                                  # all num_samples rows of one prompt
        if enough(): handle.abort()                   # the rest come back now, unfinished samples "abort"
    table = handle.result()                           # every row, in prompt order (what generate returns)

The call's units commit one by one on the pool's runner thread (cluster/rollout.py); each
unit's rows (the output schema) are cut into its prompts' groups, which `results()` yields
in the order they complete. A group is complete when all of its prompt's samples are in:
finished, or ended by an abort with their tokens so far (finish_reason "abort").
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Iterator

import pyarrow as pa

from cluster.rollout import RolloutCall, RolloutRunner
from cluster.unit import UnitResult

_DONE = object()


class RolloutHandle:
    """A call submitted with GenerationPool.submit (see the module docstring).

    Thread-safe: results() may run in one thread while another calls abort().
    """

    def __init__(self, runner: RolloutRunner, task: Any, call_info: Any, num_prompts: int) -> None:
        self._runner = runner
        self._task = task
        self._info = call_info  # the task's call (jobs.pool_task.PoolCall): schema, unit order
        self.num_prompts = num_prompts
        self._results: list[UnitResult] = []
        self._queue: queue.Queue = queue.Queue()
        self._groups: deque = deque()  # groups of a unit taken from the queue, not yielded yet (_lock)
        self._lock = threading.Lock()
        self._call: RolloutCall | None = None
        self.submitted_at = time.monotonic()

    # callbacks, on the runner's thread
    def _on_result(self, result: UnitResult) -> None:
        with self._lock:
            self._results.append(result)
        self._queue.put(result)

    def _on_done(self, error: BaseException | None) -> None:
        self._queue.put(_DONE)

    def _start(self, units: list[Any]) -> "RolloutHandle":
        self._call = self._runner.submit(units, self._on_result, self._on_done)
        return self

    # ------------------------------------------------------------------ reading
    @property
    def schema(self) -> pa.Schema:
        """The rows' schema (the job's output schema, with the call's passthrough columns)."""
        return self._info.schema

    def done(self) -> bool:
        """Every unit of the call is in (or the call failed)."""
        return self._call is not None and self._call.done.is_set()

    def results(self, timeout_s: float | None = None) -> Iterator[pa.RecordBatch]:
        """Yield each prompt's group of rows (a pyarrow.RecordBatch of its num_samples rows,
        in sample_index order) as soon as the group is complete, until every group of the
        call has come. Raises TimeoutError when no group comes within `timeout_s`, and the
        call's error (cluster.unit.UnitFailed) after the groups that did come. A reader
        that stops early (a `break`) leaves the groups it did not take to the next call of
        results(), those of a unit it was reading included."""
        while True:
            with self._lock:
                group = self._groups.popleft() if self._groups else None
            if group is not None:
                yield group
                continue
            try:
                item = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no group of the call came within {timeout_s} s") from None
            if item is _DONE:
                self._queue.put(_DONE)  # for another reader
                if self._call is not None and self._call.error is not None:
                    raise self._call.error
                return
            if item.data is not None:
                groups = list(prompt_groups(item.data))
                with self._lock:
                    self._groups.extend(groups)

    def result(self, timeout_s: float | None = None) -> pa.Table:
        """Every row of the call, in prompt order then sample index (as `generate` returns
        them), once every unit is in. Raises TimeoutError, or the call's error."""
        if self._call is not None and not self._call.wait(timeout_s):
            raise TimeoutError(f"the call did not finish within {timeout_s} s")
        if self._call is not None and self._call.error is not None:
            raise self._call.error
        with self._lock:
            results = list(self._results)
        return self._task.collect(self._info, results)

    # ------------------------------------------------------------------ ending
    def abort(self, timeout_s: float | None = 10.0) -> bool:
        """End the call: finished samples come back as they are, unfinished ones with their
        tokens so far and finish_reason "abort", samples never started with no tokens and
        "abort"; every sample of the call exactly once. Returns True once every unit is in
        (False if `timeout_s` passed first, behind a weights swap too: the abort then runs
        after it); `results()` and `result()` then give the rest.
        The pool takes the next call at once. A call already ended (done(): finished,
        failed, or ended by the pool's close) is left as it is: True, even once the pool
        is closed."""
        if self._call is None or self._call.done.is_set():
            return True
        return self._runner.abort(self._call, timeout_s)


def prompt_groups(table: pa.Table) -> Iterator[pa.RecordBatch]:
    """A unit's rows cut into prompts: runs of one prompt_id whose sample_index rises (a
    prompt's rows are contiguous, in sample_index order: JobTask.unit_table)."""
    ids = table.column("prompt_id").to_pylist()
    idx = table.column("sample_index").to_pylist()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] or idx[i] <= idx[i - 1]:
            part = table.slice(start, i - start)
            batches = part.to_batches()
            yield batches[0] if len(batches) == 1 else part.combine_chunks().to_batches()[0]
            start = i
