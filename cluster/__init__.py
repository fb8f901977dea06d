"""Ray actors and scheduling for batchgen: work units in, committed unit files out.

cluster/ knows Ray and the engine's API, not the output schema or the model internals:
a job hands it a `UnitTask` (cluster/unit.py) that reads and writes units, and cluster/
never imports jobs/.

    from cluster.dispatcher import UnitDispatcher   # units -> GenerationWorker actors, through faults

Importing cluster loads neither Ray nor torch.

`GenerationPool` (workers kept alive across calls) is jobs.pool.GenerationPool:
`from jobs import GenerationPool`. `from cluster import GenerationPool` still works for one
release and warns (DeprecationWarning).
"""

__all__ = ["GenerationPool"]  # deprecated alias (see the module docstring)


def __getattr__(name: str):
    if name == "GenerationPool":
        # deprecated alias, for one release: the pool is built from a job config, so it is jobs/'s
        import importlib
        import warnings

        warnings.warn("`from cluster import GenerationPool` is deprecated: use `from jobs import GenerationPool`",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module("jobs.pool").GenerationPool
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
