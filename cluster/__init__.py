"""Ray actors and scheduling for batchgen: work units in, committed unit files out.

cluster/ knows Ray and the engine's API, not the output schema or the model internals:
a job hands it a `UnitTask` (cluster/unit.py) that reads and writes units.

    from cluster import GenerationPool     # workers kept alive across calls (cluster/generation_pool.py)

Importing cluster loads neither Ray nor torch; GenerationPool is imported on first use.
"""

__all__ = ["GenerationPool"]


def __getattr__(name: str):
    if name == "GenerationPool":
        from cluster.generation_pool import GenerationPool

        return GenerationPool
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
