"""Swapping weights into every worker's engine, all or none: a checkpoint's, or a trainer's
tensors from memory sent in buckets through Ray's object store.

    staged = stage_everywhere(live, path, step, keeps, replace)   # every worker checks the checkpoint
    states = commit_everywhere(staged, replace, version)          # only then does each swap it in

    states = update_everywhere(live, named_tensors, bucket_bytes, version, keeps, replace)

UnitDispatcher.load_weights (cluster/dispatcher.py) runs the first two between runs, for
GenerationPool.load_weights (jobs/pool.py): first every live worker checks that the
checkpoint fits its model (GenerationWorker.stage_weights, reading only the files' headers;
its engine keeps decoding any late copy of an earlier run meanwhile); if one refuses it,
every worker drops what it staged (discard_weights) and WeightsRefused names the worker and
its error: all keep the weights they had. Otherwise each worker swaps it in (commit_weights)
once its engine is idle, reading the files tensor by tensor, without restarting or
reallocating its KV cache.

UnitDispatcher.update_weights, for GenerationPool.update_weights, does the same with tensors
from memory (the approach of slime's and SGLang's weight updates): first every worker checks
the tensors' index, (name, dtype, shape) each, against its model (check_update; nothing is
sent yet), all or none as above; then the tensors are grouped into buckets of about
`bucket_bytes` (one contiguous buffer in the store and a small index of name, dtype and
shape: cluster/weight_buckets.py), each bucket put into the object store once (one copy per node,
which the workers there read without copying) and applied by every worker (apply_bucket:
each tensor cast and copied into its place, engine/loading/weight_map.py), at most two
buckets in flight; finish_update ends the swap. Host memory above the model: the buckets
in flight in the object store (at most two, each freed once every worker applied it), never
a staged copy per worker, nor a packed copy in the driver. Nothing is kept afterwards: a
worker started later (replacing a crashed one) loads the pool's checkpoint and then copies
a live worker's weights, bucket by bucket (cluster/weight_buckets.py `load_pool_weights`);
if none is left, the update's weights are lost and runs fail, naming it, until the next
swap (cluster/health.py). If the driver fails while sending (interrupted, out of memory),
every worker it had started sending to is replaced.

A worker that dies while checking, or fails in the middle of its swap, is handed to
`replace` (uncharged); the dispatcher then starts its replacement with the new weights once
the swap was decided. So is one that is hung: its call has not returned within `timeout_s`
(the dispatcher's `start_timeout_s`: a swap reads what a start loads) and its engine has
not moved meanwhile (no token generated since the call began, or since the last such
check), or its progress() does not answer either (a stopped process). A worker's swap
waits for its engine to finish the samples it holds (a call overlapping the swap), which
may take longer than `timeout_s`: while they move, the deadline moves with them. Without
this a stopped or stuck worker held the trainer's call for ever.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from cluster.health import WorkerRecord, short_error
from cluster.weight_buckets import PoolWeights, pack_buckets, tensor_index


class WeightsRefused(ValueError):
    """`load_weights` or `update_weights` was refused: some worker could not load or use the
    weights (the message names the worker and its error, e.g. every difference between the
    tensors given and its model); every worker keeps the weights it had."""


Replace = Callable[[WorkerRecord, str], None]


def _moved(progress: dict) -> tuple:
    """What grows while a worker's engine runs (GenerationWorker.progress())."""
    return progress.get("generated_tokens"), progress.get("finished_requests"), progress.get("finished_units")


class HangDeadline:
    """ray.get of one call per worker of `workers`, all started together, until the worker
    is hung (the module docstring): `get(ref, w)` raises ray's GetTimeoutError once `w`'s
    call has run `timeout_s` (None: no limit) with its engine still since the last check,
    or its progress() has not answered within min(timeout_s, PROGRESS_S)."""

    PROGRESS_S = 60.0

    def __init__(self, timeout_s: float | None, workers: Any = ()) -> None:
        self.timeout_s = timeout_s
        self.end = None if timeout_s is None else time.monotonic() + timeout_s
        # each worker's engine counters when its call began (read at its first check), then
        # at its last check
        self._asked = {} if timeout_s is None else {w: w.handle.progress.remote() for w in workers}
        self._seen: dict[WorkerRecord, tuple] = {}

    def get(self, ref: Any, w: WorkerRecord) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        end = self.end
        while True:
            try:
                return ray.get(ref, timeout=None if end is None else max(0.0, end - time.monotonic()))
            except GetTimeoutError:
                if not self._still_moving(w):
                    raise
                end = time.monotonic() + self.timeout_s  # busy finishing samples: another period

    def _still_moving(self, w: WorkerRecord) -> bool:
        """Whether `w`'s engine generated or finished anything since the last check (its
        progress() answering in time), recording what it reports now."""
        import ray

        wait = min(self.timeout_s, self.PROGRESS_S)
        try:
            if w in self._asked:
                self._seen[w] = _moved(ray.get(self._asked.pop(w), timeout=wait))
            now = _moved(ray.get(w.handle.progress.remote(), timeout=wait))
        except Exception:  # noqa: BLE001 - no answer (stopped, or gone): hung
            return False
        before, self._seen[w] = self._seen.get(w), now
        return before is not None and now != before

    def why(self, w: WorkerRecord, what: str, exc: BaseException) -> str:
        """Why `w` is replaced after its call `what` raised `exc`."""
        from ray.exceptions import GetTimeoutError

        if isinstance(exc, GetTimeoutError):
            return (f"worker {w.name} did not answer {what} within {self.timeout_s:.0f} s, its engine still "
                    f"meanwhile (hung)")
        return f"worker {w.name} failed in {what}: {short_error(exc, 300)}"


def stage_everywhere(live: list[WorkerRecord], path: str, step: int | None, keeps: str,
                     replace: Replace, timeout_s: float | None = None) -> dict[WorkerRecord, dict]:
    """Every worker of `live` checks checkpoint `path`; returns {worker: its stage_weights()
    reply} when all of them could, every reply of the same step (step None: the newest any
    worker found, staged again everywhere when they found different ones). Raises
    WeightsRefused (after every worker dropped what it staged) when one refused it or all
    died or hung (`timeout_s`: see the module docstring; those are handed to `replace`);
    `keeps` names the weights they keep, for the message."""
    staged = _everyone_agrees({w.handle.stage_weights.remote(path, step): w for w in live},
                              f"load_weights({path!r})", keeps, replace, timeout_s)
    if isinstance(staged, str):
        raise WeightsRefused(staged)
    steps = {reply["step"] for reply in staged.values()}
    if step is None and len(steps) > 1 and None not in steps:
        # Each worker took the newest step it saw, and a trainer saved a newer one between
        # their listings: stage that one everywhere (it is on disk, one worker read it), so
        # every engine swaps in the same weights and the pool records the step they hold.
        newest = max(steps)
        staged = _everyone_agrees({w.handle.stage_weights.remote(path, newest): w for w in staged},
                                  f"load_weights({path!r}, step={newest})", keeps, replace, timeout_s)
        if isinstance(staged, str):
            raise WeightsRefused(staged)
    return staged


def _everyone_agrees(refs: dict, what: str, keeps: str, replace: Replace,
                     timeout_s: float | None = None) -> dict | str:
    """{worker: reply} of every worker that answered `refs` (a hung one, `timeout_s`: see the
    module docstring, does not), or the WeightsRefused message when one refused (every
    worker then drops what it staged) or all died or hung (each handed to `replace`)."""
    from ray.exceptions import GetTimeoutError, RayTaskError

    replies: dict[WorkerRecord, dict] = {}
    refused: list[str] = []
    deadline = HangDeadline(timeout_s, refs.values())
    for ref, w in refs.items():
        try:
            replies[w] = deadline.get(ref, w)
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            refused.append(f"{w.name}: {type(cause).__name__}: {short_error(cause, 2000)}")
        except GetTimeoutError as exc:  # stopped, or stuck: as good as dead
            replace(w, deadline.why(w, f"{what}'s check", exc))
        except Exception as exc:  # noqa: BLE001 - RayActorError: the worker is gone
            replace(w, f"worker {w.name} died while checking weights: {short_error(exc)}")
    if refused or not replies:
        undo = HangDeadline(timeout_s, replies)
        for ref, w in [(w.handle.discard_weights.remote(), w) for w in replies]:
            try:
                undo.get(ref, w)
            except Exception:  # noqa: BLE001 - a worker gone meanwhile keeps nothing staged
                pass
        why = refused[0] if refused else "every worker died or hung while checking it"
        return (f"{what} refused by {len(refused) or len(refs)} of {len(refs)} worker(s); {why}; the workers "
                f"keep the weights of {keeps}")
    return replies


def commit_everywhere(staged: dict[WorkerRecord, Any], replace: Replace, version: int,
                      timeout_s: float | None = None) -> list[dict]:
    """Every staged worker swaps its copy in, taking weight_version `version`; returns their
    engine_state() replies. A worker whose swap fails (its engine may be half swapped) or
    that hangs (`timeout_s`: see the module docstring) is handed to `replace`."""
    commits = {w.handle.commit_weights.remote(version): w for w in staged}
    deadline = HangDeadline(timeout_s, commits.values())
    states = []
    for ref, w in commits.items():
        try:
            states.append(deadline.get(ref, w))
        except Exception as exc:  # noqa: BLE001 - a half-swapped engine: replace the worker
            replace(w, deadline.why(w, "its weights swap", exc))
    return states


def update_everywhere(live: list[WorkerRecord], pairs: list[tuple[str, Any]], bucket_bytes: int, version: int,
                      keeps: str, replace: Replace, timeout_s: float | None = None) -> list[dict]:
    """Every worker of `live` checks the tensors' index, then (all agreeing) applies them
    bucket by bucket and takes weight_version `version` (see the module docstring).
    Returns their engine_state() replies. Raises WeightsRefused (every worker keeps its
    weights) when one refused or all died, TypeError for an entry that is not a (name,
    tensor) pair. A worker that fails while copying is handed to `replace` (the caller
    replaces it once the update is recorded, so its replacement copies the new weights),
    as is a hung one (the module docstring); a failure of the driver while
    sending hands every worker that got a bucket to it."""
    import ray

    index = tensor_index(pairs)
    checked = _everyone_agrees({w.handle.check_update.remote(index): w for w in live},
                               "update_weights", keeps, replace, timeout_s)
    if isinstance(checked, str):
        raise WeightsRefused(checked)
    ok = list(checked)
    failed: list[tuple[WorkerRecord, str]] = []
    window: deque = deque()

    def drain(entry: tuple) -> None:
        deadline, calls = entry
        for ref, w in calls.items():
            try:
                deadline.get(ref, w)
            except Exception as exc:  # noqa: BLE001 - a half-swapped engine: replace the worker
                if w in ok:
                    ok.remove(w)
                    failed.append((w, deadline.why(w, "a bucket of its weights update", exc)))

    sent = False  # whether any worker was sent a bucket (and so may hold part of the update)
    try:
        for bucket in pack_buckets(pairs, bucket_bytes):
            ref = ray.put(bucket)  # freed once every worker applied it (no call holds it then)
            del bucket
            sent = True
            window.append((HangDeadline(timeout_s, ok), {w.handle.apply_bucket.remote(ref): w for w in ok}))
            del ref
            if len(window) > 1:
                drain(window.popleft())
        while window:
            drain(window.popleft())
    except BaseException:
        if sent:  # half swapped by a driver-side failure: every worker that started copying
            for w in ok:
                failed.append((w, "the driver failed while sending weights"))
            ok.clear()
        raise
    finally:
        for w, why in failed:
            replace(w, why)
    states = []
    finish = {w.handle.finish_update.remote(version): w for w in ok}
    deadline = HangDeadline(timeout_s, ok)
    for ref, w in finish.items():
        try:
            states.append(deadline.get(ref, w))
        except Exception as exc:  # noqa: BLE001
            replace(w, deadline.why(w, "finishing its weights update", exc))
    return states


__all__ = ["PoolWeights", "WeightsRefused", "commit_everywhere", "stage_everywhere", "update_everywhere"]
