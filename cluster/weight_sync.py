"""Swapping a checkpoint's weights into every worker's engine, all or none.

    staged = stage_everywhere(live, path, step, keeps, replace)   # every worker loads and checks it
    states = commit_everywhere(staged, replace)                   # only then does each swap it in

UnitDispatcher.load_weights (cluster/dispatcher.py) runs the two halves between runs, for
GenerationPool.load_weights (jobs/pool.py): first every live worker loads the checkpoint
and checks that it fits its model (GenerationWorker.stage_weights; its engine keeps
decoding any late copy of an earlier run meanwhile); if one refuses it, every worker drops
its staged copy (discard_weights) and WeightsRefused names the worker and its error: all keep
the weights they had. Otherwise each worker swaps it in (commit_weights) once its engine is
idle, without restarting or reallocating its KV cache. A worker that dies while loading, or
fails in the middle of its swap, is handed to `replace` (uncharged); the dispatcher then
starts its replacement with the new weights once the swap was decided.
"""
from __future__ import annotations

from typing import Any, Callable

from cluster.health import WorkerRecord, short_error


class WeightsRefused(ValueError):
    """`load_weights` was refused: some worker could not load or use the checkpoint (the
    message names the worker and its error); every worker keeps the weights it had."""


Replace = Callable[[WorkerRecord, str], None]


def stage_everywhere(live: list[WorkerRecord], path: str, step: int | None, keeps: str,
                     replace: Replace) -> dict[WorkerRecord, dict]:
    """Every worker of `live` loads and checks checkpoint `path`; returns {worker: its
    stage_weights() reply} when all of them could. Raises WeightsRefused (after every worker
    dropped its staged copy) when one refused it or all died; `keeps` names the weights they
    keep, for the message."""
    import ray
    from ray.exceptions import RayTaskError

    refs = {w.handle.stage_weights.remote(path, step): w for w in live}
    staged: dict[WorkerRecord, dict] = {}
    refused: list[str] = []
    for ref, w in refs.items():
        try:
            staged[w] = ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            refused.append(f"{w.name}: {type(cause).__name__}: {short_error(cause)}")
        except Exception as exc:  # noqa: BLE001 - RayActorError: the worker is gone
            replace(w, f"worker {w.name} died while loading weights: {short_error(exc)}")
    if refused or not staged:
        for ref in [w.handle.discard_weights.remote() for w in staged]:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - a worker gone meanwhile keeps nothing staged
                pass
        why = refused[0] if refused else "every worker died while loading it"
        raise WeightsRefused(f"load_weights({path!r}) refused by {len(refused) or len(live)} of {len(live)} "
                             f"worker(s); {why}; the workers keep the weights of {keeps}")
    return staged


def commit_everywhere(staged: dict[WorkerRecord, Any], replace: Replace) -> list[dict]:
    """Every staged worker swaps its copy in; returns their engine_state() replies. A worker
    whose swap fails (its engine may be half swapped) is handed to `replace`."""
    import ray

    commits = {w.handle.commit_weights.remote(): w for w in staged}
    states = []
    for ref, w in commits.items():
        try:
            states.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - a half-swapped engine: replace the worker
            replace(w, f"its weights swap failed: {short_error(exc, 300)}")
    return states
