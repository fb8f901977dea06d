"""What the Ray cluster can host: local GPUs before Ray starts, alive nodes while a job runs.

    local_gpu_count()                 GPUs Ray will find on this machine (0 without any)
    feasibility(needs)                can any alive node ever host one worker? (needs Ray)

Both follow Ray's own rules, so what they say is what Ray's scheduler will do:
- local GPUs: Ray's NVIDIA accelerator manager (NVML device count, capped by
  CUDA_VISIBLE_DEVICES), the count `ray.init()` detects when it is not given `num_gpus`;
- a node can host a worker when its *total* resources (not what is free now) cover the
  worker's request: free capacity comes back when other actors end, a missing resource
  never does.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def local_gpu_count() -> int:
    """GPUs that `ray.init(address="local")` will register on this machine (Ray's detection).

    Uses Ray's accelerator manager (NVML, capped by CUDA_VISIBLE_DEVICES); returns 0 when
    there is no NVIDIA driver, and falls back to 0 if Ray's internal API is not there.
    """
    try:
        from ray._private import accelerators
    except ImportError:  # pragma: no cover - Ray is a dependency
        return 0
    try:
        manager = accelerators.get_accelerator_manager_for_resource("GPU")
        count = int(manager.get_current_node_num_accelerators())
        visible = manager.get_current_process_visible_accelerator_ids()
    except Exception:  # noqa: BLE001 - private API of the installed Ray: detection is best effort
        return 0
    return min(count, len(visible)) if visible is not None else count


@dataclass(slots=True)
class Feasibility:
    """Whether some alive node could host a worker.

    ok: at least one alive node's total resources cover `needs`.
    alive, dead: node counts; why: a sentence for an error or progress message.
    """

    ok: bool
    alive: int
    dead: int
    why: str = ""
    dead_nodes: list[str] = field(default_factory=list)


def _describe(needs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in needs.items()) or "no resources"


def feasibility(needs: dict[str, float], nodes: list[dict] | None = None) -> Feasibility:
    """Check `needs` ({"CPU": 1, "GPU": 1, "gen": 1}, zeros ignored) against the cluster's
    alive nodes (`ray.nodes()`, or `nodes` given for tests). Never raises for a node list
    it cannot read: a failing `ray.nodes()` counts as "cannot tell" (ok=True)."""
    needs = {k: float(v) for k, v in needs.items() if v}
    if nodes is None:
        try:
            import ray

            nodes = ray.nodes()
        except Exception:  # noqa: BLE001 - the GCS may be briefly unreachable: do not decide on that
            return Feasibility(ok=True, alive=0, dead=0, why="node list unavailable")
    alive = [n for n in nodes if n.get("Alive")]
    dead = [n for n in nodes if not n.get("Alive")]
    dead_names = [f"{str(n.get('NodeID', '?'))[:8]} ({n.get('NodeManagerAddress', '?')})" for n in dead]
    for n in alive:
        total = n.get("Resources") or {}
        if all(total.get(k, 0.0) >= v for k, v in needs.items()):
            return Feasibility(ok=True, alive=len(alive), dead=len(dead), dead_nodes=dead_names)
    if not alive:
        why = (f"no alive Ray node ({len(dead)} dead: {', '.join(dead_names[:5])})" if dead
               else "no Ray node at all")
    else:
        why = (f"none of the {len(alive)} alive Ray nodes has the resources of one worker ({_describe(needs)})"
               + (f"; {len(dead)} dead: {', '.join(dead_names[:5])}" if dead else ""))
    return Feasibility(ok=False, alive=len(alive), dead=len(dead), why=why, dead_nodes=dead_names)
